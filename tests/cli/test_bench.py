"""``agentd bench``: help and user errors without a server, then the whole benchmark with tiny
counts against a real daemon (a tiny random llama) — once as agentd (pins, cache salts, stats,
memory) and once as a generic OpenAI server with the transformers baseline — checking every
figure of the JSON and that the plot is written."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner, Result

from agentd.cli import main

PROMPT_TOKENS = 2100
MAX_TOKENS = 32


@pytest.fixture
def runner(monkeypatch) -> CliRunner:
    for name in [n for n in os.environ if n.startswith(("AGENTD_", "OPENAI_"))]:
        monkeypatch.delenv(name)
    return CliRunner()


def error_line(result: Result) -> str:
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    return lines[0]


def test_help(runner: CliRunner) -> None:
    result = runner.invoke(main, ["bench", "--help"])
    assert result.exit_code == 0, result.output
    for option in ("--url", "--prompt-tokens", "--full-prompts", "--baseline", "--plot",
                   "--json", "--quick", "--openai-compatible", "--no-pin", "--concurrency"):
        assert option in result.output


def test_nothing_listening_says_how_to_start_one(runner: CliRunner, free_port) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    line = error_line(runner.invoke(main, ["bench", "--url", url, "--quick"]))
    assert "agentd start" in line and url in line


def test_user_errors_are_one_line(runner: CliRunner, monkeypatch, tmp_path) -> None:
    from agentd.cli import bench

    line = error_line(runner.invoke(main, ["bench", "--concurrency", "1,x"]))
    assert "1,8,32" in line
    line = error_line(runner.invoke(main, ["bench", "--full-prompts", "--prompt-tokens", "900"]))
    assert "exclude" in line
    monkeypatch.setattr(bench, "has_module", lambda name: False)
    line = error_line(runner.invoke(main, ["bench", "--plot", str(tmp_path / "p.png")]))
    assert "pip install 'agentd[plot]'" in line


@pytest.fixture(scope="module")
def tiny_daemon(tiny_model_factory, tmp_path_factory, daemon_process) -> Iterator[tuple[str, Path]]:
    """A real ``agentd start`` on a tiny random llama with a 16 MiB pool; (URL, model dir)."""
    model_dir = tiny_model_factory("llama")
    with daemon_process(tmp_path_factory.mktemp("bench-state"), "--model", str(model_dir),
                        "--kv-cache-memory", "16MiB", "--log-level", "warning",
                        "--no-kv-disk",  # its pressure phase measures the pool alone
                        ready_timeout_s=120) as daemon:
        yield daemon.url, model_dir


def run_bench(runner: CliRunner, *args: str) -> dict:
    result = runner.invoke(main, ["bench", "--quick", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "cold TTFT" in result.output and "c=1" in result.output
    json_path = Path(args[args.index("--json") + 1])
    return json.loads(json_path.read_text())


def positive(value: float | None) -> bool:
    return value is not None and value > 0


@pytest.mark.slow
def test_bench_against_agentd(runner: CliRunner, tiny_daemon, tmp_path) -> None:
    url, _ = tiny_daemon
    out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
    data = run_bench(runner, "--url", url, "--concurrency", "1,8", "--json", str(out_json),
                     "--plot", str(out_png))
    assert data["server"]["kind"] == "agentd"
    (w,) = data["workloads"]
    f = w["figures"]
    assert positive(f["cold_ttft_s"])
    for key in ("warm_unpinned", "warm_pinned", "pressure_pinned", "pressure_unpinned",
                "multiturn"):
        assert positive(f[f"{key}_ttft_p50_s"]), key
        assert f[f"{key}_ttft_p90_s"] >= f[f"{key}_ttft_p50_s"], key
    assert positive(f["warm_cold_ratio"])
    assert set(f["throughput"]) == {"1", "8", "8_empty"}
    for t in f["throughput"].values():
        assert positive(t["output_tokens_per_s"]) and positive(t["requests_per_s"])
        assert positive(t["ttft_p90_s"])
    assert f["throughput"]["8"]["num_requests"] == 8
    assert 0 < f["prefix_cache_hit_rate"] < 1
    assert f["peak_rss_bytes"] > 50 * 2**20 and f["hwm_bytes"] >= f["peak_rss_bytes"]
    assert positive(f["pin_num_tokens"]) and w["pin"]["name"].startswith("bench-coding_agent")
    # what was sent: the budget, with the median turn; exactly max_tokens out (EOS ignored)
    sent = w["sent"]
    assert abs(sent["prompt_tokens_mean"] - PROMPT_TOKENS) < 40
    assert sent["num_tools"] == 2 and sent["output_tokens_mean"] == MAX_TOKENS
    phases = w["phases"]
    assert all(r["cached_tokens"] == 0 for r in phases["cold"]["requests"])
    assert all(r["cached_tokens"] > 0 for r in phases["warm"]["requests"])
    # the pin survives the pressure; the once-warm prefix does not
    pin_tokens = f["pin_num_tokens"]
    assert all(r["cached_tokens"] >= pin_tokens for r in phases["pressure_pinned"]["requests"])
    assert all(r["cached_tokens"] < pin_tokens for r in phases["pressure_unpinned"]["requests"])
    # ...and it is measured on the pinned phase's own prompts, so the two compare equal turns
    assert ([r["prompt_tokens"] for r in phases["pressure_pinned"]["requests"]]
            == [r["prompt_tokens"] for r in phases["pinned"]["requests"]])
    assert httpx.get(f"{url}/v1/pins").json()["data"] == []  # the run's pin is gone
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_bench_as_another_openai_server_with_hf_baseline(runner: CliRunner, tiny_daemon,
                                                         tmp_path) -> None:
    url, model_dir = tiny_daemon
    out_json = tmp_path / "generic.json"
    data = run_bench(runner, "--url", url + "/v1", "--openai-compatible", "--no-pin",
                     "--concurrency", "1,2", "--pressure-tokens", "8000", "--baseline", "hf",
                     "--baseline-model", str(model_dir), "--json", str(out_json))
    assert data["server"]["kind"] == "openai" and data["server"]["pid"] is None
    (w,) = data["workloads"]
    f = w["figures"]
    assert positive(f["cold_ttft_s"]) and positive(f["warm_unpinned_ttft_p50_s"])
    assert f["warm_pinned_ttft_p50_s"] is None and f["pressure_pinned_ttft_p50_s"] is None
    assert positive(f["pressure_unpinned_ttft_p50_s"])
    assert set(f["throughput"]) == {"1", "2", "2_empty"}
    assert f["prefix_cache_hit_rate"] is None and f["peak_rss_bytes"] is None
    assert any("--no-pin" in note for note in w["notes"])
    # nonces, not salts: cold requests found nothing cached beyond the template's first tokens
    assert all(r["cached_tokens"] < 100 for r in w["phases"]["cold"]["requests"])
    b = w["baseline"]["figures"]
    assert positive(b["cold_ttft_s"]) and positive(b["output_tokens_per_s"])
    assert b["num_requests"] == 2
    assert all(r["output_tokens"] == MAX_TOKENS for r in w["baseline"]["requests"])


@pytest.mark.slow
def test_bench_speaks_the_responses_and_messages_wires(runner: CliRunner, tiny_daemon,
                                                       tmp_path) -> None:
    """The same conversations over each wire: the same prompts reach the model (equal prompt
    token counts per request), and the cache and the pin hit alike."""
    url, _ = tiny_daemon
    runs = {}
    for api in ("chat", "responses", "messages"):
        out = tmp_path / f"{api}.json"
        runs[api] = run_bench(runner, "--url", url, "--api", api, "--concurrency", "1",
                              "--no-pressure", "--no-empty-cache", "--cold-requests", "2",
                              "--json", str(out))["workloads"][0]
        assert set(runs[api]["figures"]["throughput"]) == {"1"}, api
        assert any("--no-empty-cache" in note for note in runs[api]["notes"]), api
        assert len(runs[api]["phases"]["cold"]["requests"]) == 2, api
    for api in ("responses", "messages"):
        phases, chat = runs[api]["phases"], runs["chat"]["phases"]
        for phase in ("cold", "warm", "pinned", "multiturn"):
            assert ([r["prompt_tokens"] for r in phases[phase]["requests"]]
                    == [r["prompt_tokens"] for r in chat[phase]["requests"]]), (api, phase)
        assert all(r["cached_tokens"] == 0 for r in phases["cold"]["requests"]), api
        assert all(r["cached_tokens"] > 0 for r in phases["warm"]["requests"]), api
        pin_tokens = runs[api]["figures"]["pin_num_tokens"]
        assert all(r["cached_tokens"] >= pin_tokens for r in phases["pinned"]["requests"]), api
        assert runs[api]["sent"]["output_tokens_mean"] == MAX_TOKENS, api
