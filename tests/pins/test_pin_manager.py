"""Pins at the engine level: hits for any user message, survival under pool pressure, budget,
TTL decay, near-miss diagnosis, and restart restore from the pins' KV in the block store (or
recompute)."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from importlib import resources
from typing import NamedTuple

import pytest
import torch

from agentd.cache import PinBudgetError, PinExistsError
from agentd.chat import render_chat
from agentd.config import EngineConfig
from agentd.engine.async_engine import AsyncEngine
from agentd.engine.request import EngineRequest
from agentd.engine.sampling_params import SamplingParams
from agentd.llm import LLM
from agentd.pins.near_miss import CLAUDE_CODE_FIX, CLAUDE_CODE_HEADER
from agentd.pins.pin_request import PinRequest
from agentd.pins.service import PinService, PinSpec, PinStorageError, pin_token_ids

BLOCK_BYTES_TINY_LLAMA = 2 * 2 * 16 * 2 * 16 * 4  # layers * K/V * block * kv heads * dim * fp32


def workload(name: str) -> dict:
    return json.loads(resources.files("agentd.workloads").joinpath(f"{name}.json").read_text())


@pytest.fixture(scope="module")
def research() -> dict:
    return workload("research_agent")


def make_engine(path, num_blocks: int = 1024, **kwargs) -> AsyncEngine:
    config = EngineConfig(model=str(path),
                          kv_cache_memory_bytes=num_blocks * BLOCK_BYTES_TINY_LLAMA, **kwargs)
    engine = AsyncEngine.from_config(config)
    engine.start()
    return engine


async def chat(engine: AsyncEngine, system: str, user: str, tools=None, max_tokens: int = 4):
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    ids = render_chat(engine.tokenizer, messages, tools, None).prompt_token_ids
    last = None
    tokens: list[int] = []
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    async for delta in engine.add_request(EngineRequest(ids, params)):
        tokens += delta.token_ids
        last = delta
    return last, tokens


@pytest.fixture
def tiny_llama(tiny_model_factory):
    return tiny_model_factory("llama")


def test_pin_hits_for_any_user_message(tiny_llama, research, tmp_path):
    async def run():
        engine = make_engine(tiny_llama)
        try:
            service = PinService(engine, tmp_path)
            info = await service.add(PinSpec("research", research["system"], research["tools"]))
            # whole blocks, then a partial tail block when the shared prefix ends inside one
            assert info["num_blocks"] == -(-info["num_tokens"] // 16)
            assert info["tail_tokens"] == info["num_tokens"] % 16
            assert info["num_tokens"] > 1500
            for turn in research["turns"][:4]:
                last, _ = await chat(engine, research["system"], turn, research["tools"])
                assert last.num_cached_tokens >= info["num_tokens"]
            [listed] = await service.list()
            assert listed["hits"] == 4
            assert listed["tokens_served"] == 4 * info["num_tokens"]
            # tools given with their keys in another order render the same tokens: still a hit
            shuffled = [{k: dict(reversed(list(v.items()))) if isinstance(v, dict) else v
                         for k, v in reversed(list(t.items()))} for t in research["tools"]]
            assert json.dumps(shuffled) != json.dumps(research["tools"])
            last, _ = await chat(engine, research["system"], "Hi", shuffled)
            assert last.num_cached_tokens >= info["num_tokens"]
            stats = engine.stats()
            assert stats.pins.num_pins == 1 and stats.pins.num_blocks_pinned == info["num_blocks"]
            with pytest.raises(PinExistsError):
                await service.add(PinSpec("research", "other", None))
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_pin_survives_pool_pressure_while_unpinned_prefix_is_evicted(tiny_llama, research,
                                                                     tmp_path):
    support = workload("support_agent")

    async def run():
        engine = make_engine(tiny_llama, num_blocks=480)
        try:
            service = PinService(engine, tmp_path)
            info = await service.add(PinSpec("research", research["system"], research["tools"]))
            # an equally old, unpinned prefix of similar size
            await chat(engine, support["system"], support["turns"][0])
            again, _ = await chat(engine, support["system"], support["turns"][1])
            assert again.num_cached_tokens > 1000
            # unique long prompts, several times the pool's free size
            vocab_filler = list(range(1000, 1000 + 900))
            for i in range(8):
                ids = [5000 + i] + vocab_filler
                async for _ in engine.add_request(EngineRequest(ids, SamplingParams(max_tokens=1))):
                    pass
            last, _ = await chat(engine, research["system"], "new question", research["tools"])
            assert last.num_cached_tokens >= info["num_tokens"]
            evicted, _ = await chat(engine, support["system"], support["turns"][2])
            assert evicted.num_cached_tokens < 100  # only what the chat template shares
            stats = engine.stats()
            assert stats.pins.num_blocks_pinned == info["num_blocks"]
            await engine.call(lambda e: e.kv_cache.pool.check_integrity())
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_pin_over_budget_is_refused_and_changes_nothing(tiny_llama, research, tmp_path):
    async def run():
        engine = make_engine(tiny_llama, num_blocks=1024, max_pinned_fraction=0.1)
        try:
            service = PinService(engine, tmp_path)
            before = engine.stats()
            with pytest.raises(PinBudgetError) as err:
                await service.add(PinSpec("big", research["system"], research["tools"]))
            assert err.value.status == 409
            assert "102" in str(err.value)  # the budget in blocks: 10% of 1024
            after = await engine.call(lambda e: e.stats())
            assert after.pins.num_pins == 0 and after.pins.num_blocks_pinned == 0
            assert after.pool.num_blocks_used == 0
            # no prefill ran
            assert after.totals.prompt_tokens_total == before.totals.prompt_tokens_total
            assert not (tmp_path / "pins.json").exists()
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_ttl_decays_to_ordinary_lru_blocks(tiny_llama, research, tmp_path):
    async def run():
        engine = make_engine(tiny_llama)
        try:
            service = PinService(engine, tmp_path)
            info = await service.add(PinSpec("short", research["system"], None, ttl_s=0.3))
            assert (await service.list())[0]["ttl"] == 0.3
            await asyncio.sleep(0.8)
            assert await service.list() == []
            stats = engine.stats()
            assert stats.pins.num_blocks_pinned == 0 and stats.pool.num_blocks_used == 0
            # decayed, not dropped: its full blocks stay cached (a partial tail block is never
            # cached; it is freed)
            assert stats.pool.num_blocks_cached >= info["num_blocks"] - (info["tail_tokens"] > 0)
            saved = json.loads((tmp_path / "pins.json").read_text())
            assert saved["pins"] == []
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_ttl_is_refreshed_by_hits(tiny_llama, research, tmp_path):
    async def run():
        engine = make_engine(tiny_llama)
        try:
            service = PinService(engine, tmp_path)
            await service.add(PinSpec("busy", research["system"], None, ttl_s=0.6))
            for _ in range(4):
                await asyncio.sleep(0.3)
                await chat(engine, research["system"], "ping")
            assert [p["name"] for p in await service.list()] == ["busy"]
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_near_miss_reports_timestamp_divergence(tiny_llama, research, tmp_path):
    async def run():
        engine = make_engine(tiny_llama)
        try:
            service = PinService(engine, tmp_path)
            info = await service.add(PinSpec("research", research["system"], research["tools"]))
            dated = research["system"].replace("\n", "\nCurrent date: 2026-11-29 15:04.\n", 1)
            await chat(engine, dated, "What changed?", research["tools"])
            misses = await engine.call(lambda e: list(e.pins.near_misses))
            assert len(misses) == 1
            miss = misses[0]
            assert miss.pin == "research"
            assert 0 < miss.divergence_token < info["num_tokens"]
            assert "2026" in miss.request_text or "date" in miss.request_text.lower()
            assert "date or time" in miss.cause
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_near_miss_names_a_per_request_hash_before_the_pin(tiny_llama, research, tmp_path):
    """Claude Code's billing line first in the system prompt: after the tools (rendered first,
    so they stay cached) the request leaves the pin and meets it again right after the hash."""
    def billed(cch: str) -> str:
        return f"x-anthropic-billing-header: cc_version=2.0.14; cch={cch};\n{research['system']}"

    async def run():
        engine = make_engine(tiny_llama)
        try:
            service = PinService(engine, tmp_path)
            info = await service.add(PinSpec("claude", billed("5ab31"), research["tools"]))
            last, _ = await chat(engine, billed("e9c04"), "What changed?", research["tools"])
            assert last.num_cached_tokens < info["num_tokens"] - 500  # the hash cost the rest
            [miss] = await engine.call(lambda e: list(e.pins.near_misses))
            assert miss.pin == "claude"
            assert last.num_cached_tokens <= miss.divergence_token < last.num_cached_tokens + 16
            assert miss.cause == f"{CLAUDE_CODE_HEADER}; {CLAUDE_CODE_FIX}"
            assert "⟦e9c04⟧" in miss.request_text and "⟦5ab31⟧" in miss.pin_text
            assert info["num_tokens"] > 1000
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_restart_restores_from_the_store_with_identical_outputs(tiny_model_factory, research,
                                                                tmp_path):
    path = tiny_model_factory("llama")
    question = research["turns"][5]

    async def first_life():
        engine = make_engine(path)
        try:
            service = PinService(engine, tmp_path)
            await service.add(PinSpec("research", research["system"], research["tools"]))
        finally:
            engine.shutdown()

    async def second_life():
        engine = make_engine(path)
        try:
            service = PinService(engine, tmp_path)
            [entry] = await service.restore_all()
            assert entry["source"] == "store"
            last, tokens = await chat(engine, research["system"], question, research["tools"],
                                      max_tokens=8)
            assert last.num_cached_tokens >= entry["num_tokens"]
            listed = await service.list()
            assert listed[0]["restore_s"] is not None
            return tokens
        finally:
            engine.shutdown()

    async def uncached():
        engine = make_engine(path, enable_prefix_caching=False)
        try:
            return (await chat(engine, research["system"], question, research["tools"],
                               max_tokens=8))[1]
        finally:
            engine.shutdown()

    asyncio.run(first_life())
    restored = asyncio.run(second_life())
    assert restored == asyncio.run(uncached())


def test_another_models_stored_kv_is_recomputed_not_reused(tiny_model_factory, research,
                                                           tmp_path):
    async def pin_with(model_type: str):
        engine = make_engine(tiny_model_factory(model_type))
        try:
            service = PinService(engine, tmp_path)
            if not service.load_specs():
                await service.add(PinSpec("research", research["system"], None))
                return None
            return await service.restore_all()
        finally:
            engine.shutdown()

    assert asyncio.run(pin_with("llama")) is None
    [entry] = asyncio.run(pin_with("mistral"))  # same shapes and tokenizer, other weights
    assert entry["source"] == "recompute"


def test_unreadable_registry_without_a_backup_is_reported_and_kept(tiny_llama, tmp_path):
    (tmp_path / "pins.json").write_text("{not json")

    async def run():
        engine = make_engine(tiny_llama)
        try:
            [entry] = await PinService(engine, tmp_path).restore_all()
            assert entry["name"] == "pins.json" and "unreadable" in entry["error"]
        finally:
            engine.shutdown()

    asyncio.run(run())
    assert (tmp_path / "pins.json.rejected").read_text() == "{not json"


def test_registry_write_failure_refuses_the_pin_and_changes_nothing(tiny_llama, research,
                                                                    tmp_path):
    """A pin is registered only with pins.json written: otherwise PinStorageError (507), the
    failure reported, and the engine holds no pin (its blocks are ordinary cache again)."""
    blocker = tmp_path / "state"
    blocker.write_text("a file where the state dir should be")

    async def run():
        engine = make_engine(tiny_llama)
        try:
            service = PinService(engine, blocker)
            with pytest.raises(PinStorageError, match="pin 'research' was not registered") as exc:
                await service.add(PinSpec("research", research["system"], None))
            assert exc.value.status == 507 and str(blocker / "pins.json") in str(exc.value)
            assert service.last_persist_error is not None and service.specs == {}
            assert await engine.list_pins() == []
            report = await engine.check_integrity()
            assert report.ok and report.num_blocks_pinned == 0
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_pin_spec_round_trips_through_json():
    spec = PinSpec("a", "sys", [{"type": "function", "function": {"name": "f"}}], 60.0, 1.5)
    assert PinSpec(**json.loads(json.dumps(spec.to_json()))) == copy.deepcopy(spec)
    assert time.time() > 0


def test_stale_temporary_files_of_dead_writers_are_removed(tmp_path) -> None:
    import os
    import subprocess

    from agentd.pins.service import PinService

    dead = subprocess.Popen(["true"])
    dead.wait()
    kv = tmp_path / "kv" / "abc-b16"
    kv.mkdir(parents=True)
    stale = [tmp_path / f".pins.json.{dead.pid}.tmp", kv / f".base.pt.{dead.pid}.tmp"]
    live = [tmp_path / f".pins.json.{os.getpid()}.tmp", kv / f".other.pt.{os.getppid()}.tmp"]
    kept = [tmp_path / "pins.json", kv / "base.pt", tmp_path / ".notes.tmp"]
    for path in stale + live + kept:
        path.write_text("x")
    service = PinService.__new__(PinService)  # only the state dir matters here
    service.state_dir = tmp_path
    assert sorted(service.remove_stale_temp_files()) == sorted(stale)
    assert all(p.exists() for p in live + kept)
    assert not any(p.exists() for p in stale)


def system_with_tail(engine: AsyncEngine | LLM, system: str, min_tail: int = 2) -> tuple[str, int]:
    """``system`` cut at a line end such that the pin's shared prefix ends inside a block, with
    at least ``min_tail`` tokens past its last full block."""
    lines = system.split("\n")
    for end in range(len(lines), 0, -1):
        text = "\n".join(lines[:end])
        tail = len(pin_token_ids(engine.tokenizer, text, None)) % 16
        if tail >= min_tail:
            return text, tail
    raise AssertionError("no cut of the system text leaves a partial block")


def uncached_tokens(path, system: str, question: str) -> list[int]:
    """8 greedy tokens from an engine without a prefix cache: what a pin must not change."""
    async def run():
        engine = make_engine(path, enable_prefix_caching=False)
        try:
            return (await chat(engine, system, question, max_tokens=8))[1]
        finally:
            engine.shutdown()

    return asyncio.run(run())


def test_a_pins_partial_last_block_is_served_too(tiny_llama, research, tmp_path):
    """The tokens after a pin's last full block (where user turns start to differ) are served
    from the pin's own tail block: copied into the request's first block, not recomputed, with
    the same outputs as a run without any cache; unpinning frees that block."""
    question = research["turns"][2]

    async def run():
        engine = make_engine(tiny_llama)
        try:
            system, tail = system_with_tail(engine, research["system"])
            service = PinService(engine, tmp_path)
            info = await service.add(PinSpec("research", system, None))
            assert info["tail_tokens"] == tail and info["num_tokens"] % 16 == tail
            assert info["num_blocks"] == info["num_tokens"] // 16 + 1
            last, tokens = await chat(engine, system, question, max_tokens=8)
            assert last.num_cached_tokens == info["num_tokens"]  # the tail too
            again, _ = await chat(engine, system, research["turns"][3], max_tokens=2)
            assert again.num_cached_tokens == info["num_tokens"]
            [listed] = await service.list()
            assert listed["tokens_served"] == 2 * info["num_tokens"]
            assert (await engine.check_integrity()).ok
            await service.remove("research")
            stats = engine.stats()
            assert stats.pool.num_blocks_used == 0 and stats.pins.num_blocks_pinned == 0
            assert (await engine.check_integrity()).ok
            return system, tokens
        finally:
            engine.shutdown()

    system, tokens = asyncio.run(run())
    assert tokens == uncached_tokens(tiny_llama, system, question)


def test_a_pins_tail_survives_a_restart(tiny_llama, research, tmp_path):
    question = research["turns"][4]

    async def first_life():
        engine = make_engine(tiny_llama)
        try:
            system, _ = system_with_tail(engine, research["system"])
            return system, await PinService(engine, tmp_path).add(PinSpec("r", system, None))
        finally:
            engine.shutdown()

    async def second_life(system):
        engine = make_engine(tiny_llama)
        try:
            [entry] = await PinService(engine, tmp_path).restore_all()
            assert entry["source"] == "store"
            last, tokens = await chat(engine, system, question, max_tokens=8)
            assert (await engine.check_integrity()).ok
            return last.num_cached_tokens, tokens
        finally:
            engine.shutdown()

    system, info = asyncio.run(first_life())
    assert info["tail_tokens"] > 0
    num_cached, tokens = asyncio.run(second_life(system))
    assert num_cached == info["num_tokens"]
    assert tokens == uncached_tokens(tiny_llama, system, question)


def first_step_logits(llm: LLM, prompt: list[int]) -> tuple[torch.Tensor, int]:
    """The logits of a prompt's first sampled token, and how many of its tokens were cached (a
    long prompt runs in chunks: the steps before its last sample nothing)."""
    captured = []
    execute = llm.engine.runner.execute

    def recording(scheduled):
        result = execute(scheduled)
        captured.append(result.logits)
        return result

    llm.engine.runner.execute = recording
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
    finally:
        del llm.engine.runner.execute
    return next(logits for logits in captured if len(logits))[0], out.num_cached_tokens


class TailPin(NamedTuple):
    pinned: LLM  # holds a pin whose tail is at least 5 tokens
    plain: LLM  # the same model without a prefix cache
    system: str
    pin_ids: list[int]
    tail: int  # tokens past the pin's last full block


@pytest.fixture(scope="module")
def tail_pinned(tiny_model_factory, research) -> TailPin:
    path = tiny_model_factory("llama")
    pinned = LLM(str(path), device="cpu", dtype="float32",
                 kv_cache_memory_bytes=256 * BLOCK_BYTES_TINY_LLAMA)
    system, tail = system_with_tail(pinned, research["system"], min_tail=5)
    pin_ids = pin_token_ids(pinned.tokenizer, system, None)
    pinned.engine.add_pin(PinRequest("p", pin_ids))
    while pinned.engine.has_unfinished_requests():
        pinned.engine.step()
    assert pinned.engine.pins.registry.get("p").tail_token_ids == pin_ids[-tail:]
    plain = LLM(str(path), device="cpu", dtype="float32", enable_prefix_caching=False,
                kv_cache_memory_bytes=256 * BLOCK_BYTES_TINY_LLAMA)
    return TailPin(pinned, plain, system, pin_ids, tail)


def assert_served_from_the_tail(tail_pinned: TailPin, prompt: list[int],
                                num_expected: int) -> None:
    """``prompt`` is served ``num_expected`` cached tokens, and its first token's logits are a
    full recompute's to rounding."""
    pinned, plain = tail_pinned.pinned, tail_pinned.plain
    logits, num_cached = first_step_logits(pinned, prompt)
    assert num_cached == num_expected
    expected, none_cached = first_step_logits(plain, prompt)
    assert none_cached == 0
    torch.testing.assert_close(logits, expected, atol=5e-5, rtol=0)
    assert pinned.engine.kv_cache.pool.num_used == pinned.engine.pins.registry.num_pinned_blocks


def test_a_pins_tail_gives_the_logits_of_a_full_recompute(tail_pinned, research):
    """The copied tail KV is the KV the request would have computed: its first token's logits
    match a run without any cache to rounding."""
    messages = [{"role": "system", "content": tail_pinned.system},
                {"role": "user", "content": research["turns"][6]}]
    prompt = render_chat(tail_pinned.pinned.tokenizer, messages, None, None).prompt_token_ids
    assert_served_from_the_tail(tail_pinned, prompt, len(tail_pinned.pin_ids))


def test_a_conversation_that_leaves_the_pin_inside_its_tail(tail_pinned, research):
    """[system, assistant, user] renders the pin's text, then an assistant turn where the pin's
    tail expects a user turn: only the tail's tokens up to that point are served from it."""
    pin_ids = tail_pinned.pin_ids
    messages = [{"role": "system", "content": tail_pinned.system},
                {"role": "assistant", "content": "Hello! What shall we research?"},
                {"role": "user", "content": research["turns"][1]}]
    prompt = render_chat(tail_pinned.pinned.tokenizer, messages, None, None).prompt_token_ids
    full = len(pin_ids) - tail_pinned.tail
    num_equal = full
    while prompt[num_equal] == pin_ids[num_equal]:
        num_equal += 1
    assert full < num_equal < len(pin_ids)  # the pin is left inside its tail
    assert_served_from_the_tail(tail_pinned, prompt, num_equal)


@pytest.mark.parametrize("num_tail_tokens", [2, 3, 4])
def test_a_completion_prompt_that_ends_inside_the_pins_tail(tail_pinned, num_tail_tokens):
    """A /v1/completions prompt (token ids) that stops inside the tail: the tail serves all of
    it but its last token, which is computed for the logits."""
    full = len(tail_pinned.pin_ids) - tail_pinned.tail
    prompt = tail_pinned.pin_ids[:full + num_tail_tokens]
    assert_served_from_the_tail(tail_pinned, prompt, full + num_tail_tokens - 1)
