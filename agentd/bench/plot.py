"""``--plot``: TTFT distributions of cache hits and misses, and throughput against concurrency.

Invariants: matplotlib is imported only here, with the non-interactive Agg backend (no display
needed); a request counts as a hit when the server reported at least half of its prompt tokens
cached, and, for a server that reports no cached tokens, by its phase (warm and pinned phases
hit, cold ones miss); only requests sent one at a time are counted (under concurrency TTFT
includes queueing), and pressure-fill prompts are left out (they measure nothing).
"""

from __future__ import annotations

from pathlib import Path

from agentd.bench.client import RequestResult
from agentd.bench.results import HIT_PHASES, MISS_PHASES, WorkloadResult, baseline_figures, figures

SKIPPED_PHASES = ("pressure_fill", "prime")


def is_hit(phase: str, result: RequestResult) -> bool | None:
    if result.cached_tokens is not None and result.prompt_tokens:
        return result.cached_tokens >= result.prompt_tokens / 2
    if phase in HIT_PHASES:
        return True
    return False if phase in MISS_PHASES else None


def hit_miss_ttfts(results: list[WorkloadResult]) -> tuple[list[float], list[float]]:
    hits: list[float] = []
    misses: list[float] = []
    for r in results:
        for name, phase in r.phases.items():
            if name in SKIPPED_PHASES or phase.concurrency != 1:
                continue
            for x in phase.results:
                hit = is_hit(name, x)
                if x.ttft_s is not None and hit is not None:
                    (hits if hit else misses).append(x.ttft_s)
    return hits, misses


def write_plot(path: Path, results: list[WorkloadResult], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_tput) = plt.subplots(1, 2, figsize=(12, 4.5))
    hits, misses = hit_miss_ttfts(results)
    values = hits + misses
    if values:
        low, high = min(values), max(values)
        edges = [low * (high / low) ** (i / 30) for i in range(31)] if high > low > 0 \
            else 30
        ax_ttft.hist([hits, misses], bins=edges, label=[f"hit ({len(hits)})",
                                                        f"miss ({len(misses)})"],
                     color=["tab:green", "tab:red"], alpha=0.8)
        if high > low > 0:
            ax_ttft.set_xscale("log")
    ax_ttft.set_xlabel("TTFT (s)")
    ax_ttft.set_ylabel("requests")
    ax_ttft.set_title("TTFT of sequential requests: prefix-cache hits vs misses")
    ax_ttft.legend()
    for r in results:
        tput = figures(r)["throughput"]
        keys = sorted((k for k in tput if k.isdigit()), key=int)
        xs = [int(k) for k in keys]
        line, = ax_tput.plot(xs, [tput[k]["output_tokens_per_s"] for k in keys], marker="o",
                             label=r.workload.name)
        if r.baseline is not None:
            base = baseline_figures(r.baseline)["output_tokens_per_s"]
            ax_tput.axhline(base, linestyle="--", color=line.get_color(),
                            label=f"{r.workload.name}: HF generate (sequential)")
    levels = sorted({int(k) for r in results for k in figures(r)["throughput"] if k.isdigit()})
    ax_tput.set_xscale("log", base=2)
    ax_tput.set_xticks(levels, [str(c) for c in levels])
    ax_tput.set_ylim(bottom=0)
    ax_tput.set_xlabel("concurrency")
    ax_tput.set_ylabel("output tokens/s (prefill included)")
    ax_tput.set_title("throughput vs concurrency")
    ax_tput.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
