"""``agentd pin / unpin / pins / stats``: help, one-line errors for bad input files before any
request, and the round trip against a real HTTP server (uvicorn on loopback, tiny model)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from agentd.cli import main

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # tiny llama: layers * K/V * block * kv heads * dim * fp32


@pytest.fixture
def runner(monkeypatch, free_port) -> CliRunner:
    """No AGENTD_* settings from the caller; AGENTD_URL points where nothing listens."""
    for name in [n for n in os.environ if n.startswith("AGENTD_") and n != "AGENTD_CACHE_DIR"]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AGENTD_URL", f"http://127.0.0.1:{free_port()}")
    return CliRunner()


@pytest.fixture(scope="module")
def research(tmp_path_factory) -> dict[str, Path]:
    workload = json.loads(resources.files("agentd.workloads").joinpath("research_agent.json")
                          .read_text())
    root = tmp_path_factory.mktemp("research")
    (root / "research.txt").write_text(workload["system"])
    (root / "tools.json").write_text(json.dumps(workload["tools"], indent=1))
    (root / "workload.json").write_text(json.dumps(workload))
    return {"system": root / "research.txt", "tools": root / "tools.json",
            "workload": root / "workload.json"}


def one_error_line(result: Result) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert result.exit_code == 1
    return lines[0]


@pytest.mark.parametrize("name", ["pin", "unpin", "pins", "stats"])
def test_help(runner: CliRunner, name: str) -> None:
    result = runner.invoke(main, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert f" {name} [OPTIONS]" in result.output and "--url" in result.output


def test_bad_input_files_fail_before_any_request(runner: CliRunner, research: dict,
                                                 tmp_path: Path) -> None:
    missing = one_error_line(runner.invoke(main, ["pin", str(tmp_path / "nope.txt")]))
    assert "nope.txt does not exist" in missing and "system prompt" in missing
    (tmp_path / "empty.txt").write_text(" \n")
    assert "is empty" in one_error_line(runner.invoke(main, ["pin", str(tmp_path / "empty.txt")]))
    (tmp_path / "bad.json").write_text('[{"type": "function",')
    bad = one_error_line(runner.invoke(main, ["pin", str(research["system"]), "--tools",
                                              str(tmp_path / "bad.json")]))
    assert "bad.json is not valid JSON" in bad and "line 1" in bad
    (tmp_path / "notlist.json").write_text('{"name": "x"}')
    shape = one_error_line(runner.invoke(main, ["pin", str(research["system"]), "--tools",
                                                str(tmp_path / "notlist.json")]))
    assert "must hold a JSON list of OpenAI tools" in shape
    ttl = one_error_line(runner.invoke(main, ["pin", str(research["system"]), "--ttl", "soon"]))
    assert "--ttl: cannot parse duration 'soon'" in ttl
    ttl = one_error_line(runner.invoke(main, ["pin", str(research["system"]), "--ttl", "400d"]))
    assert "--ttl: ttl must be at most 365d (a year), got '400d'; omit it" in ttl
    # a good file reaches for the daemon, which is not there
    assert "no agentd daemon at" in one_error_line(
        runner.invoke(main, ["pin", str(research["system"])]))


@pytest.fixture(scope="module")
def daemon_url(tiny_model_factory, free_port) -> Iterator[str]:
    """The real app under uvicorn on a loopback port, over a tiny model (budget: 256 blocks)."""
    import uvicorn

    from agentd.config import EngineConfig
    from agentd.engine.async_engine import AsyncEngine
    from agentd.server.app import create_app

    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_model_factory("llama")), kv_cache_memory_bytes=512 * BLOCK_BYTES))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(EngineConfig(), engine=engine),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)
    engine.shutdown()


def invoke(runner: CliRunner, url: str, *args: str) -> Result:
    return runner.invoke(main, [*args, "--url", url])


def test_pin_pins_stats_unpin_round_trip(runner: CliRunner, daemon_url: str, research: dict,
                                         monkeypatch) -> None:
    pinned = invoke(runner, daemon_url, "pin", str(research["system"]), "--tools",
                    str(research["workload"]), "--ttl", "1h")
    assert pinned.exit_code == 0, pinned.output
    assert pinned.output.startswith("pinned research: ") and " blocks, prefilled in " in \
        pinned.output and "unpinned after 1h without a hit" in pinned.output

    table = invoke(runner, daemon_url, "pins")
    assert table.exit_code == 0 and "research" in table.output and "1h" in table.output
    (listed,) = json.loads(invoke(runner, daemon_url, "pins", "--json").output)
    assert listed["name"] == "research" and listed["ttl"] == 3600 and listed["num_tools"] == 6

    again = invoke(runner, daemon_url, "pin", str(research["system"]))
    assert "could not pin 'research': a pin named 'research' already exists" in \
        one_error_line(again)
    (research["system"].parent / "big.txt").write_text(
        " ".join(f"Rule {i}: always cite the primary source." for i in range(200)))
    over = one_error_line(invoke(runner, daemon_url, "pin",
                                 str(research["system"].parent / "big.txt")))
    assert "pin budget are left" in over and "more pinned blocks" in over

    stats = json.loads(invoke(runner, daemon_url, "stats", "--json").output)
    assert stats["num_pins"] == 1 and stats["pins"][0]["name"] == "research"
    assert {"ttft", "tokens_per_s", "near_misses", "prefix_cache_hit_rate"} <= set(stats)
    shown = invoke(runner, daemon_url, "stats")
    assert shown.exit_code == 0, shown.output
    for needle in ("prefix cache", "pool blocks", "pinned", "time to first token", "research"):
        assert needle in shown.output

    class OneTick:
        def sleep(self, _: float) -> None:
            raise KeyboardInterrupt

    monkeypatch.setattr("agentd.cli.stats.time", OneTick())
    watched = invoke(runner, daemon_url, "stats", "--watch", "0.5")
    assert watched.exit_code == 0 and "time to first token" in watched.output

    assert invoke(runner, daemon_url, "unpin", "research").output == "unpinned research\n"
    assert "no pin named 'research'; list the pins with `agentd pins`" in one_error_line(
        invoke(runner, daemon_url, "unpin", "research"))
    assert "no pins" in invoke(runner, daemon_url, "pins").output


def test_pins_shows_every_name_whole_in_a_narrow_terminal(runner: CliRunner, daemon_url: str,
                                                          tmp_path: Path) -> None:
    """Rich squeezes the first column out first: number columns go (the caption says which)
    before a name would lose a character."""
    name = "research-agent-with-a-long-descriptive-name-v2.1_" + "x" * 15  # 64 characters
    (tmp_path / "brief.txt").write_text("You are a brief agent. Answer in one line. " * 8)
    pinned = invoke(runner, daemon_url, "pin", str(tmp_path / "brief.txt"), "--name", name)
    assert pinned.exit_code == 0, pinned.output
    try:
        for columns in (30, 50, 70, 100):
            table = runner.invoke(main, ["pins", "--url", daemon_url],
                                  env={"COLUMNS": str(columns)})
            assert table.exit_code == 0, table.output
            body = table.output.split("─")[-1].split("not shown at this width")[0]
            names = "".join(line[2:].split(" ")[0] for line in body.splitlines())
            assert name in names and "…" not in body, table.output
            if columns in (30, 100):  # the first drops some numbers, the second none
                assert ("not shown at this width" in table.output) == (columns == 30)
    finally:
        assert invoke(runner, daemon_url, "unpin", name).exit_code == 0


def test_stats_without_a_daemon(runner: CliRunner) -> None:
    assert "no agentd daemon at" in one_error_line(runner.invoke(main, ["stats"]))
