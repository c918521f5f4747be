"""End to end, on a real daemon through the real ``openai`` SDK (a tiny random llama with the
default model's tokenizer and template: what is kept and what is evicted is the pool's work, the
same for any model, and the default model's prefills made this ~60 s of CI's time): a prefix
retained with ``prompt_cache_retention: "24h"`` survives cache pressure that evicts an unmarked
prefix of the same size, measured in cached tokens after the pressure; ``agentd stats`` shows
it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib import resources

import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
# the tiny llama's fp32 KV, 8 KiB a block of 16 tokens: 136 blocks; 68 of them for pins and
# retention
POOL = "1088KiB"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tiny_model_factory, daemon_process) -> Iterator[object]:
    with daemon_process(tmp_path_factory.mktemp("agentd-state"), "--log-level", "warning",
                        "--model", str(tiny_model_factory("llama")),
                        "--kv-cache-memory", POOL,
                        "--no-kv-disk") as d:  # the pool's retention: no disk tier under it
        yield d


@pytest.fixture(scope="module")
def client(daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="unused", max_retries=0)


def conversation(agent: str, *turns: str) -> list[dict[str, str]]:
    system = json.loads(resources.files("agentd.workloads").joinpath(
        "research_agent.json").read_text())["system"]
    messages = [{"role": "system", "content": f"You are agent {agent}. {system}"}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return messages


def ask(client: openai.OpenAI, messages, **fields):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                          temperature=0, **fields).usage


def test_a_retained_prefix_survives_pressure_that_evicts_an_unmarked_one(client, daemon) -> None:
    held = ask(client, conversation("Alpha", "Which sources cover the 1918 flu?"),
               prompt_cache_retention="24h")
    num_held = held.prompt_tokens // 16 * 16
    assert held.prompt_tokens_details.cache_write_tokens == num_held - (
        held.prompt_tokens_details.cached_tokens)
    unmarked = ask(client, conversation("Bravo", "Which sources cover the 1918 flu?"))
    assert abs(unmarked.prompt_tokens - held.prompt_tokens) <= 2  # the same size
    # pressure: two long prompts of their own, more than the pool's unheld blocks
    filler = " ".join(f"item{i}" for i in range(320))  # ~1,200 tokens
    for i in range(2):
        ask(client, [{"role": "user", "content": f"{i} {filler}"}])
    alpha = ask(client, conversation("Alpha", "Which sources cover the 1918 flu?", "Three.",
                                     "Name them."))
    bravo = ask(client, conversation("Bravo", "Which sources cover the 1918 flu?", "Three.",
                                     "Name them."))
    print(f"\nafter pressure: retained prefix {alpha.prompt_tokens_details.cached_tokens} of "
          f"{alpha.prompt_tokens} prompt tokens cached; unmarked "
          f"{bravo.prompt_tokens_details.cached_tokens} of {bravo.prompt_tokens}")
    assert alpha.prompt_tokens_details.cached_tokens >= num_held
    assert bravo.prompt_tokens_details.cached_tokens < 32
    shown = daemon.cli("stats")
    assert shown.returncode == 0, shown.stderr
    assert "retained prefixes (1)" in shown.stdout and " 1d " in shown.stdout
