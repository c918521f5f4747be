"""``--plot``: TTFT distributions of cache hits and misses, and throughput against concurrency.

Invariants: matplotlib is imported only here, with the non-interactive Agg backend (no display
needed); a request counts as a hit when the server reported at least half of its prompt tokens
cached, and, for a server that reports no cached tokens, by its phase (warm and pinned phases
hit, cold ones miss); only requests sent one at a time are counted (under concurrency TTFT
includes queueing), and pressure-fill prompts are left out (they measure nothing). The same
picture comes from a run or from its ``--json`` file (``python -m agentd.bench.plot RUN.json
OUT.png``). A person reads it at a glance: TTFT ticks are plain seconds that never overlap, the
request counts are whole numbers, and every throughput run is drawn, the one from an empty cache
as its own marker.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentd.bench.client import RequestResult
from agentd.bench.results import HIT_PHASES, MISS_PHASES, WorkloadResult, baseline_figures, figures

SKIPPED_PHASES = ("pressure_fill", "prime")
EMPTY_SUFFIX = "_empty"  # throughput figures' key for the run from an empty cache


@dataclass
class Curve:
    """One workload's throughput: output tokens/s by concurrency."""

    name: str
    warm: dict[int, float]
    empty: dict[int, float]
    baseline: float | None = None


@dataclass
class PlotData:
    hits: list[float] = field(default_factory=list)
    misses: list[float] = field(default_factory=list)
    curves: list[Curve] = field(default_factory=list)


def is_hit(phase: str, result: RequestResult) -> bool | None:
    if result.cached_tokens is not None and result.prompt_tokens:
        return result.cached_tokens >= result.prompt_tokens / 2
    if phase in HIT_PHASES:
        return True
    return False if phase in MISS_PHASES else None


def _add_ttfts(data: PlotData, phases: Iterable[tuple[str, int, list[RequestResult]]]) -> None:
    for name, concurrency, requests in phases:
        if name in SKIPPED_PHASES or concurrency != 1:
            continue
        for x in requests:
            hit = is_hit(name, x)
            if x.ttft_s is not None and hit is not None:
                (data.hits if hit else data.misses).append(x.ttft_s)


def _curve(name: str, throughput: dict[str, Any], baseline: float | None) -> Curve:
    curve = Curve(name, {}, {}, baseline)
    for key, figure in throughput.items():
        level, empty = key.removesuffix(EMPTY_SUFFIX), key.endswith(EMPTY_SUFFIX)
        if level.isdigit() and figure.get("output_tokens_per_s") is not None:
            (curve.empty if empty else curve.warm)[int(level)] = figure["output_tokens_per_s"]
    return curve


def plot_data(results: list[WorkloadResult]) -> PlotData:
    """What the picture shows, from a run in this process."""
    data = PlotData()
    for r in results:
        _add_ttfts(data, ((n, p.concurrency, p.results) for n, p in r.phases.items()))
        base = None if r.baseline is None else baseline_figures(r.baseline)
        data.curves.append(_curve(r.workload.name, figures(r)["throughput"],
                                  None if base is None else base["output_tokens_per_s"]))
    return data


def plot_data_from_json(doc: dict[str, Any]) -> PlotData:
    """What the picture shows, from a run's ``--json`` file."""
    data = PlotData()
    for w in doc["workloads"]:
        _add_ttfts(data, ((n, p["concurrency"], [RequestResult(**x) for x in p["requests"]])
                          for n, p in w["phases"].items()))
        base = w.get("baseline")
        data.curves.append(_curve(w["name"], w["figures"]["throughput"],
                                  None if base is None
                                  else base["figures"]["output_tokens_per_s"]))
    return data


def draw(data: PlotData, title: str) -> Any:
    """The figure: TTFT histogram (left), throughput against concurrency (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_tput) = plt.subplots(1, 2, figsize=(12, 4.8))
    _draw_ttft(ax_ttft, data.hits, data.misses)
    _draw_throughput(ax_tput, data.curves)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _draw_ttft(ax: Any, hits: list[float], misses: list[float]) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    values = hits + misses
    if values:
        low, high = min(values), max(values)
        log = high > low > 0
        edges = [low * (high / low) ** (i / 30) for i in range(31)] if log else 30
        ax.hist([hits, misses], bins=edges, label=[f"cache hit ({len(hits)})",
                                                   f"miss ({len(misses)})"],
                color=["tab:green", "tab:red"], alpha=0.8)
        if log:  # ticks at 1, 2, 5 x 10^k, written as plain seconds; no minor labels
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.legend()
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("TTFT (s, log scale)")
    ax.set_ylabel("requests")
    ax.set_title("TTFT of sequential requests: prefix-cache hits vs misses")


def _draw_throughput(ax: Any, curves: list[Curve]) -> None:
    for curve in curves:
        xs = sorted(curve.warm)
        line, = ax.plot(xs, [curve.warm[x] for x in xs], marker="o",
                        label=f"{curve.name}: prefix cached")
        for x, value in sorted(curve.empty.items()):
            ax.plot([x], [value], marker="X", markersize=10, linestyle="none",
                    color=line.get_color(), label=f"{curve.name}: c={x} from an empty cache")
            ax.annotate(f"{value:.0f}", (x, value), textcoords="offset points", xytext=(8, -4),
                        fontsize=8)
        if curve.baseline is not None:
            ax.axhline(curve.baseline, linestyle="--", color=line.get_color(),
                       label=f"{curve.name}: HF generate (sequential)")
    levels = sorted({x for c in curves for x in (*c.warm, *c.empty)})
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("concurrency (requests at once)")
    ax.set_ylabel("output tokens/s (prefill included)")
    ax.set_title("throughput vs concurrency")
    ax.legend(fontsize=8)


def write_plot(path: Path, data: PlotData, title: str) -> None:
    import matplotlib.pyplot as plt

    fig = draw(data, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m agentd.bench.plot RUN.json OUT.png", file=sys.stderr)
        return 2
    doc = json.loads(Path(argv[0]).read_text())
    server = doc.get("server", {})
    write_plot(Path(argv[1]), plot_data_from_json(doc),
               f"agentd bench: {server.get('kind')} at {server.get('root_url')}, "
               f"{server.get('model')}")
    print(f"wrote {argv[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
