"""A KV pool narrower than the activations (``--kv-cache-dtype float16|bfloat16``).

The CPU attention paths read a fp16/bf16 pool with fp32 math: they equal the fp32 reference
over the same (rounded) keys and values; the KV write rounds to the pool's dtype; a tiny model's
greedy tokens with a fp16 pool are the fp32 pool's; a pin's KV snapshot keeps the pool's dtype
through the file and is refused by a pool of another dtype. A q8_0 pool (``--kv-cache-dtype
q8_0``, on a tiny qwen3: heads of 32) holds 32/17 the tokens, keys its own content, decodes the
same tokens cold and from the prefix cache and near the fp32 pool's, keeps its bytes through a
snapshot, and is refused where it cannot run (the disk tier's round trip: test_kv_tier.py).
"""

from __future__ import annotations

import pytest
import torch

from agentd.config import EngineConfig
from agentd.engine.kv_sizing import resolve_kv_dtype
from agentd.engine.llm_engine import LLMEngine
from agentd.engine.request import EngineRequest
from agentd.engine.sampling_params import SamplingParams
from agentd.kernels.decode_attention import reference_decode_attention, torch_decode_attention
from agentd.kernels.kv_write import reference_write_kv
from agentd.kernels.prefill_attention import reference_prefill_attention, torch_prefill_attention
from agentd.llm import LLM
from agentd.pins.pin_request import PinRequest
from agentd.pins.snapshots import SnapshotMismatch, read_snapshot, write_snapshot

NARROW = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]
BLOCK = 16
POOL_BYTES = 2 * 2**20  # 4,096 tokens of the tiny llama in fp32


def planes_pool(gen: torch.Generator, num_blocks: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype) -> torch.Tensor:
    """The runner's layout (all keys, then all values), rounded to ``dtype``."""
    planes = torch.randn(2, num_blocks, BLOCK, num_kv_heads, head_dim, generator=gen)
    return planes.to(dtype).transpose(0, 1)


def shared_tables(gen: torch.Generator, lens: list[int], num_shared: int
                  ) -> tuple[torch.Tensor, int]:
    """Block tables whose rows share ``num_shared`` consecutive leading blocks (a pin), then
    blocks of their own in a random order."""
    own = (torch.randperm(60, generator=gen) + num_shared).tolist()
    tables = []
    for seq_len in lens:
        tail = [own.pop() for _ in range(-(-seq_len // BLOCK) - num_shared)]
        tables.append(list(range(num_shared)) + tail)
    width = max(map(len, tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32), \
        num_shared + 60


@pytest.mark.parametrize("dtype", NARROW)
def test_decode_over_a_narrow_pool_is_fp32_math_over_the_rounded_kv(dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    lens = [70, 40, 33, 90]  # behind 2 shared blocks; one row ends one token past them
    block_tables, num_blocks = shared_tables(gen, lens, 2)
    kv_cache = planes_pool(gen, num_blocks, 3, 64, dtype)
    query = torch.randn(len(lens), 9, 64, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    actual = torch_decode_attention(query, kv_cache, block_tables, seq_lens, 0.125)
    expected = reference_decode_attention(query, kv_cache.float(), block_tables, seq_lens, 0.125)
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", NARROW)
def test_prefill_over_a_narrow_pool_is_fp32_math_over_the_rounded_kv(dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    chunks = [5, 20, 1]  # three turns behind a 3-block pin, one of them over a partial block
    lens = [48 + 5, 48 + 30, 48 + 1]
    block_tables, num_blocks = shared_tables(gen, lens, 3)
    kv_cache = planes_pool(gen, num_blocks, 2, 32, dtype)
    query = torch.randn(sum(chunks), 4, 32, generator=gen)
    starts = torch.tensor([0, 5, 25, 26], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    actual = torch_prefill_attention(query, kv_cache, block_tables, starts, seq_lens, 0.2)
    expected = reference_prefill_attention(query, kv_cache.float(), block_tables, starts,
                                           seq_lens, 0.2)
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", NARROW)
def test_the_kv_write_rounds_to_the_pool_dtype(dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    kv_cache = torch.zeros(4, 2, BLOCK, 2, 32, dtype=dtype)
    key, value = torch.randn(2, 5, 2, 32, generator=gen)
    slots = torch.tensor([3, 17, 18, 40, 63])
    reference_write_kv(key, value, kv_cache, slots)
    for i, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, BLOCK)
        assert torch.equal(kv_cache[block, 0, offset], key[i].to(dtype))
        assert torch.equal(kv_cache[block, 1, offset], value[i].to(dtype))


def test_auto_is_fp32_only_in_the_exact_mode() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kv_dtype("auto", torch.float32, "float32", cpu) == torch.float32
    for weights in ("int4", "int8", "bfloat16", "float16", "gguf"):
        assert resolve_kv_dtype("auto", torch.float32, weights, cpu) == torch.float16
    assert resolve_kv_dtype("auto", torch.bfloat16, "bfloat16", cpu) == torch.bfloat16
    assert resolve_kv_dtype("auto", torch.bfloat16, "bfloat16", cuda) == torch.bfloat16
    assert resolve_kv_dtype("auto", torch.float32, "float32", cuda) == torch.float32
    assert resolve_kv_dtype("bfloat16", torch.float32, "float32", cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="must be auto, float32, float16, bfloat16 or q8_0, not"):
        EngineConfig(kv_cache_dtype="int8")


@pytest.fixture(scope="module")
def tiny_engines(tiny_model_factory) -> dict[str, LLMEngine]:
    """The tiny llama with a pool of each dtype, over one loaded model."""
    path = str(tiny_model_factory("llama"))
    exact = LLM(path, device="cpu", kv_cache_memory_bytes=POOL_BYTES).engine
    engines = {"float32": exact}
    for name in ("float16", "bfloat16"):
        config = EngineConfig(model=path, device="cpu", kv_cache_memory_bytes=POOL_BYTES,
                              kv_cache_dtype=name)
        engines[name] = LLMEngine(config, loaded=exact.loaded)
    return engines


def greedy(engine: LLMEngine, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    ids = [engine.add_request(EngineRequest(p, params)) for p in prompts]
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            out[delta.request_id].extend(delta.token_ids)
    return [out[rid] for rid in ids]


def test_greedy_tokens_with_a_fp16_pool_are_the_fp32_pools(tiny_engines) -> None:
    exact, half = tiny_engines["float32"], tiny_engines["float16"]
    assert exact.runner.kv_caches[0].dtype == torch.float32
    assert half.runner.kv_caches[0].dtype == torch.float16
    assert half.num_blocks == 2 * exact.num_blocks  # the same bytes hold twice the tokens
    assert half.fingerprint != exact.fingerprint  # its KV is its own
    assert exact.fingerprint == exact.loaded.fingerprint  # as before KV dtypes existed
    prompts = [[1, 2, 3, 4, 5], list(range(10, 60)), list(range(300, 340)) * 2]
    assert greedy(half, prompts, 12) == greedy(exact, prompts, 12)
    assert half.stats().kv_cache.dtype == "float16"


def _pin(engine: LLMEngine, name: str, token_ids: list[int]) -> None:
    engine.add_pin(PinRequest(name, token_ids))
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_a_pin_snapshot_keeps_the_pool_dtype_and_another_dtype_refuses_it(
        name, tiny_engines, tmp_path) -> None:
    engine = tiny_engines[name]
    token_ids = list(range(500, 548))  # 3 full blocks
    _pin(engine, "p", token_ids)
    payload = engine.gather_pin_snapshot("p")
    path = tmp_path / "p.pt"
    write_snapshot(payload, path, tmp_path)
    loaded = read_snapshot(path)
    assert loaded["kv"].dtype == engine.runner.kv_caches[0].dtype
    assert torch.equal(loaded["kv"].view(torch.int16), payload["kv"].view(torch.int16))

    again = LLMEngine(engine.config, loaded=engine.loaded)  # a restart with the same settings
    result = again.restore_pin(PinRequest("p", token_ids), loaded)
    assert result.error is None and result.pin is not None
    for old, new in zip(engine.runner.kv_caches, again.runner.kv_caches, strict=True):
        old_ids = engine.pins.registry.get("p").block_ids
        new_ids = again.pins.registry.get("p").block_ids
        assert torch.equal(old[old_ids].view(torch.int16), new[new_ids].view(torch.int16))

    other = "bfloat16" if name == "float16" else "float16"
    for wrong in (tiny_engines["float32"], tiny_engines[other]):
        with pytest.raises(SnapshotMismatch, match="another model, dtype or tokenizer"):
            wrong.restore_pin(PinRequest("q", token_ids), loaded)
        forged = {**loaded, "fingerprint": wrong.fingerprint}  # the dtype check stands alone
        with pytest.raises(SnapshotMismatch, match="another --kv-cache-dtype"):
            wrong.restore_pin(PinRequest("q", token_ids), forged)
        assert "q" not in wrong.pins.registry


# q8_0

@pytest.fixture(scope="module")
def q8_engines(tiny_model_factory) -> dict[str, LLMEngine]:
    path = str(tiny_model_factory("qwen3"))
    out: dict[str, LLMEngine] = {}
    for name in ("float32", "float16", "q8_0"):
        config = EngineConfig(model=path, device="cpu", kv_cache_memory_bytes=POOL_BYTES,
                              kv_cache_dtype=name)
        out[name] = LLMEngine(config, loaded=out["float32"].loaded if out else None)
    return out


def test_a_q8_pool_holds_more_tokens_and_keys_its_own_content(q8_engines) -> None:
    q8, half = q8_engines["q8_0"], q8_engines["float16"]
    layer = q8.runner.kv_caches[0]
    assert layer.dtype == torch.int8 and layer.shape[-1] == 34  # one block of 32 a head
    assert q8.num_blocks == int(half.num_blocks * 32 / 17)  # the same bytes
    assert q8.fingerprint not in (half.fingerprint, q8_engines["float32"].fingerprint)
    assert q8.stats().kv_cache.dtype == "q8_0"


def test_q8_greedy_tokens_cold_and_from_the_prefix_cache_agree(q8_engines) -> None:
    q8, exact = q8_engines["q8_0"], q8_engines["float32"]
    prompts = [list(range(100, 180)), list(range(400, 437)) * 2, [5, 6, 7, 8, 9]]
    cold = greedy(q8, prompts, 16)
    hits_before = q8.stats().scheduler.prefix_cache_hits
    assert greedy(q8, prompts, 16) == cold  # the same prompts again: their blocks cached
    assert q8.stats().scheduler.prefix_cache_hits > hits_before
    reference = greedy(exact, prompts, 16)
    same = sum(a == b for c, r in zip(cold, reference, strict=True)
               for a, b in zip(c, r, strict=True))
    assert same >= 0.75 * 16 * len(prompts), (cold, reference)


def test_a_q8_pin_snapshot_keeps_its_bytes_and_another_dtype_refuses_it(q8_engines,
                                                                        tmp_path) -> None:
    engine = q8_engines["q8_0"]
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
    wrong = q8_engines["float16"]
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
