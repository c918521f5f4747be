"""The KV disk tier end to end: a real ``agentd start`` on loopback (a tiny random llama with the
default model's tokenizer and template, a pool of 64 blocks) with its defaults, the disk tier in
the state dir. An agent's prompt, evicted from the pool by other prompts, comes back with its
whole prefix cached (read from disk, the same reply); after ``kill -9`` and a restart its first
request hits too (a named session's blocks are then kept); ``agentd stats`` and ``/metrics`` say
where the tokens came from, and ``agentd cache clear`` empties the tier."""

from __future__ import annotations

import json
import random
import time
from importlib import resources

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
POOL = "512KiB"  # the tiny llama's fp32 KV, 8 KiB a block of 16 tokens: 64 blocks


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tiny_model_factory, daemon_process):
    with daemon_process(tmp_path_factory.mktemp("agentd-disk"), "--model",
                        str(tiny_model_factory("llama")), "--kv-cache-memory", POOL,
                        "--log-level", "info") as daemon:
        yield daemon


def ask(client: openai.OpenAI, system: str, text: str) -> tuple[str, int, int]:
    """(reply, prompt tokens, cached prompt tokens) of one greedy chat request."""
    reply = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=8,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": text}])
    return (reply.choices[0].message.content, reply.usage.prompt_tokens,
            reply.usage.prompt_tokens_details.cached_tokens)


def pressure(client: openai.OpenAI, num_blocks: int) -> None:
    """Unique prompts worth twice the pool: nothing earlier is left in it."""
    rng = random.Random(0)
    for _ in range(2 * num_blocks // 20 + 1):
        ids = [rng.randrange(1000, 40000) for _ in range(20 * 16)]
        client.completions.create(model=MODEL, prompt=ids, max_tokens=1)


def disk_written(daemon) -> int:
    return httpx.get(f"{daemon.url}/v1/stats").json()["kv_disk"]["num_blocks_written"]


def test_an_evicted_prompt_and_a_restart_read_the_prefix_from_disk(daemon) -> None:
    client = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="unused", max_retries=0)
    system = json.loads(resources.files("agentd.workloads").joinpath("support_agent.json")
                        .read_text())["system"][:2400]
    reply, num_prompt, cached = ask(client, system, "Where is my order?")
    assert cached == 0 and num_prompt > 400
    stats = httpx.get(f"{daemon.url}/v1/stats").json()
    assert stats["kv_disk"]["directory"].startswith(str(daemon.state_dir / "kv-store"))
    pressure(client, stats["num_blocks_total"])
    assert ask(client, system, "Can I return a lamp?")[2] >= num_prompt - 40  # the system turn
    assert ask(client, system, "Where is my order?") == (reply, num_prompt, num_prompt // 16 * 16)
    stats = httpx.get(f"{daemon.url}/v1/stats").json()
    assert stats["prefix_cache_disk_hits"] >= num_prompt // 16 * 16
    assert stats["kv_disk"]["num_blocks_read"] >= num_prompt // 16
    shown = daemon.cli("stats")
    assert shown.returncode == 0, shown.stderr
    assert "from disk" in shown.stdout and "disk tier" in shown.stdout

    written = disk_written(daemon)
    daemon.kill()  # nothing saved on the way out: the segments are all there is
    daemon.start()
    assert httpx.get(f"{daemon.url}/v1/stats").json()["kv_disk"]["num_blocks"] >= \
        num_prompt // 16
    # a session a client names (opencode's header): its blocks are kept over anonymous ones
    session = client.with_options(default_headers={"x-session-id": "ses_1"})
    assert ask(session, system, "Where is my order?") == (reply, num_prompt, num_prompt // 16 * 16)
    deadline = time.monotonic() + 30
    while httpx.get(f"{daemon.url}/v1/stats").json()["kv_disk"]["kept_bytes"] == 0:
        assert time.monotonic() < deadline, "the session's blocks were not kept"
        time.sleep(0.1)
    metrics = httpx.get(f"{daemon.url}/metrics").text
    assert "agentd:kv_disk_kept_bytes" in metrics
    assert "agentd:kv_disk_writes_retried_total" in metrics
    hits = next(line for line in metrics.splitlines()
                if line.startswith("agentd:kv_disk_hit_tokens_total"))
    assert float(hits.rsplit(" ", 1)[1]) >= num_prompt // 16 * 16
    assert written > 0

    shown = daemon.cli("cache")
    assert shown.returncode == 0 and "disk tier:" in shown.stdout, shown.stderr
    cleared = daemon.cli("cache", "clear")
    assert cleared.returncode == 0, cleared.stderr
    assert int(cleared.stdout.split()[1]) >= num_prompt // 16, cleared.stdout
    assert httpx.get(f"{daemon.url}/v1/stats").json()["kv_disk"]["num_blocks"] == 0
