"""Figures of ``agentd bench`` from raw results: unmeasured figures are None (and print as a
dash), throughput is output tokens over the phase's wall time, and the table and the JSON show
the same numbers."""

from __future__ import annotations

import json

from rich.console import Console

from agentd.bench.client import RequestResult, ServerInfo
from agentd.bench.report import build_table
from agentd.bench.results import (
    BaselineResult,
    Phase,
    WorkloadResult,
    baseline_figures,
    figures,
    percentile,
    to_json,
)
from agentd.bench.workload import Workload

SERVER = ServerInfo("openai", "http://127.0.0.1:1", "m", None, None, None, None, 16)


def request(phase: str, ttft_s: float, cached: int | None = 0) -> RequestResult:
    return RequestResult(phase, ttft_s, ttft_s + 1.0, 100, cached, 32, 0.0)


def result() -> WorkloadResult:
    workload = Workload("w", "system", [], ["hi"], num_tools_total=3)
    r = WorkloadResult(workload, prompt_budget=2100, max_tokens=32)
    r.add(Phase("cold", 1, 9.0, [request("cold", 4.0), request("cold", 2.0),
                                 request("cold", 3.0)]))
    r.add(Phase("warm", 1, 3.0, [request("warm", x, 96) for x in (0.1, 0.2, 0.3)]))
    r.add(Phase("c8", 8, 2.0, [request("c8", 0.5, 96) for _ in range(8)]))
    r.add(Phase("c8_empty", 8, 4.0, [request("c8_empty", 1.5) for _ in range(8)]))
    return r


def test_figures_from_raw_results() -> None:
    f = figures(result())
    assert f["cold_ttft_s"] == 3.0
    assert f["warm_unpinned_ttft_p50_s"] == 0.2
    assert abs(f["warm_unpinned_ttft_p90_s"] - 0.28) < 1e-9
    assert f["warm_pinned_ttft_p50_s"] is None and f["pressure_pinned_ttft_p90_s"] is None
    assert abs(f["warm_cold_ratio"] - 0.2 / 3.0) < 1e-9
    assert set(f["throughput"]) == {"8", "8_empty"}
    assert f["throughput"]["8"]["output_tokens_per_s"] == 8 * 32 / 2.0
    assert f["throughput"]["8_empty"]["requests_per_s"] == 2.0
    assert f["prefix_cache_hit_rate"] is None and f["peak_rss_bytes"] is None
    assert abs(f["usage_cached_fraction"] - (3 * 96 + 8 * 96) / (22 * 100)) < 1e-9


def test_percentile_of_one_and_none() -> None:
    assert percentile([], 90) is None
    assert percentile([2.5], 90) == 2.5


def test_table_and_json_agree_and_dash_what_was_not_measured() -> None:
    r = result()
    r.baseline = BaselineResult("hf", [request("baseline", 4.0) for _ in range(3)], 15.0, 3,
                                None)
    console = Console(width=250, record=True)
    console.print(build_table(SERVER, [r], num_cold=3))
    text = console.export_text()
    assert "3.00 s" in text  # cold
    assert "200 ms / 280 ms" in text  # warm p50 / p90
    assert "128.0 tok/s" in text  # c=8
    assert "—" in text  # pinned, pressure: not measured
    assert "20.0×" in text  # warm TTFT speedup over the baseline: 4.0 s / 0.2 s
    data = json.loads(json.dumps(to_json(SERVER, [r], {})))
    assert data["workloads"][0]["figures"]["throughput"]["8"]["output_tokens_per_s"] == 128.0
    assert data["workloads"][0]["baseline"]["figures"] == baseline_figures(r.baseline)
    assert data["workloads"][0]["sent"]["num_tools_total"] == 3
