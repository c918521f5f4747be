"""Kept tails: a finished request that asked to keep its partial last block lets the next turn,
sent as its exact token ids plus more, hit every computed token (prompt + reply less the reply's
last token), with the same greedy tokens as the same prompt computed from nothing."""

from __future__ import annotations

import asyncio

from agentd.config import EngineConfig
from agentd.engine.async_engine import AsyncEngine, _check_references
from agentd.engine.request import EngineRequest
from agentd.engine.sampling_params import SamplingParams

BLOCK_BYTES_TINY_LLAMA = 2 * 2 * 16 * 2 * 16 * 4  # layers * K/V * block * kv heads * dim * fp32


async def run(engine: AsyncEngine, ids: list[int], keep_tail: bool = False,
              salt: str | None = None, max_tokens: int = 7):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokens: list[int] = []
    last = None
    request = EngineRequest(ids, params, cache_salt=salt, keep_tail=keep_tail)
    async for delta in engine.add_request(request):
        tokens += delta.token_ids
        last = delta
    return last, tokens


def test_kept_tail_makes_the_continuation_hit_token_exactly(tiny_model_factory):
    config = EngineConfig(model=str(tiny_model_factory("llama")),
                          kv_cache_memory_bytes=256 * BLOCK_BYTES_TINY_LLAMA)
    engine = AsyncEngine.from_config(config)
    engine.start()

    async def go():
        prompt = list(range(1000, 1045))  # 45 tokens: 2 full blocks and a partial one
        first, reply = await run(engine, prompt, keep_tail=True)
        assert len(reply) == 7
        history = prompt + reply
        for turn in range(3):
            ids = history + list(range(2000 + 10 * turn, 2005 + 10 * turn))
            last, out = await run(engine, ids, keep_tail=True)
            # everything but the reply's last token (no step computed its KV) was a hit
            assert last.num_cached_tokens == len(history) - 1, turn
            _, fresh = await run(engine, ids, salt=f"fresh-{turn}")
            assert out == fresh, turn
            history = ids + out
        assert len(engine.engine.tails) == 4
        await engine.call(_check_references)
        # without a kept tail, only full blocks hit
        _, plain_reply = await run(engine, prompt + [7], max_tokens=5)
        last, _ = await run(engine, prompt + [7] + plain_reply + [9, 9])
        assert last.num_cached_tokens == (len(prompt) + 1 + 5 - 1) // 16 * 16
        engine.release_tails([f"never-{i}" for i in range(3)])  # unknown ids: no-op
        await engine.call(lambda e: e.tails.release_all(e.tails.request_ids))
        assert await engine.call(lambda e: len(e.tails)) == 0
        await engine.call(_check_references)
        assert await engine.call(lambda e: e.stats().pool.num_blocks_used) == 0

    try:
        asyncio.run(go())
    finally:
        engine.shutdown()
