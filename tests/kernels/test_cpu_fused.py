"""The fused decode-step operations (agentd.kernels.cpu.fused) against their torch references, on
every ISA path this CPU runs (the AVX2 one forced on an AVX-512 machine, and torch's)."""

from __future__ import annotations

import pytest
import torch

from agentd.kernels.cpu import fused
from agentd.kernels.decode_attention import reference_decode_attention

POOL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("kv_dtype", POOL_DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim",
                         [(4, 4, 64), (8, 2, 128), (6, 1, 80), (6, 3, 96), (4, 4, 96),
                          (8, 1, 64), (10, 2, 64), (12, 2, 64), (6, 2, 64)])  # G = 8, 5, 6, 3
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_attention_matches_the_reference_and_reads_no_unused_slot(
        kv_dtype, num_heads, num_kv_heads, head_dim, block_size, isa, paged_kv, generator):
    seq_lens = [1, block_size, block_size + 3, 5 * block_size - 1, 77]
    kv = paged_kv(seq_lens, block_size, num_kv_heads, head_dim, kv_dtype, torch.device("cpu"),
                  generator)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=generator)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    # The torch path may read a partial block's unused slots (masked after): its pool is clean.
    pool = kv.clean_kv_cache if isa == "torch" else kv.kv_cache
    actual = fused.decode_attention(query, pool, kv.block_tables, lens, 0.3)
    expected = reference_decode_attention(query, kv.clean_kv_cache.float(), kv.block_tables,
                                          lens, 0.3)
    assert not actual.isnan().any(), "a NaN (unused) slot of the pool was read"
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)


def _shared_prefix_batch(gen: torch.Generator, block_size: int, groups: list[int],
                         shared_blocks: int, num_blocks: int = 96
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows in groups sharing ``shared_blocks`` leading blocks (agents on one prefix), each with
    a tail of its own; blocks in random order."""
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, lens = [], []
    for rows in groups:
        prefix = [free.pop() for _ in range(shared_blocks)]
        for _ in range(rows):
            tail = int(torch.randint(1, 3 * block_size, (1,), generator=gen))
            tables.append(prefix + [free.pop() for _ in range(-(-tail // block_size))])
            lens.append(shared_blocks * block_size + tail)
    width = max(len(t) for t in tables) + 1
    return (torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            torch.tensor(lens, dtype=torch.int32))


@pytest.mark.parametrize("kv_dtype", POOL_DTYPES)
@pytest.mark.parametrize("groups,shared_blocks", [([8], 6), ([3, 1, 4], 2), ([2], 0), ([5], 1)])
@pytest.mark.parametrize("head_dim", [64, 80])  # 80: the vector loops' tails
def test_decode_attention_over_shared_prefixes(kv_dtype, groups, shared_blocks, head_dim, isa,
                                               generator):
    block_size, num_kv_heads = 16, 2
    planes = torch.randn(2, 96, block_size, num_kv_heads, head_dim, generator=generator)
    kv_cache = planes.to(kv_dtype).transpose(0, 1)  # the runner's layout: keys, then values
    tables, lens = _shared_prefix_batch(generator, block_size, groups, shared_blocks)
    query = torch.randn(len(lens), 8, head_dim, generator=generator)
    actual = fused.decode_attention(query, kv_cache, tables, lens, 0.125)
    expected = reference_decode_attention(query, kv_cache.float(), tables, lens, 0.125)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_decode_attention_over_long_contexts_in_many_spans(kv_dtype, isa, generator):
    # a row's context goes in spans of at most 512 slots, its partials merged: one row alone
    # (1,300 slots), and two rows on a shared 10-block prefix with long own tails (700, 1,100)
    block_size, num_kv_heads, head_dim, num_blocks = 16, 2, 64, 256
    planes = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    kv_cache = planes.to(kv_dtype).transpose(0, 1)
    free = torch.randperm(num_blocks, generator=generator).tolist()
    prefix = [free.pop() for _ in range(10)]
    lens = [1300, 160 + 700, 160 + 1100]
    tables = [[free.pop() for _ in range(-(-1300 // block_size))]]
    tables += [prefix + [free.pop() for _ in range(-(-(n - 160) // block_size))] for n in lens[1:]]
    width = max(map(len, tables))
    tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    query = torch.randn(len(lens), 8, head_dim, generator=generator)
    actual = fused.decode_attention(query, kv_cache, tables, seq_lens, 0.125)
    expected = reference_decode_attention(query, kv_cache.float(), tables, seq_lens, 0.125)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(("kv_dtype", "groups", "path"), [
    (torch.float32, [4], "torch"), (torch.float32, [3, 1], "torch"),
    (torch.float32, [1, 1, 1], "kernel"), (torch.float32, [1], "kernel"),
    (torch.float16, [4], "kernel"), (torch.bfloat16, [3, 1], "kernel")])
def test_the_cpu_backend_leaves_fp32_rows_on_one_prefix_to_torch(kv_dtype, groups, path, generator,
                                                                 monkeypatch):
    # the measured choice (kernels/backend.py cpu_decode): torch's grouped products for rows that
    # share leading blocks in an fp32 pool, the C++ kernel for everything else
    from agentd.kernels import backend

    calls: list[str] = []
    monkeypatch.setattr(backend, "torch_decode_attention",
                        lambda *args: calls.append("torch") or reference_decode_attention(*args))
    monkeypatch.setattr(fused, "decode_attention",
                        lambda *args: calls.append("kernel") or reference_decode_attention(*args))
    block_size, num_kv_heads, head_dim = 16, 2, 64
    kv_cache = torch.randn(96, 2, block_size, num_kv_heads, head_dim, generator=generator)
    tables, lens = _shared_prefix_batch(generator, block_size, groups, 3)
    query = torch.randn(len(lens), 8, head_dim, generator=generator)
    backend.get_attention_backend("auto", torch.device("cpu")).decode(
        query, kv_cache.to(kv_dtype), tables, lens, 0.125)
    assert calls == [path]


def _chunks_behind_prefixes(gen: torch.Generator, rows: list[int], cached: list[int],
                            block_size: int, num_blocks: int = 96):
    """Prefill chunks of ``rows[i]`` query rows behind ``cached[i]`` tokens, blocks shuffled."""
    free = torch.randperm(num_blocks, generator=gen).tolist()
    lens = [c + r for c, r in zip(cached, rows, strict=True)]
    width = max(-(-n // block_size) for n in lens) + 1
    tables = torch.tensor([[free.pop() for _ in range(width)] for _ in lens], dtype=torch.int32)
    starts = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32)
    return tables, starts, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("kv_dtype", POOL_DTYPES)
@pytest.mark.parametrize(("rows", "cached", "path"), [
    ([9], [200], "decode"),  # a speculative step: 8 drafts behind a prompt
    ([3, 1, 9], [40, 77, 0], "decode"),  # several, one of them without a cached token
    ([9, 10], [64, 3], "prefill"),  # a chunk over SHORT_CHUNK_ROWS
])
def test_the_cpu_backend_prefills_short_chunks_as_decode_rows(kv_dtype, rows, cached, path, isa,
                                                              generator, monkeypatch):
    # kernels/backend.py cpu_prefill: short chunks in an fp16/bf16 pool run on the decode kernel,
    # each row over the keys up to its own; fp32 pools and longer chunks on the prefill kernel
    # (here with fp32 products, so both paths meet the fp32 reference to rounding)
    from agentd.kernels import backend
    from agentd.kernels.prefill_attention import reference_prefill_attention

    monkeypatch.setenv(fused.BF16_ENV, "0")
    calls: list[str] = []
    decode, prefill = fused.decode_attention, fused.prefill_attention
    monkeypatch.setattr(fused, "decode_attention",
                        lambda *args: calls.append("decode") or decode(*args))
    monkeypatch.setattr(fused, "prefill_attention",
                        lambda *args: calls.append("prefill") or prefill(*args))
    block_size, num_kv_heads, head_dim = 16, 2, 64
    kv_cache = torch.randn(96, 2, block_size, num_kv_heads, head_dim, generator=generator)
    tables, starts, lens = _chunks_behind_prefixes(generator, rows, cached, block_size)
    query = torch.randn(sum(rows), 8, head_dim, generator=generator)
    pool = kv_cache.to(kv_dtype)
    actual = backend.get_attention_backend("auto", torch.device("cpu")).prefill(
        query, pool, tables, starts, lens, 0.125)
    expected = reference_prefill_attention(query, pool.float(), tables, starts, lens, 0.125)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)
    assert calls == ["prefill" if kv_dtype == torch.float32 else path]


@pytest.mark.parametrize("kv_dtype", POOL_DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"),
                         [(4, 4, 64), (9, 3, 64), (8, 1, 128), (6, 2, 80), (4, 2, 40)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_attention_matches_the_reference_and_reads_no_unused_slot(
        kv_dtype, num_heads, num_kv_heads, head_dim, block_size, isa, generator):
    """ops_prefill.h: chunks of 1 to 150 rows behind 0 to ~300 cached tokens (tiles of 128
    slots and of 128 query lanes cut anywhere), several in one call; the pool's slots past each
    context hold NaN, so a slot read that should not be shows."""
    from agentd.kernels.prefill_attention import reference_prefill_attention

    rows, cached = [150, 1, 37, 64], [0, 290, 63, 129]
    tables, starts, lens = _chunks_behind_prefixes(generator, rows, cached, block_size)
    planes = torch.randn(2, 96, block_size, num_kv_heads, head_dim, generator=generator)
    clean = planes.transpose(0, 1).contiguous()
    pool = torch.full_like(clean, float("nan"))
    for table, length in zip(tables.tolist(), lens.tolist(), strict=True):
        for slot in range(length):
            block, offset = table[slot // block_size], slot % block_size
            pool[block, :, offset] = clean[block, :, offset]
    query = torch.randn(sum(rows), num_heads, head_dim, generator=generator)
    expected = reference_prefill_attention(query, clean.to(kv_dtype).float(), tables, starts,
                                           lens, 0.125)
    # the torch path may read a partial block's unused slots (masked after): its pool is clean
    actual = fused.prefill_attention(query, (clean if isa == "torch" else pool).to(kv_dtype),
                                     tables, starts, lens, 0.125, bf16=False)
    assert not actual.isnan().any(), "a NaN (unused) slot of the pool was read"
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"),
                         [(8, 2, 64), (4, 4, 64), (8, 1, 128)])
def test_prefill_attention_in_bfloat16_products_stays_near_the_fp32_reference(
        kv_dtype, num_heads, num_kv_heads, head_dim, generator):
    """``bf16=True`` (vdpbf16ps, where the CPU has AVX512-BF16): queries, keys, weights and
    values rounded to bfloat16, sums in fp32; the outputs' error stays that of the rounding
    (bfloat16 keeps 8 bits: ~0.4% of a value). Tasks of 128 query vectors and of fewer (a
    chunk's last rows), tiles of 128 slots cut anywhere; the pool's slots past each context
    hold NaN, so a slot read that should not be shows."""
    from agentd.kernels import cpu
    from agentd.kernels.prefill_attention import reference_prefill_attention

    if cpu.active_isa() != "avx512_vnni" or not cpu._native().module.has_bf16_attention():
        pytest.skip("this CPU has no AVX512-BF16: prefill attention's products stay fp32")
    block_size = 16
    rows, cached = [200, 9, 70], [1000, 0, 33]
    tables, starts, lens = _chunks_behind_prefixes(generator, rows, cached, block_size, 256)
    kv_cache = torch.randn(256, 2, block_size, num_kv_heads, head_dim, generator=generator)
    pool = kv_cache.to(kv_dtype)
    poisoned = torch.full_like(pool, float("nan"))
    for table, length in zip(tables.tolist(), lens.tolist(), strict=True):
        for slot in range(length):
            block, offset = table[slot // block_size], slot % block_size
            poisoned[block, :, offset] = pool[block, :, offset]
    query = torch.randn(sum(rows), num_heads, head_dim, generator=generator)
    expected = reference_prefill_attention(query, pool.float(), tables, starts, lens, 0.125)
    actual = fused.prefill_attention(query, poisoned, tables, starts, lens, 0.125, bf16=True)
    assert not actual.isnan().any(), "a NaN (unused) slot of the pool was read"
    error = (actual - expected).abs()
    assert error.max() < 0.02 and error.mean() < 2e-3, (error.max(), error.mean())
    exact = fused.prefill_attention(query, pool, tables, starts, lens, 0.125, bf16=False)
    assert (exact - expected).abs().max() < 2e-5 < error.max()  # it did take the bf16 path


@pytest.mark.parametrize("kv_dtype", POOL_DTYPES)
def test_prefill_products_are_bfloat16_by_default_outside_the_fp32_pool(kv_dtype, generator,
                                                                        monkeypatch):
    """The default (``bf16=None``): bfloat16 products in a float16/bfloat16 pool where the CPU
    has AVX512-BF16, fp32 in the exact mode's float32 pool; ``AGENTD_PREFILL_BF16=0`` keeps them
    fp32 in every pool. Each default equals its explicit call bit for bit."""
    from agentd.kernels import cpu

    if cpu.active_isa() != "avx512_vnni" or not cpu._native().module.has_bf16_attention():
        pytest.skip("this CPU has no AVX512-BF16: prefill attention's products stay fp32")
    rows, cached = [80, 12], [300, 0]
    tables, starts, lens = _chunks_behind_prefixes(generator, rows, cached, 16)
    pool = torch.randn(96, 2, 16, 2, 64, generator=generator).to(kv_dtype)
    query = torch.randn(sum(rows), 8, 64, generator=generator)

    def run(bf16: bool | None) -> torch.Tensor:
        return fused.prefill_attention(query, pool, tables, starts, lens, 0.125, bf16=bf16)

    exact, low = run(False), run(True)
    monkeypatch.delenv(fused.BF16_ENV, raising=False)
    default = run(None)
    if kv_dtype == torch.float32:
        assert torch.equal(default, exact)
    else:
        assert torch.equal(default, low) and not torch.equal(low, exact)
    monkeypatch.setenv(fused.BF16_ENV, "0")
    assert torch.equal(run(None), exact)


def test_decode_attention_rejects_a_block_outside_the_pool(isa):
    if isa == "torch":
        pytest.skip("the torch path indexes the pool and raises its own IndexError")
    kv_cache = torch.zeros(4, 2, 16, 1, 64)
    with pytest.raises(RuntimeError, match="outside the pool"):
        fused.decode_attention(torch.zeros(1, 1, 64), kv_cache,
                               torch.tensor([[9]], dtype=torch.int32),
                               torch.tensor([3], dtype=torch.int32), 1.0)


@pytest.mark.parametrize("kv_dtype", POOL_DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_write_kv_rotates_views_of_one_projection_and_writes_their_slots(
        kv_dtype, interleaved, isa, generator):
    tokens, num_heads, num_kv_heads, head_dim, block_size = 5, 4, 2, 64, 16
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=generator)
    angles = torch.rand(tokens, head_dim // 2, generator=generator) * 6.0
    cos, sin = angles.cos(), angles.sin()
    slots = torch.tensor([3, 17, 18, 40, 63])
    pools, rotated = [], []
    for impl in (fused.rope_write_kv, fused.reference_rope_write_kv):
        x = qkv.clone()
        q, k, v = (part.reshape(tokens, -1, head_dim)
                   for part in x.split([q_size, kv_size, kv_size], dim=-1))
        pool = torch.full((2, 4, block_size, num_kv_heads, head_dim), 7.0).to(kv_dtype)
        pool = pool.transpose(0, 1)
        impl(q, k, v, cos, sin, interleaved, pool, slots)
        pools.append(pool)
        rotated.append(x)
    torch.testing.assert_close(rotated[0], rotated[1], atol=1e-6, rtol=1e-6)
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[kv_dtype]
    torch.testing.assert_close(pools[0].float(), pools[1].float(), atol=tol, rtol=tol)
    untouched = torch.ones(4 * block_size, dtype=torch.bool)
    untouched[slots] = False
    by_slot = pools[0].permute(0, 2, 1, 3, 4).reshape(4 * block_size, -1)
    assert (by_slot[untouched] == 7.0).all()
    assert not (by_slot[slots] == 7.0).all(dim=-1).any()


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_pool_writes_round_like_torch(kv_dtype, isa):
    """Ties, subnormals, overflow, infinities and NaN land in the pool as ``Tensor.to`` rounds
    them (written as values, which the rotary leaves alone)."""
    special = torch.tensor([1.0 + 2**-11, 1.0 + 3 * 2**-11, 2**-24, 3 * 2**-25, 2**-15 + 2**-25,
                            65504.0, 65519.0, 65520.0, 1e6, -1e-9, float("inf"), float("-inf"),
                            float("nan"), 1.0 + 2**-8, 1.0 + 3 * 2**-8, 3.1e-40, 0.0, -0.0,
                            123.456, -3e38])
    head_dim = 64
    values = torch.cat([special, torch.randn(head_dim - special.numel())])
    pool = torch.zeros(1, 2, 16, 1, head_dim, dtype=kv_dtype)
    fused.rope_write_kv(torch.zeros(1, 1, head_dim), torch.zeros(1, 1, head_dim),
                        values.reshape(1, 1, head_dim).clone(), torch.ones(1, head_dim // 2),
                        torch.zeros(1, head_dim // 2), False, pool, torch.tensor([0]))
    written, expected = pool[0, 1, 0, 0], values.to(kv_dtype)
    nan = expected.isnan()
    assert torch.equal(written.isnan(), nan)
    assert torch.equal(written[~nan].view(torch.int16), expected[~nan].view(torch.int16))


@pytest.mark.parametrize("rows,K", [(1, 2048), (3, 576), (40, 1000), (2, 7)])
@pytest.mark.parametrize("with_x", [True, False])
def test_add_rms_norm_updates_the_residual_and_normalizes_it(rows, K, with_x, isa, generator):
    residual = torch.randn(rows, K, generator=generator) * 3
    x = torch.randn(rows, K, generator=generator) if with_x else None
    weight = torch.rand(K, generator=generator) + 0.5
    ref_residual = residual.clone()
    expected = fused.reference_add_rms_norm(x, ref_residual, weight, 1e-5)
    actual = fused.add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(residual, ref_residual, atol=0, rtol=0)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows,size", [(1, 8192), (5, 1536), (70, 100)])
def test_silu_mul(rows, size, isa, generator):
    gate_up = torch.randn(rows, 2 * size, generator=generator) * 6
    torch.testing.assert_close(fused.silu_mul(gate_up), fused.reference_silu_mul(gate_up),
                               atol=1e-6, rtol=1e-5)
