"""``agentd launch``: each coding agent configured for the daemon the way its docs say to use a
custom endpoint (environment and command line only), and one line when it cannot run."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from agentd.cli import main


@pytest.fixture(scope="module")
def daemon(tiny_server):
    """A tiny model served on loopback: (its URL, its engine)."""
    return tiny_server


def launch(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["launch", *args], env=env)
    return result.exit_code, result.output


def test_each_client_is_pointed_at_the_daemon_and_its_model(daemon) -> None:
    url, engine = daemon
    code, out = launch("claude", "--url", url, "--print-env", "--", "-p", "hi")
    assert code == 0, out
    env = dict(line.split("=", 1) for line in out.splitlines()[:-1])
    assert env["ANTHROPIC_BASE_URL"] == url and env["ANTHROPIC_MODEL"] == engine.model_name
    assert env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"  # its per-request hash busts the cache
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "4096"  # the daemon's cap, from /v1/models
    assert out.splitlines()[-1].endswith("claude -p hi")
    code, out = launch("codex", "--url", url, "--print-env", "--", "exec", "hi")
    assert code == 0, out
    assert f'base_url="{url}/v1"' in out and 'wire_api="responses"' in out
    assert f'model="{engine.model_name}"' in out and out.splitlines()[-1].endswith("exec hi")
    code, out = launch("opencode", "--url", url, "--print-env")
    assert code == 0, out
    config = json.loads(out.split("OPENCODE_CONFIG_CONTENT=", 1)[1].splitlines()[0])
    model = config["provider"]["agentd"]["models"][engine.model_name]
    assert config["model"] == f"agentd/{engine.model_name}"
    assert model["limit"]["context"] == engine.max_model_len
    assert model["limit"]["output"] == min(4096, engine.max_model_len // 4)


def test_a_missing_client_or_daemon_is_one_line_saying_what_to_do(daemon, tmp_path) -> None:
    url, _ = daemon
    code, out = launch("codex", "--url", url, env={"PATH": str(tmp_path)})
    assert code == 1 and "npm install -g @openai/codex" in out
    fake = tmp_path / "codex"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    code, out = launch("codex", "--url", "http://127.0.0.1:9",
                       env={"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"})
    assert code == 1 and "no agentd daemon at http://127.0.0.1:9" in out


def test_the_client_replaces_the_launcher_with_its_own_exit_status(daemon, tmp_path) -> None:
    """The client runs as this process (exec): what it sees and how it ends are its own."""
    import subprocess
    import sys

    url, engine = daemon
    fake = tmp_path / "opencode"
    fake.write_text('#!/bin/sh\necho "$OPENCODE_CONFIG_CONTENT" > "$0.env"; echo "$@" > '
                    '"$0.args"; exit 7\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run([sys.executable, "-m", "agentd.cli", "launch", "opencode", "--url",
                           url, "--", "run", "--continue", "x"], env=env, timeout=120)
    assert done.returncode == 7
    assert Path(f"{fake}.args").read_text().split() == ["run", "--continue", "x"]
    assert json.loads(Path(f"{fake}.env").read_text())["model"] == f"agentd/{engine.model_name}"
