"""Pins end to end: a real ``agentd start`` on loopback (a tiny random llama with the default
model's tokenizer and chat template: the pool's and the pins' work is the same as the default
model's, at a fraction of CI's time), a small pool.

``agentd pin`` (the CLI, as a user runs it) pins the research agent's system prompt and tools;
chat requests through the ``openai`` SDK with any user message then report the whole pin as
cached. Unique prompts worth twice the pool's unpinned blocks churn every one of them: the pin
still hits in full while an unpinned prefix used at the same time is evicted. Then ``kill -9``
and a restart on the same state dir: the pin is back (its KV read from the block store) before
``/health`` says ready, and the first request hits.
"""

from __future__ import annotations

import json
import random
import re
from importlib import resources
from typing import Any

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
# the tiny llama's fp32 KV: 8 KiB a block of 16 tokens, so 184 blocks; the research pin takes
# 143 of them (budget 0.85 = 156)
DAEMON_ARGS = ("--kv-cache-memory", "1472KiB", "--max-pinned-fraction", "0.85",
               "--log-level", "info",
               "--no-kv-disk")  # what the pool evicts stays evicted (no disk tier under it)
UNIQUE_PROMPT_BLOCKS = 20


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tiny_model_factory, daemon_process):
    with daemon_process(tmp_path_factory.mktemp("agentd-pins"), "--model",
                        str(tiny_model_factory("llama")), *DAEMON_ARGS) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def research(daemon) -> dict[str, Any]:
    workload = json.loads(resources.files("agentd.workloads").joinpath("research_agent.json")
                          .read_text())
    (daemon.state_dir / "research.txt").write_text(workload["system"])
    (daemon.state_dir / "tools.json").write_text(json.dumps(workload["tools"]))
    return workload


def chat(client: openai.OpenAI, system: str, text: str, tools: Any = None) -> int:
    """Send one chat request; return its cached prompt tokens."""
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": system},
                               {"role": "user", "content": text}],
        max_tokens=1, temperature=0, **({"tools": tools} if tools else {}))
    return reply.usage.prompt_tokens_details.cached_tokens


def test_pin_survives_pressure_and_kill_9(daemon, research: dict[str, Any]) -> None:
    client = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="unused", max_retries=0)
    pinned = daemon.cli("pin", str(daemon.state_dir / "research.txt"), "--tools",
                        str(daemon.state_dir / "tools.json"))
    assert pinned.returncode == 0, pinned.stderr
    found = re.match(r"pinned research: (\d+) tokens in (\d+) blocks", pinned.stdout)
    assert found, pinned.stdout
    num_tokens, num_blocks = int(found[1]), int(found[2])
    assert num_tokens == 16 * num_blocks > 2000

    # any user message hits the whole pin; an unpinned prefix is cached at the same time
    unpinned = json.loads(resources.files("agentd.workloads").joinpath("support_agent.json")
                          .read_text())["system"][:700]
    assert chat(client, unpinned, "Where is my order?") == 0
    for text in ("Find three sources on heat pumps.", "What is 12% of 4,150?", "Hi"):
        assert chat(client, research["system"], text, research["tools"]) >= num_tokens
    assert chat(client, unpinned, "Can I return a lamp?") >= 128

    # pressure: unique prompts worth twice the blocks a pin does not hold (the only ones that
    # can be evicted; more only repeats the churn)
    stats = httpx.get(f"{daemon.url}/v1/stats").json()
    assert stats["num_blocks_pinned"] == num_blocks
    rng = random.Random(0)
    evictable = stats["num_blocks_total"] - num_blocks
    num_prompts = 2 * evictable // UNIQUE_PROMPT_BLOCKS + 1
    for _ in range(num_prompts):
        ids = [rng.randrange(1000, 40000) for _ in range(UNIQUE_PROMPT_BLOCKS * 16)]
        reply = client.completions.create(model=MODEL, prompt=ids, max_tokens=1)
        assert reply.usage.prompt_tokens_details is None or \
            reply.usage.prompt_tokens_details.cached_tokens == 0
    assert chat(client, research["system"], "Any news on fusion?", research["tools"]) >= \
        num_tokens
    assert chat(client, unpinned, "Can I return a lamp?") == 0  # evicted
    (row,) = httpx.get(f"{daemon.url}/v1/stats").json()["pins"]
    assert row["hits"] == 4 and row["tokens_served"] >= 4 * num_tokens

    # kill -9, restart on the same state dir: the pin is back before /health says ready
    daemon.kill()
    registry = json.loads((daemon.state_dir / "pins.json").read_text())
    assert [p["name"] for p in registry["pins"]] == ["research"]
    daemon.start()  # returns once /health is 200
    (listed,) = httpx.get(f"{daemon.url}/v1/pins").json()["data"]
    assert listed["name"] == "research" and listed["num_tokens"] == num_tokens
    (report,) = httpx.get(f"{daemon.url}/v1/stats").json()["pin_restore"]
    assert report["source"] == "store" and report["num_tokens"] == num_tokens
    assert report["prefill_s"] > 0 and report["elapsed_s"] > 0
    assert chat(client, research["system"], "First question after the restart.",
                research["tools"]) >= num_tokens
    assert "restored by store" in daemon.log()
    json.loads((daemon.state_dir / "pins.json").read_text())
