"""The agent examples run end to end against a real daemon (default model, loopback): the pinned
agent loop and the parallel agents both report cached tokens from the pin.

To stay quick they run on a cut-down research workload (a shorter system prompt, three tools),
with two turns / two agents and a few output tokens each.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from agentd.bench.spawn import child_environ

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "agents"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, default_daemon) -> tuple[str, Path]:
    """(base URL of the shared ``python -m agentd.cli start`` with the default model, a work
    dir)."""
    return default_daemon.url, tmp_path_factory.mktemp("agentd-examples")


@pytest.fixture(scope="module")
def small_workload(daemon: tuple[str, Path]) -> Path:
    workload = json.loads(resources.files("agentd.workloads").joinpath("research_agent.json")
                          .read_text())
    small = {**workload, "name": "research_small", "system": workload["system"][:1500],
             "tools": workload["tools"][:3]}
    path = daemon[1] / "research_small.json"
    path.write_text(json.dumps(small))
    return path


def run_example(script: str, url: str, *args: str) -> str:
    env = child_environ()
    done = subprocess.run([sys.executable, str(EXAMPLES / script), "--base-url", f"{url}/v1",
                           *args], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_pinned_agent(daemon: tuple[str, Path], small_workload: Path) -> None:
    out = run_example("pinned_agent.py", daemon[0], "--workload", str(small_workload),
                      "--turns", "2", "--max-tokens", "2")
    assert re.search(r"pinned 'research_small': \d+ tokens in \d+ blocks", out), out
    cached = [int(n) for n in re.findall(r"cached tokens (\d+) of \d+ prompt tokens, TTFT", out)]
    assert len(cached) >= 2 and all(n > 0 for n in cached), out


def test_parallel_agents(daemon: tuple[str, Path], small_workload: Path) -> None:
    out = run_example("parallel_agents.py", daemon[0], "--workload", str(small_workload),
                      "--agents", "2", "--max-tokens", "2", "--pin-name", "parallel")
    with_pin, without = out.split("without it", 1)
    pinned = [int(n) for n in re.findall(r"cached tokens (\d+) of", with_pin)]
    assert len(pinned) == 2 and all(n > 0 for n in pinned), out
    cold = [int(n) for n in re.findall(r"agent \d: cached tokens (\d+) of", without)]
    assert cold == [0, 0], out
    assert "aggregate TTFT" in out and re.search(r"with pin +TTFT mean", out), out
