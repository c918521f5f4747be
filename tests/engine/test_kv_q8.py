"""A q8_0 KV pool in the engine (``--kv-cache-dtype q8_0``) on a tiny qwen3 (heads of 32).

Its pool holds 32/17 as many tokens as float16 in the same bytes; its content has a fingerprint
of its own; a prompt served from the prefix cache decodes the tokens it decoded cold; its greedy
tokens stay near the fp32 pool's; a pin's snapshot keeps the q8_0 bytes through the file and a
pool of another dtype refuses it; the disk tier brings an evicted prefix back byte for byte; a
model whose heads are not a multiple of 32, or a GPU, is refused with a reason.
"""

from __future__ import annotations

import pytest
import torch

from agentd.config import EngineConfig
from agentd.engine.kv_sizing import resolve_kv_dtype
from agentd.engine.llm_engine import LLMEngine
from agentd.engine.request import EngineRequest
from agentd.engine.sampling_params import SamplingParams
from agentd.pins.pin_request import PinRequest
from agentd.pins.snapshots import SnapshotMismatch, read_snapshot, write_snapshot

POOL_BYTES = 2 * 2**20


@pytest.fixture(scope="module")
def engines(tiny_model_factory) -> dict[str, LLMEngine]:
    path = str(tiny_model_factory("qwen3"))
    out: dict[str, LLMEngine] = {}
    for name in ("float32", "float16", "q8_0"):
        config = EngineConfig(model=path, device="cpu", kv_cache_memory_bytes=POOL_BYTES,
                              kv_cache_dtype=name)
        out[name] = LLMEngine(config, loaded=out["float32"].loaded if out else None)
    return out


def greedy(engine: LLMEngine, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    ids = [engine.add_request(EngineRequest(p, params)) for p in prompts]
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            out[delta.request_id].extend(delta.token_ids)
    return [out[rid] for rid in ids]


def test_a_q8_pool_holds_more_tokens_and_keys_its_own_content(engines) -> None:
    q8, half = engines["q8_0"], engines["float16"]
    layer = q8.runner.kv_caches[0]
    assert layer.dtype == torch.int8 and layer.shape[-1] == 34  # one block of 32 a head
    assert q8.num_blocks == int(half.num_blocks * 32 / 17)  # the same bytes
    assert q8.fingerprint not in (half.fingerprint, engines["float32"].fingerprint)
    assert q8.stats().kv_cache.dtype == "q8_0"


def test_q8_greedy_tokens_cold_and_from_the_prefix_cache_agree(engines) -> None:
    q8, exact = engines["q8_0"], engines["float32"]
    prompts = [list(range(100, 180)), list(range(400, 437)) * 2, [5, 6, 7, 8, 9]]
    cold = greedy(q8, prompts, 16)
    hits_before = q8.stats().scheduler.prefix_cache_hits
    assert greedy(q8, prompts, 16) == cold  # the same prompts again: their blocks cached
    assert q8.stats().scheduler.prefix_cache_hits > hits_before
    reference = greedy(exact, prompts, 16)
    same = sum(a == b for c, r in zip(cold, reference, strict=True)
               for a, b in zip(c, r, strict=True))
    assert same >= 0.75 * 16 * len(prompts), (cold, reference)


def _pin(engine: LLMEngine, name: str, token_ids: list[int]) -> None:
    engine.add_pin(PinRequest(name, token_ids))
    while engine.has_unfinished_requests():
        engine.step()


def test_a_q8_pin_snapshot_keeps_its_bytes_and_another_dtype_refuses_it(engines,
                                                                        tmp_path) -> None:
    engine = engines["q8_0"]
    token_ids = list(range(600, 648))  # 3 full blocks
    _pin(engine, "p", token_ids)
    payload = engine.gather_pin_snapshot("p")
    write_snapshot(payload, tmp_path / "p.pt", tmp_path)
    loaded = read_snapshot(tmp_path / "p.pt")
    assert loaded["kv"].dtype == torch.int8 and torch.equal(loaded["kv"], payload["kv"])
    again = LLMEngine(engine.config, loaded=engine.loaded)
    result = again.restore_pin(PinRequest("p", token_ids), loaded)
    assert result.error is None and result.pin is not None
    old_ids = engine.pins.registry.get("p").block_ids
    new_ids = again.pins.registry.get("p").block_ids
    for old, new in zip(engine.runner.kv_caches, again.runner.kv_caches, strict=True):
        assert torch.equal(old[old_ids], new[new_ids])
    wrong = engines["float16"]
    with pytest.raises(SnapshotMismatch, match="another model, dtype or tokenizer"):
        wrong.restore_pin(PinRequest("q", token_ids), loaded)
    with pytest.raises(SnapshotMismatch, match="another --kv-cache-dtype"):
        wrong.restore_pin(PinRequest("q", token_ids), {**loaded, "fingerprint": wrong.fingerprint})


def test_q8_is_refused_where_it_cannot_run(tiny_model_factory) -> None:
    with pytest.raises(ValueError, match="CPU only"):
        resolve_kv_dtype("q8_0", torch.float32, "gguf", torch.device("cuda"))
    assert resolve_kv_dtype("q8_0", torch.float32, "gguf", torch.device("cpu")) == torch.int8
    llama = str(tiny_model_factory("llama"))  # heads of 16
    with pytest.raises(ValueError, match="head size divisible by 32"):
        LLMEngine(EngineConfig(model=llama, device="cpu", kv_cache_dtype="q8_0",
                               kv_cache_memory_bytes=POOL_BYTES))
    with pytest.raises(ValueError, match="bfloat16 or q8_0, not 'int4'"):
        EngineConfig(kv_cache_dtype="int4")
