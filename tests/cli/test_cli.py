"""The ``agentd`` CLI: help for every command without heavy imports, one-line errors with a
non-zero status for user mistakes, and the ``start --detach`` / ``status`` / ``stop`` round trip
against a real daemon process."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from agentd.cli import COMMANDS, main


@pytest.fixture
def runner(monkeypatch, tmp_path, free_port) -> CliRunner:
    """A runner with no AGENTD_* settings from the caller's environment and its own state dir."""
    for name in [n for n in os.environ if n.startswith("AGENTD_") and n != "AGENTD_CACHE_DIR"]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AGENTD_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("AGENTD_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens
    return CliRunner()


def one_error_line(result: Result) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("Error: ")
    return lines[0]


@pytest.mark.parametrize("args", [[], *([name] for name in COMMANDS)])
def test_help_for_every_command(runner: CliRunner, args: list[str]) -> None:
    result = runner.invoke(main, [*args, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


def test_help_imports_neither_torch_transformers_nor_litestar() -> None:
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from agentd.cli import COMMANDS, main\n"
        "for args in [[], *([name] for name in COMMANDS)]:\n"
        "    assert CliRunner().invoke(main, [*args, '--help']).exit_code == 0\n"
        "print(sorted(m for m in ('torch', 'transformers', 'litestar') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize(("args", "needle"), [
    (["--block-size", "7"], "--block-size must be one of"),
    (["--kv-cache-memory", "lots"], "cannot parse size 'lots'"),
    (["--kv-cache-dtype", "int8"], "'int8' is not one of 'auto', 'float32', 'float16'"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
    (["--port", "http"], "Invalid value for '--port'"),
    (["--bogus"], "No such option '--bogus'"),
    (["--device", "tpu"], "device must be auto, cpu or cuda"),
    (["--speculative", "eagle"], "'eagle' is not one of 'ngram', 'off'"),
    (["--num-speculative-tokens", "0"], "--num-speculative-tokens must be in [1, 64]"),
    (["--prompt-lookup-min", "4"], "--prompt-lookup-min (4) must be >= 1 and <= "
                                   "--prompt-lookup-max (3)"),
    (["--model", "/no/such/model/dir"], "model not found: /no/such/model/dir"),
])
def test_bad_start_options_fail_in_one_line(runner: CliRunner, args: list[str],
                                            needle: str) -> None:
    result = runner.invoke(main, ["start", *args])
    assert result.exit_code != 0
    assert needle in one_error_line(result)


def test_start_on_a_port_in_use_fails_before_loading(runner: CliRunner, tiny_model_factory) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = runner.invoke(main, ["start", "--port", str(port),
                                      "--model", str(tiny_model_factory("llama"))])
    assert result.exit_code == 1
    line = one_error_line(result)
    assert f"port {port} on 127.0.0.1 is in use" in line and "agentd status" in line


def test_status_and_stop_without_a_daemon(runner: CliRunner) -> None:
    status = runner.invoke(main, ["status"])
    assert status.exit_code == 3 and "not running" in status.output
    as_json = runner.invoke(main, ["status", "--json"])
    assert as_json.exit_code == 3 and json.loads(as_json.output)["running"] is False
    stop = runner.invoke(main, ["stop"])
    assert stop.exit_code == 1
    assert "no agentd daemon at" in one_error_line(stop)


def test_an_older_looser_state_dir_is_made_private(tmp_path) -> None:
    from agentd.cli._state import StatePaths

    paths = StatePaths(tmp_path / "state")
    paths.root.mkdir(mode=0o755)
    paths.root.chmod(0o755)
    paths.log_file.write_text("an old log\n")
    paths.log_file.chmod(0o644)
    with paths.open_log() as log:
        log.write(b"more\n")
    paths.write_pid(123)
    paths.write_daemon_info({"pid": 123})
    assert paths.log_file.read_text() == "an old log\nmore\n"
    assert paths.root.stat().st_mode & 0o777 == 0o700
    for path in (paths.log_file, paths.pid_file, paths.daemon_file):
        assert path.stat().st_mode & 0o777 == 0o600, path


@pytest.fixture
def detached(runner: CliRunner, monkeypatch, tmp_path, tiny_model_factory,
             free_port) -> Iterator[dict]:
    """``agentd start --detach`` with a tiny model; stopped (by SIGKILL if need be) afterwards."""
    port = free_port()
    state = tmp_path / "state"
    monkeypatch.setenv("AGENTD_URL", f"http://127.0.0.1:{port}")
    args = ["start", "--detach", "--port", str(port), "--model",
            str(tiny_model_factory("llama")), "--kv-cache-memory", "8MiB", "--weights", "int4"]
    result = runner.invoke(main, args)
    info = {"port": port, "state": state, "args": args, "result": result}
    pid_file = state / "agentd.pid"
    pid = int(pid_file.read_text()) if pid_file.exists() else None
    yield info
    if pid is not None:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


@pytest.mark.slow
def test_detach_status_stop_round_trip(runner: CliRunner, detached: dict) -> None:
    started, state, port = detached["result"], detached["state"], detached["port"]
    assert started.exit_code == 0, started.output
    assert f"agentd is ready at http://127.0.0.1:{port}" in started.output
    pid = int((state / "agentd.pid").read_text())
    daemon_info = json.loads((state / "daemon.json").read_text())
    assert daemon_info["pid"] == pid
    assert daemon_info["model"] == str(Path(detached["args"][5]).absolute())
    assert daemon_info["log"] == str((state / "agentd.log").absolute())
    log = (state / "agentd.log").read_text()
    assert "agentd listening on" in log and '"GET /health HTTP/1.1" 503' not in log, log
    assert state.stat().st_mode & 0o777 == 0o700  # they hold prompts: the owner's only
    for name in ("agentd.log", "agentd.pid", "daemon.json"):
        assert (state / name).stat().st_mode & 0o777 == 0o600, name

    status = runner.invoke(main, ["status"])
    assert status.exit_code == 0, status.output
    assert "running" in status.output and "tiny-llama" in status.output
    # The ISA and the kernels chosen: in the start log, in status, in /v1/stats.
    assert "weights int4" in status.output and "int4pack_mm(bf16)" in status.output
    log = (state / "agentd.log").read_text()
    assert "kernels on " in log and "qkv_proj int4pack_mm(bf16)" in log
    assert re.search(r"threads\s+\d+ \(the default: all cores; every daemon on this host",
                     status.output), status.output
    report = json.loads(runner.invoke(main, ["status", "--json"]).output)
    assert report["pid"] == pid and report["stats"]["num_blocks_used"] == 0
    compute = report["stats"]["compute"]
    assert compute["weights"] == "int4" and compute["isa"] and compute["isa"] in status.output

    again = runner.invoke(main, detached["args"])
    assert again.exit_code == 1
    assert f"port {port} on 127.0.0.1 is in use" in one_error_line(again)

    stop = runner.invoke(main, ["stop"])
    assert stop.exit_code == 0, stop.output
    assert f"agentd stopped (pid {pid})" in stop.output
    assert not (state / "agentd.pid").exists() and not (state / "daemon.json").exists()
    assert runner.invoke(main, ["status"]).exit_code == 3


def test_start_help_lists_the_kv_cache_dtype_and_the_auto_pool(runner: CliRunner) -> None:
    help_text = " ".join(runner.invoke(main, ["start", "--help"]).output.split())
    assert "--kv-cache-dtype [auto|float32|float16|bfloat16|q8_0]" in help_text, help_text
    assert "attention math stays fp32" in help_text and "AGENTD_KV_CACHE_DTYPE" in help_text
    assert "[default: room for --max-model-len tokens for each of --max-num-seqs requests, " \
        "within half the memory free at start" in help_text, help_text


def test_status_shows_load_time_memory_context_and_kv_pool() -> None:
    from agentd.cli.status import startup_rows

    kv = {"dtype": "float16", "num_tokens": 75360, "num_bytes": 75360 * 131072,
          "bytes_per_token": 131072, "model_len": 131072, "max_model_len": 75360,
          "budget_bytes": 9878424780, "cap_reason": "the model's context of 131,072 tokens ..."}
    rows = dict(startup_rows({"load_s": 2.345, "kv_cache": kv,
                              "memory": {"rss_bytes": 900 * 2**20, "peak_rss_bytes": 2**31}}))
    assert rows == {
        "loaded in": "2.3 s",
        "memory": "RSS 900 MiB, peak 2.0 GiB",
        "context": "75,360 tokens, capped below the model's 131,072: the model's context of "
                   "131,072 tokens ...",
        "kv cache": "float16 · 75,360 tokens · 9.2 GiB (131,072 bytes a token; budget 9.2 GiB; "
                    "resident as it fills)"}
    assert startup_rows({"model": "an older daemon"}) == []


def test_a_replica_that_fails_to_start_is_not_added(runner: CliRunner, tmp_path: Path) -> None:
    """``cluster add`` whose replica cannot start: one error line, and cluster.json lists the
    replicas it listed before (``status`` would show a replica that never ran as down)."""
    root = tmp_path / "cluster"
    root.mkdir()
    state = {"router": {"pid": os.getpid(), "url": "http://127.0.0.1:9"}, "threads": 1,
             "replicas": [{"url": "http://127.0.0.1:23001", "state_dir": str(root / "replica-0")}],
             "start_args": ["--no-such-option"]}
    (root / "cluster.json").write_text(json.dumps(state))
    result = runner.invoke(main, ["cluster", "add", "--cluster-dir", str(root)])
    assert result.exit_code != 0
    assert "replicas failed to start" in one_error_line(result)
    assert json.loads((root / "cluster.json").read_text()) == state


def test_start_help_says_each_daemon_takes_every_core(runner: CliRunner) -> None:
    help_text = " ".join(runner.invoke(main, ["start", "--help"]).output.split())
    assert "[default: all cores]. Every daemon takes this many: with several daemons on one " \
        "host, give each its share" in help_text, help_text


@pytest.mark.parametrize(("args", "needle"), [
    (["status"], "no cluster in"),
    (["stop"], "no cluster in"),
    (["add"], "no cluster in"),
    (["start", "--", "--port", "9000"], "--port is set per replica"),
    (["start", "--", "--state-dir", "/tmp/x"], "--state-dir is set per replica"),
    (["start", "--replicas", "0"], "Invalid value for '--replicas'"),
])
def test_cluster_mistakes_fail_in_one_line(runner: CliRunner, tmp_path: Path, args: list[str],
                                           needle: str) -> None:
    """Each fails before anything starts (no replica, no router)."""
    subcommand, *rest = args
    result = runner.invoke(main, ["cluster", subcommand, "--cluster-dir",
                                  str(tmp_path / "cluster"), *rest])
    assert result.exit_code != 0
    assert needle in one_error_line(result)
    assert not (tmp_path / "cluster" / "cluster.json").exists()
