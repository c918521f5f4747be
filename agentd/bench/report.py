"""The benchmark's rich table: one row per figure, one column per workload (plus, with a
baseline, the baseline's figure and the speedup over it).

Invariants: every number shown is one of ``results.figures`` / ``results.baseline_figures`` (the
JSON holds the same); a figure that was not measured prints as "—"; a speedup is always "how many
times better": baseline time / our time for latencies, our rate / baseline rate for throughput.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table

from agentd.bench.client import ServerInfo
from agentd.bench.results import WorkloadResult, baseline_figures, figures, sent_summary

DASH = "—"
Figures = dict[str, Any]


def fmt_s(value: float | None) -> str:
    if value is None:
        return DASH
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def fmt_pair(p50: float | None, p90: float | None) -> str:
    return DASH if p50 is None else f"{fmt_s(p50)} / {fmt_s(p90)}"


def fmt_bytes(value: int | None) -> str:
    return DASH if value is None else f"{value / 2**20:,.0f} MiB"


def fmt_pct(value: float | None) -> str:
    return DASH if value is None else f"{100 * value:.1f}%"


def fmt_x(value: float | None) -> str:
    return DASH if value is None else f"{value:.1f}×"


def speedup(baseline: float | None, ours: float | None) -> float | None:
    return baseline / ours if baseline is not None and ours else None


def fmt_tput(t: Figures | None) -> str:
    if not t or t["output_tokens_per_s"] is None:
        return DASH
    return (f"{t['output_tokens_per_s']:.1f} tok/s · {t['requests_per_s']:.2f} req/s · "
            f"p90 {fmt_s(t['ttft_p90_s'])}")


# (label, ours, baseline, speedup); each takes the workload's figures and the baseline's (or {}).
Row = tuple[str, Callable[[Figures], str], Callable[[Figures], str],
            Callable[[Figures, Figures], float | None]]


def _ttft_rows(num_cold: int) -> list[Row]:
    def pair(key: str) -> Callable[[Figures], str]:
        return lambda f: fmt_pair(f[f"{key}_ttft_p50_s"], f[f"{key}_ttft_p90_s"])

    def base_warm(b: Figures) -> str:
        return fmt_pair(b.get("warm_ttft_p50_s"), b.get("warm_ttft_p90_s"))

    def vs_warm(key: str) -> Callable[[Figures, Figures], float | None]:
        return lambda f, b: speedup(b.get("warm_ttft_p50_s"), f[f"{key}_ttft_p50_s"])

    none: Callable[[Figures], str] = lambda b: ""  # noqa: E731
    return [
        (f"cold TTFT (median of {num_cold})", lambda f: fmt_s(f["cold_ttft_s"]),
         lambda b: fmt_s(b.get("cold_ttft_s")),
         lambda f, b: speedup(b.get("cold_ttft_s"), f["cold_ttft_s"])),
        ("warm TTFT p50 / p90, no pin", pair("warm_unpinned"), base_warm,
         vs_warm("warm_unpinned")),
        ("warm TTFT p50 / p90, pinned", pair("warm_pinned"), base_warm, vs_warm("warm_pinned")),
        ("warm / cold TTFT (p50)", lambda f: DASH if f["warm_cold_ratio"] is None
         else f"{f['warm_cold_ratio']:.3f}", none, lambda f, b: None),
        ("after cache pressure, pinned", pair("pressure_pinned"), none, lambda f, b: None),
        ("after cache pressure, was warm", pair("pressure_unpinned"), none, lambda f, b: None),
        ("multi-turn TTFT p50 / p90", pair("multiturn"), none, lambda f, b: None),
    ]


def _throughput_rows(keys: list[str]) -> list[Row]:
    def ours(key: str) -> Callable[[Figures], str]:
        return lambda f: fmt_tput(f["throughput"].get(key))

    def base(b: Figures) -> str:
        if b.get("output_tokens_per_s") is None:
            return ""
        return f"{b['output_tokens_per_s']:.1f} tok/s · {b['requests_per_s']:.2f} req/s (seq.)"

    def vs(key: str) -> Callable[[Figures, Figures], float | None]:
        def ratio(f: Figures, b: Figures) -> float | None:
            t = f["throughput"].get(key) or {}
            return speedup(t.get("output_tokens_per_s"), b.get("output_tokens_per_s"))
        return ratio

    rows: list[Row] = []
    for key in keys:
        c, _, empty = key.partition("_")
        label = f"c={c}" + (" from an empty cache" if empty else "")
        rows.append((label, ours(key), base, vs(key)))
    return rows


def _other_rows() -> list[Row]:
    def rss(f: Figures) -> str:
        if f["peak_rss_bytes"] is None:
            return DASH
        return f"{fmt_bytes(f['peak_rss_bytes'])} (lifetime {fmt_bytes(f['hwm_bytes'])})"

    def pin(f: Figures) -> str:
        if f["pin_num_tokens"] is None:
            return DASH
        return f"{f['pin_num_tokens']} tokens, registered in {fmt_s(f['pin_prefill_s'])}"

    return [
        ("prefix-cache hit rate (server)", lambda f: fmt_pct(f["prefix_cache_hit_rate"]),
         lambda b: "", lambda f, b: None),
        ("cached prompt tokens (usage)", lambda f: fmt_pct(f["usage_cached_fraction"]),
         lambda b: "", lambda f, b: None),
        ("peak RSS", rss, lambda b: fmt_bytes(b.get("peak_rss_bytes")), lambda f, b: None),
        ("pin", pin, lambda b: "", lambda f, b: None),
    ]


def column_header(result: WorkloadResult) -> str:
    """What was sent: prompt tokens (as the server counted them), tools, output tokens."""
    s = sent_summary(result)
    tokens = DASH if s["prompt_tokens_mean"] is None else f"{s['prompt_tokens_mean']:,.0f}"
    budget = "whole" if s["prompt_budget"] is None else f"budget {s['prompt_budget']:,}"
    out = f"{s['max_tokens']} out"
    if s["output_tokens_mean"] is not None and round(s["output_tokens_mean"]) != s["max_tokens"]:
        out = f"{s['output_tokens_mean']:.1f} out (max {s['max_tokens']})"  # EOS not ignored
    return (f"{s['workload']}\n{tokens} prompt tok ({budget})\n"
            f"{s['num_tools']}/{s['num_tools_total']} tools · {out}")


def build_table(server: ServerInfo, results: list[WorkloadResult], num_cold: int,
                load_avg: tuple[float, float] | None = None) -> Table:
    """``load_avg``: the 1-minute load average when the run started and when it ended."""
    where = f"{server.kind} {server.version or ''}".strip()
    load = "" if load_avg is None else \
        f" · load avg {load_avg[0]:.1f} → {load_avg[1]:.1f} on {os.cpu_count()} CPUs"
    table = Table(title=f"agentd bench · {where} at {server.root_url} · model {server.model}"
                        f"{load}", title_justify="left", show_lines=False)
    table.add_column("figure", style="bold")
    with_baseline = any(r.baseline is not None for r in results)
    for r in results:
        table.add_column(column_header(r), justify="right")
        if with_baseline:
            table.add_column("HF generate\n(sequential)", justify="right", style="dim")
            table.add_column("speedup", justify="right", style="green")
    per_workload = [(figures(r), baseline_figures(r.baseline) if r.baseline else {})
                    for r in results]
    keys = sorted({k for f, _ in per_workload for k in f["throughput"]},
                  key=lambda k: (int(k.partition("_")[0]), k))
    sections = [_ttft_rows(num_cold), _throughput_rows(keys), _other_rows()]
    for n, rows in enumerate(sections):
        for label, ours, base, vs in rows:
            cells = [label]
            for f, b in per_workload:
                cells.append(ours(f))
                if with_baseline:
                    shown = base(b) if b else DASH
                    ratio = vs(f, b) if b and shown else None
                    cells += [shown, "" if ratio is None else fmt_x(ratio)]
            table.add_row(*cells, end_section=(label == rows[-1][0] and n < len(sections) - 1))
    return table


def notes(results: list[WorkloadResult]) -> list[str]:
    out = ["TTFT = time to the first content or tool-call chunk; throughput = output tokens / "
           "wall time of the phase, prefill included; greedy."]
    for r in results:
        out += [f"{r.workload.name}: {note}" for note in r.notes]
        if r.baseline is not None:
            out.append(f"{r.workload.name}: HF baseline = transformers generate, fp32, "
                       f"{len(r.baseline.results)} requests one at a time "
                       f"({r.baseline.model_path})")
    return out


def compute_lines(server: ServerInfo) -> list[str]:
    """The server's ISA, dtype, weight format and kernels (agentd only), and this CPU's."""
    from agentd.model.isa import detect_isa

    lines = [f"this CPU: {detect_isa().describe()}"]
    c = server.compute
    if c:
        lines.append(f"{server.kind}: {c.get('isa') or c.get('device')} · dtype {c.get('dtype')}"
                     f" · weights {c.get('weights')}")
        lines += [f"  {kind}: {choice}" for kind, choice in (c.get("kernels") or {}).items()]
    return lines


def print_report(console: Console, server: ServerInfo, results: list[WorkloadResult],
                 num_cold: int, load_avg: tuple[float, float] | None = None) -> None:
    console.print(build_table(server, results, num_cold, load_avg))
    for line in compute_lines(server):
        console.print(line, highlight=False)
    for line in notes(results):
        console.print(line, style="dim", highlight=False)
