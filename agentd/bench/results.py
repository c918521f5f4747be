"""What one benchmark run measured, and the headline figures derived from it.

Invariants: figures are computed from the raw per-request results only (so the JSON's raw data
reproduces every number in the table); a figure that was not measured is None, never 0; times
are seconds, rates per second; percentiles interpolate linearly between order statistics (the
"inclusive" method), and a single sample is its own p50 and p90.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from agentd.bench.client import RequestResult, ServerInfo
from agentd.bench.workload import Workload

# Phase names; throughput phases are "c<N>" and the empty-cache run "c<N>_empty".
THROUGHPUT_PHASE = re.compile(r"c(\d+(?:_empty)?)")
COLD, WARM, PINNED = "cold", "warm", "pinned"
PRESSURE_PINNED, PRESSURE_UNPINNED = "pressure_pinned", "pressure_unpinned"
MULTITURN = "multiturn"
# Phases whose requests find their prefix cached (when the server caches at all).
HIT_PHASES = (WARM, PINNED, PRESSURE_PINNED)
MISS_PHASES = (COLD, PRESSURE_UNPINNED)


@dataclass
class Phase:
    name: str
    concurrency: int
    wall_s: float
    results: list[RequestResult]

    @property
    def ttfts(self) -> list[float]:
        return [r.ttft_s for r in self.results if r.ttft_s is not None]

    @property
    def num_output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.results)


@dataclass
class BaselineResult:
    """The transformers ``generate`` reference: sequential, no cache across requests."""

    model_path: str
    results: list[RequestResult]
    wall_s: float
    num_cold: int
    peak_rss_bytes: int | None


@dataclass
class WorkloadResult:
    workload: Workload  # as sent (trimmed)
    prompt_budget: int | None  # None: sent whole
    max_tokens: int
    phases: dict[str, Phase] = field(default_factory=dict)
    pin: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    prefix_cache_hit_rate: float | None = None  # from /v1/stats deltas over the run
    peak_rss_bytes: int | None = None
    hwm_bytes: int | None = None
    baseline: BaselineResult | None = None

    def add(self, phase: Phase) -> Phase:
        self.phases[phase.name] = phase
        return phase


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def throughput(phase: Phase) -> dict[str, Any]:
    ttfts = phase.ttfts
    return {
        "concurrency": phase.concurrency, "num_requests": len(phase.results),
        "wall_s": phase.wall_s, "output_tokens": phase.num_output_tokens,
        "output_tokens_per_s": phase.num_output_tokens / phase.wall_s if phase.wall_s else None,
        "requests_per_s": len(phase.results) / phase.wall_s if phase.wall_s else None,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
    }


def sent_summary(result: WorkloadResult) -> dict[str, Any]:
    """What the requests carried: prompt tokens as the server counted them, tools, output."""
    measured = [r for phase in (COLD, WARM, PINNED) if phase in result.phases
                for r in result.phases[phase].results]
    prompt_lens = [r.prompt_tokens for r in measured if r.prompt_tokens]
    outputs = [r.output_tokens for r in measured]
    return {
        "workload": result.workload.name, "prompt_budget": result.prompt_budget,
        "prompt_tokens_mean": statistics.mean(prompt_lens) if prompt_lens else None,
        "prompt_tokens_min": min(prompt_lens, default=None),
        "prompt_tokens_max": max(prompt_lens, default=None),
        "num_tools": len(result.workload.tools),
        "num_tools_total": result.workload.num_tools_total,
        "system_chars": len(result.workload.system),
        "system_chars_total": result.workload.system_chars_total,
        "max_tokens": result.max_tokens,
        "output_tokens_mean": statistics.mean(outputs) if outputs else None,
    }


def figures(result: WorkloadResult) -> dict[str, Any]:
    """The headline numbers of one workload (see the module invariants)."""
    def ttfts(name: str) -> list[float]:
        return result.phases[name].ttfts if name in result.phases else []

    out: dict[str, Any] = {"cold_ttft_s": median(ttfts(COLD))}
    for name, key in ((WARM, "warm_unpinned"), (PINNED, "warm_pinned"),
                      (PRESSURE_PINNED, "pressure_pinned"),
                      (PRESSURE_UNPINNED, "pressure_unpinned"), (MULTITURN, "multiturn")):
        out[f"{key}_ttft_p50_s"] = percentile(ttfts(name), 50)
        out[f"{key}_ttft_p90_s"] = percentile(ttfts(name), 90)
    warm = out["warm_pinned_ttft_p50_s"] or out["warm_unpinned_ttft_p50_s"]
    out["warm_cold_ratio"] = ratio(warm, out["cold_ttft_s"])
    out["throughput"] = {match[1]: throughput(phase) for name, phase in result.phases.items()
                         if (match := THROUGHPUT_PHASE.fullmatch(name))}
    out["prefix_cache_hit_rate"] = result.prefix_cache_hit_rate
    out["usage_cached_fraction"] = cached_fraction(
        [r for phase in result.phases.values() for r in phase.results])
    out["peak_rss_bytes"] = result.peak_rss_bytes
    out["hwm_bytes"] = result.hwm_bytes
    out["pin_num_tokens"] = (result.pin or {}).get("num_tokens")
    out["pin_prefill_s"] = (result.pin or {}).get("prefill_s")
    return out


def baseline_figures(baseline: BaselineResult) -> dict[str, Any]:
    ttfts = [r.ttft_s for r in baseline.results if r.ttft_s is not None]
    num_out = sum(r.output_tokens for r in baseline.results)
    return {
        "cold_ttft_s": median(ttfts[: baseline.num_cold]),
        "warm_ttft_p50_s": percentile(ttfts, 50), "warm_ttft_p90_s": percentile(ttfts, 90),
        "output_tokens_per_s": num_out / baseline.wall_s if baseline.wall_s else None,
        "requests_per_s": len(baseline.results) / baseline.wall_s if baseline.wall_s else None,
        "num_requests": len(baseline.results), "peak_rss_bytes": baseline.peak_rss_bytes,
    }


def cached_fraction(results: list[RequestResult]) -> float | None:
    """Share of prompt tokens the server reported as cached (None if it reports nothing)."""
    known = [r for r in results if r.cached_tokens is not None and r.prompt_tokens]
    prompt = sum(r.prompt_tokens for r in known)
    return sum(r.cached_tokens or 0 for r in known) / prompt if prompt else None


def to_json(server: ServerInfo, results: list[WorkloadResult],
            settings: dict[str, Any]) -> dict[str, Any]:
    """The whole run: settings, server, and per workload what was sent, figures and raw data."""
    return {
        "server": asdict(server), "settings": settings,
        "workloads": [{
            "name": r.workload.name, "sent": sent_summary(r), "figures": figures(r),
            "pin": r.pin, "notes": r.notes,
            "baseline": None if r.baseline is None else {
                "model_path": r.baseline.model_path, "figures": baseline_figures(r.baseline),
                "requests": [asdict(x) for x in r.baseline.results]},
            "phases": {name: {"concurrency": p.concurrency, "wall_s": p.wall_s,
                              "requests": [asdict(x) for x in p.results]}
                       for name, p in r.phases.items()},
        } for r in results],
    }
