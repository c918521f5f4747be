"""Retention at the engine level (agentd/engine/retention.py): a held prefix survives pool pressure
that evicts an unmarked one, expires after its TTL, is refreshed by hits, shares the pin budget and
never displaces a pin."""

from __future__ import annotations

import asyncio
import json
import time
from importlib import resources

import pytest

from agentd.chat import render_chat
from agentd.config import EngineConfig
from agentd.engine.async_engine import AsyncEngine
from agentd.engine.request import EngineRequest, RetentionRequest
from agentd.engine.sampling_params import SamplingParams
from agentd.pins.service import PinService, PinSpec

HOUR_S = 3600.0
BLOCK_BYTES_TINY_LLAMA = 2 * 2 * 16 * 2 * 16 * 4  # layers * K/V * block * kv heads * dim * fp32


def workload(name: str) -> dict:
    return json.loads(resources.files("agentd.workloads").joinpath(f"{name}.json").read_text())


def make_engine(path, num_blocks: int, **kwargs) -> AsyncEngine:
    config = EngineConfig(model=str(path),
                          kv_cache_memory_bytes=num_blocks * BLOCK_BYTES_TINY_LLAMA, **kwargs)
    engine = AsyncEngine.from_config(config)
    engine.start()
    return engine


@pytest.fixture(scope="module")
def research() -> dict:
    return workload("research_agent")


@pytest.fixture(scope="module")
def coding() -> dict:
    """Without its tools: 2,119 prompt tokens, near research's 2,295 with tools."""
    return {**workload("coding_agent"), "tools": None}


@pytest.fixture
def tiny_llama(tiny_model_factory):
    return tiny_model_factory("llama")


def prompt(engine, agent: dict, turn: str) -> list[int]:
    messages = [{"role": "system", "content": agent["system"]}, {"role": "user", "content": turn}]
    return render_chat(engine.tokenizer, messages, agent["tools"], None).prompt_token_ids


async def run(engine, ids: list[int], hold: RetentionRequest | None = None,
              max_tokens: int = 2):
    last = None
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    async for delta in engine.add_request(EngineRequest(ids, params, retention=hold)):
        last = delta
    return last


async def press(engine, num_prompts: int = 12) -> None:
    """Unique long prompts, several times the pool's free size: evicts every unheld block."""
    filler = list(range(1000, 1900))
    for i in range(num_prompts):
        await run(engine, [5000 + i] + filler, max_tokens=1)


def whole_blocks(num_tokens: int) -> int:
    return num_tokens // 16 * 16


def test_a_retained_prefix_survives_pressure_that_evicts_an_unmarked_one(tiny_llama, research,
                                                                          coding):
    async def go():
        engine = make_engine(tiny_llama, num_blocks=480)
        try:
            held_ids = prompt(engine, research, "first question")
            first = await run(engine, held_ids, RetentionRequest(len(held_ids), HOUR_S))
            assert first.num_retained_tokens == whole_blocks(len(held_ids))
            unmarked_ids = prompt(engine, coding, "first question")
            await run(engine, unmarked_ids)
            assert (await run(engine, unmarked_ids)).num_cached_tokens > 1000  # cached, for now
            stats = engine.stats()
            assert stats.pins.num_retained == 1
            assert stats.pins.num_blocks_retained == len(held_ids) // 16
            await press(engine)
            held = await run(engine, prompt(engine, research, "another question"))
            unmarked = await run(engine, prompt(engine, coding, "another question"))
            # the held prefix's whole blocks end before the user's text: all served; the
            # unmarked one is gone but for what the chat template shares
            assert held.num_cached_tokens == whole_blocks(len(held_ids))
            assert unmarked.num_cached_tokens < 100
            [stat] = engine.pin_summary().retained
            assert (stat.num_hits, stat.num_tokens_served) == (1, whole_blocks(len(held_ids)))
            assert (await engine.check_integrity()).ok
        finally:
            engine.shutdown()

    asyncio.run(go())


def test_a_hit_refreshes_the_hold_and_its_ttl_lets_it_decay(tiny_llama, research):
    async def go():
        engine = make_engine(tiny_llama, num_blocks=480)
        try:
            system_ids = prompt(engine, research, "question")
            num_held = len(system_ids) - 40  # system + tools, not the user turn
            first = await run(engine, system_ids, RetentionRequest(num_held, 1.5))
            assert first.num_retained_tokens == whole_blocks(num_held)
            [before] = engine.pin_summary().retained
            await asyncio.sleep(0.2)
            hit = await run(engine, prompt(engine, research, "other question"))
            assert hit.num_cached_tokens >= whole_blocks(num_held)
            [after] = engine.pin_summary().retained
            assert after.num_hits == 1
            assert after.num_tokens_served == whole_blocks(num_held)
            assert after.expires_s > before.expires_s  # refreshed to now + TTL
            deadline = time.monotonic() + 30
            while engine.stats().pins.num_retained and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert engine.stats().pins.num_retained == 0  # expired: decayed to ordinary LRU
            # still cached (LRU) until pressure evicts it
            assert (await run(engine, system_ids)).num_cached_tokens >= whole_blocks(num_held)
            await press(engine)
            assert (await run(engine, system_ids)).num_cached_tokens < 100
            assert (await engine.check_integrity()).ok
        finally:
            engine.shutdown()

    asyncio.run(go())


def test_retention_shares_the_pin_budget_and_never_displaces_a_pin(tiny_llama, research,
                                                                   coding, tmp_path):
    async def go():
        # 480 blocks, 168 of them for pins and retention together: the research pin (144
        # blocks) or the retained coding prefix (132), not both
        engine = make_engine(tiny_llama, num_blocks=480, max_pinned_fraction=0.35)
        try:
            coding_ids = prompt(engine, coding, "question")
            first = await run(engine, coding_ids, RetentionRequest(len(coding_ids), HOUR_S))
            assert first.num_retained_tokens > 0
            service = PinService(engine, tmp_path)
            info = await service.add(PinSpec("research", research["system"], research["tools"]))
            # the pin took its blocks; the retained prefix made room for it
            stats = engine.stats()
            assert stats.pins.num_pins == 1 and stats.pins.num_blocks_pinned == info["num_blocks"]
            assert stats.pins.num_retained == 0
            # now the pin leaves no room: a retention is refused, served as plain LRU, and the
            # pin stays whole
            refused = await run(engine, coding_ids, RetentionRequest(len(coding_ids), HOUR_S))
            assert refused.num_retained_tokens == 0
            pins = engine.stats().pins
            assert pins.num_retained == 0 and pins.num_blocks_pinned == info["num_blocks"]
            await press(engine)
            hit = await run(engine, prompt(engine, research, "question"))
            assert hit.num_cached_tokens >= info["num_tokens"]
            assert (await engine.check_integrity()).ok
        finally:
            engine.shutdown()

    asyncio.run(go())


def test_the_server_may_retain_a_cached_prefix_directly(tiny_llama, research):
    """``LLMEngine.retain`` (on the engine thread): holds what is cached of a prompt, says
    whether the hold is new, and holds nothing for a prompt that is not cached."""
    async def go():
        engine = make_engine(tiny_llama, num_blocks=480)
        try:
            ids = prompt(engine, research, "question")
            hold = RetentionRequest(len(ids), HOUR_S)
            owner = "tenant-x"
            # nothing cached
            assert await engine.call(lambda e: e.retain(ids, hold, owner=owner)) is None
            await run(engine, ids)
            first = await engine.call(lambda e: e.retain(ids, hold, owner=owner))
            assert (first.num_tokens, first.new) == (whole_blocks(len(ids)), True)
            assert first.expires_in_s == pytest.approx(HOUR_S, abs=5)
            again = await engine.call(lambda e: e.retain(ids, hold, cache_salt="other",
                                                         owner=owner))
            assert again is None  # another salt: other blocks, none cached
            assert (await engine.call(lambda e: e.retain(ids, hold, owner=owner))).new is False
            [stat] = await engine.call(lambda e: e.pins.summary().retained)
            assert stat.owner == "tenant-x" and stat.num_blocks == len(ids) // 16
            await press(engine)
            assert (await run(engine, ids)).num_cached_tokens == whole_blocks(len(ids))
            assert (await engine.check_integrity()).ok
        finally:
            engine.shutdown()

    asyncio.run(go())
