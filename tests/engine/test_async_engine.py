"""AsyncEngine on a tiny model: concurrent streams, cancellation, calls on the engine thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from agentd.config import EngineConfig
from agentd.engine.async_engine import AsyncEngine
from agentd.engine.llm_engine import EngineStats, LLMEngine
from agentd.engine.outputs import StreamDelta
from agentd.engine.request import EngineRequest
from agentd.engine.sampling_params import SamplingParams
from agentd.llm import LLM
from agentd.pins.pin_request import PinRequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
TEXTS = ["The quick brown fox jumps over", "def fibonacci(n):", "In 1492, Columbus sailed",
         "Dear team, the deploy is", "SELECT * FROM users WHERE", "Once upon a time"]


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def offline(model_path: str) -> LLM:
    return LLM(model_path, device="cpu", kv_cache_memory_bytes=16 * 2**20)


@pytest.fixture(scope="module")
def prompts(offline: LLM) -> list[list[int]]:
    return [offline.tokenizer(text).input_ids for text in TEXTS]


@pytest.fixture()
def engine(model_path: str, offline: LLM):
    # Shares the loaded weights with the offline LLM; its own pool and scheduler.
    config = EngineConfig(model=model_path, device="cpu", kv_cache_memory_bytes=16 * 2**20,
                          max_model_len=256)
    engine = AsyncEngine(LLMEngine(config, loaded=offline.engine.loaded))
    engine.start()
    yield engine
    engine.shutdown()
    assert not engine.running


def run(coro_fn: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(coro_fn(), timeout=60))


async def collect(stream: AsyncIterator[StreamDelta]) -> list[StreamDelta]:
    return [delta async for delta in stream]


async def pool_state(engine: AsyncEngine) -> tuple[int, int, int]:
    """Blocks in use, requests running, requests waiting: read on the engine thread."""
    return await engine.call(lambda e: (e.stats().pool.num_blocks_used, e.scheduler.num_running,
                                        e.scheduler.num_waiting))


def test_concurrent_streams_match_the_offline_api(engine: AsyncEngine, offline: LLM,
                                                  prompts: list[list[int]]) -> None:
    expected = offline.generate(prompts, GREEDY)

    async def main() -> tuple[list[list[StreamDelta]], EngineStats]:
        streams = [engine.add_request(EngineRequest(p, GREEDY)) for p in prompts]
        results = await asyncio.gather(*(collect(s) for s in streams))
        return results, await engine.call(lambda e: e.stats())

    results, stats = run(main)
    for deltas, want in zip(results, expected, strict=True):
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
        assert [t for d in deltas for t in d.token_ids] == want.token_ids
        assert "".join(d.text for d in deltas) == want.text
        assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == 12
        assert deltas[-1].num_prompt_tokens == len(want.prompt_token_ids)
        assert deltas[0].first_token_time_s is not None
    assert stats.totals.num_requests_finished == len(prompts) and stats.pool.num_blocks_used == 0
    assert stats.totals.num_steps < len(prompts) * 12  # the streams really shared steps


@pytest.mark.parametrize("how", ["aclose", "cancel"])
def test_a_stream_that_goes_away_is_aborted_and_frees_its_blocks(engine: AsyncEngine,
                                                                 prompts: list[list[int]],
                                                                 how: str) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main() -> tuple[tuple[int, int, int], tuple[int, int, int], int, int]:
        stream = engine.add_request(EngineRequest(prompts[0], long))
        survivor = engine.add_request(EngineRequest(prompts[1], GREEDY))
        survivor_task = asyncio.create_task(collect(survivor))
        got_three = asyncio.Event()
        seen: list[StreamDelta] = []

        async def consume() -> None:
            async for delta in stream:
                seen.append(delta)
                if len(seen) == 3:
                    got_three.set()

        if how == "aclose":
            for _ in range(3):
                seen.append(await stream.__anext__())
            during = await pool_state(engine)
            await stream.aclose()
        else:
            task = asyncio.create_task(consume())
            await got_three.wait()
            during = await pool_state(engine)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        survivor_deltas = await survivor_task
        after = await pool_state(engine)
        num_generated = await engine.call(lambda e: e.stats().totals.generation_tokens_total)
        assert not seen[-1].finished
        return during, after, sum(len(d.token_ids) for d in survivor_deltas), num_generated

    during, after, num_survivor_tokens, num_generated = run(main)
    assert during[0] > 0 and during[1] >= 1
    assert after == (0, 0, 0)  # nothing running, nothing waiting, no block in use
    assert num_survivor_tokens == 12  # the other stream was not disturbed
    assert num_generated < 12 + 200  # the abandoned one stopped early
    assert engine.pending()["streams"] == 0


def test_call_runs_on_the_engine_thread(engine: AsyncEngine) -> None:
    async def main() -> tuple[str, int | None, int]:
        name, ident = await engine.call(
            lambda e: (threading.current_thread().name, threading.get_ident()))
        num_blocks = await engine.call(lambda e: e.num_blocks)
        return name, ident, num_blocks

    name, ident, num_blocks = run(main)
    assert ident == engine._thread.ident and ident != threading.get_ident()
    assert name == "agentd-engine"
    assert num_blocks == engine.engine.num_blocks


def test_call_propagates_exceptions(engine: AsyncEngine) -> None:
    async def main() -> None:
        await engine.call(lambda e: 1 / 0)

    with pytest.raises(ZeroDivisionError):
        run(main)
    assert engine.running


def test_too_long_prompt_is_refused_at_add_time(engine: AsyncEngine) -> None:
    async def main() -> None:
        engine.add_request(EngineRequest(list(range(100, 400)), GREEDY))

    with pytest.raises(ValueError, match="300 tokens.*is 256 tokens"):
        run(main)
    with pytest.raises(ValueError, match="empty"):
        run(lambda: _add(engine, []))
    assert engine.pending() == {"streams": 0, "commands": 0}


async def _add(engine: AsyncEngine, prompt_ids: list[int]) -> None:
    engine.add_request(EngineRequest(prompt_ids, GREEDY))


def test_a_cancelled_pin_registration_leaves_nothing_behind(engine: AsyncEngine,
                                                            prompts: list[list[int]]) -> None:
    """Cancelling ``run_pin`` mid-prefill (a client that hangs up on POST /v1/pins) aborts the
    prefill, registers no pin, holds no block and keeps no stray result on the engine."""
    tokens = (prompts[0] * 40)[:200]

    async def main() -> tuple[int, tuple[int, int, int], int, int]:
        survivor = asyncio.create_task(collect(engine.add_request(
            EngineRequest(prompts[1], GREEDY))))
        task = asyncio.create_task(engine.run_pin(PinRequest("doomed", tokens)))
        while engine.pending()["streams"] < 2:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # a cancelled engine call once failed the engine step, aborting every other request
        assert sum(len(d.token_ids) for d in await survivor) == 12
        for _ in range(100):  # the abort and the clean-up land a step later
            if engine.pending()["streams"] == 0 and engine.pending()["commands"] == 0:
                break
            await asyncio.sleep(0.01)
        num_results = await engine.call(lambda e: len(e.pins.pending))
        num_pins = await engine.call(lambda e: len(e.pins.registry))
        return num_results, await pool_state(engine), num_pins, engine.pending()["streams"]

    num_results, state, num_pins, num_streams = run(main)
    assert num_results == 0
    assert state == (0, 0, 0)
    assert num_pins == 0
    assert num_streams == 0


def test_an_idle_engine_waits_for_requests_still_arriving(engine: AsyncEngine,
                                                          prompts: list[list[int]]) -> None:
    """Requests fired together share the first step: while the server says more are arriving
    (``arriving`` > 0), an idle engine holds its first step, briefly."""
    one = SamplingParams(temperature=0.0, max_tokens=1)

    async def steps_for(arriving: int) -> int:
        before = await engine.call(lambda e: e.stats().totals.num_steps)
        engine.arriving = arriving
        first = asyncio.create_task(collect(engine.add_request(EngineRequest(prompts[0], one))))
        await asyncio.sleep(0.005)  # the second request is still being parsed meanwhile
        second = asyncio.create_task(collect(engine.add_request(EngineRequest(prompts[1], one))))
        engine.arriving = 0
        await first
        await second
        return await engine.call(lambda e: e.stats().totals.num_steps) - before

    assert run(lambda: steps_for(1)) == 1  # both prefilled in one step

    async def announced_but_never_sent() -> list[StreamDelta]:
        engine.arriving = 1  # e.g. a client that stalls mid-body: the wait is bounded
        try:
            return await asyncio.wait_for(collect(engine.add_request(
                EngineRequest(prompts[2], one))), 10)
        finally:
            engine.arriving = 0

    assert run(announced_but_never_sent)[-1].finished
