"""The CPU prefill path (chunks over a shared cached prefix in one call) against the reference."""

from __future__ import annotations

import pytest
import torch

from agentd.kernels._common import matmul_dtype
from agentd.kernels.prefill_attention import (
    MATMUL_TILE_ROWS,
    reference_prefill_attention,
    torch_prefill_attention,
)

needs_bf16_gemm = pytest.mark.skipif(
    matmul_dtype(torch.bfloat16, torch.device("cpu")) != torch.bfloat16,
    reason="this CPU has no bfloat16 GEMMs, so bfloat16 runs through SDPA")


def build_batch(gen: torch.Generator, block_size: int, specs: list[tuple[int, int, int]],
                num_blocks: int = 200, consecutive: bool = False, pinned: bool = False):
    """``specs``: (group, context before the chunk, chunk length) per sequence; sequences of one
    group share their leading blocks (as many as the shortest context fills). Blocks are handed
    out in a random order, or in pool order with ``consecutive``; with ``pinned`` each group's
    shared blocks are consecutive (a pin prefilled into an empty pool) and the rest random."""
    free = (list(range(num_blocks))[::-1] if consecutive
            else torch.randperm(num_blocks, generator=gen).tolist())
    shared: dict[int, list[int]] = {}
    min_ctx: dict[int, int] = {}
    for group, ctx, _ in specs:
        min_ctx[group] = min(min_ctx.get(group, ctx), ctx)
    tables, lens, chunks = [], [], []
    for group, ctx, chunk in specs:
        if group not in shared:
            count = min_ctx[group] // block_size
            if pinned:
                first = min(free)  # leaves room: the tests' pools are several times the pins
                while any(b not in free for b in range(first, first + count)):
                    first += 1
                for b in range(first, first + count):
                    free.remove(b)
                shared[group] = list(range(first, first + count))
            else:
                shared[group] = [free.pop() for _ in range(count)]
        total = ctx + chunk
        own = [free.pop() for _ in range(-(-total // block_size) - len(shared[group]))]
        tables.append(shared[group] + own)
        lens.append(total)
        chunks.append(chunk)
    width = max(len(t) for t in tables) + 1
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32)
    return block_tables, starts, torch.tensor(lens, dtype=torch.int32), sum(chunks)


CASES = {
    "agents sharing a prompt": [(0, 64, 5), (0, 64, 9), (0, 64, 1), (0, 64, 16)],
    "contexts of different lengths": [(0, 48, 7), (0, 80, 3), (0, 53, 20)],
    "two groups and a loner": [(0, 32, 4), (1, 40, 6), (0, 32, 11), (1, 40, 2), (2, 0, 12)],
    "a cold chunk beside a group": [(0, 0, 30), (1, 33, 4), (1, 33, 8)],
    "a single warm chunk": [(0, 47, 13)],
    "contexts shorter than a block": [(0, 5, 4), (0, 5, 3)],
}
# Chunks of several bfloat16 score tiles (MATMUL_TILE_ROWS rows each).
LONG_CASES = {
    "a cold prompt": [(0, 0, 2 * MATMUL_TILE_ROWS + 44)],
    "a long chunk behind a partial block": [(0, 37, 2 * MATMUL_TILE_ROWS + 30)],
    "a group with long tails": [(0, 64, MATMUL_TILE_ROWS + 20), (0, 64, 9)],
}

# Behind a long prefix prefilled into a fresh pool (consecutive blocks; built with ``pinned``).
PINNED_CASES = {
    "a turn behind a pin": [(0, 544, 40)],
    "a turn behind a pin and its partial block": [(0, 530, 20)],
    "agents behind a pin": [(0, 544, 40), (0, 544, 9), (0, 560, 1)],
    "a long chunk behind a pin": [(0, 520, MATMUL_TILE_ROWS + 30)],
}
ALL_CASES = {**CASES, **LONG_CASES, **PINNED_CASES}


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("case", list(ALL_CASES))
@pytest.mark.parametrize("layout,consecutive", [("interleaved", False), ("planes", False),
                                                ("planes", True)])
def test_grouped_prefill_matches_reference(num_heads, num_kv_heads, block_size, case, layout,
                                           consecutive, make_pool) -> None:
    gen = torch.Generator().manual_seed(hash((num_heads, block_size, case)) % 2**31)
    head_dim = 32
    kv_cache = make_pool(gen, 200, block_size, num_kv_heads, head_dim, layout)
    block_tables, starts, seq_lens, num_tokens = build_batch(
        gen, block_size, ALL_CASES[case], consecutive=consecutive, pinned=case in PINNED_CASES)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    expected = reference_prefill_attention(query, kv_cache, block_tables, starts, seq_lens, 0.2)
    actual = torch_prefill_attention(query, kv_cache, block_tables, starts, seq_lens, 0.2)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_a_shared_prefix_is_gathered_once(monkeypatch) -> None:
    """The point of grouping: one gather of the pool per group, not one per sequence."""
    gen = torch.Generator().manual_seed(3)
    kv_cache = torch.randn(200, 2, 16, 3, 32, generator=gen)
    block_tables, starts, seq_lens, num_tokens = build_batch(
        gen, 16, [(0, 160, 9), (0, 160, 12), (0, 160, 7), (0, 160, 30)])
    query = torch.randn(num_tokens, 9, 32, generator=gen)
    calls = []
    original = torch.Tensor.index_select

    def counting(self, dim, index):
        if self._base is kv_cache:  # the keys or the values of the pool
            calls.append(len(index))
        return original(self, dim, index)

    monkeypatch.setattr(torch.Tensor, "index_select", counting)
    torch_prefill_attention(query, kv_cache, block_tables, starts, seq_lens, 0.2)
    # keys and values of the tails (1, 1, 1 and 2 blocks), then of the 10 shared blocks, once
    assert calls == [4 * 1 + 1] * 2 + [10] * 2


def test_consecutive_blocks_are_read_in_place(monkeypatch, make_pool) -> None:
    """A lone warm chunk whose blocks follow each other in the pool gathers nothing."""
    gen = torch.Generator().manual_seed(4)
    kv_cache = make_pool(gen, 50, 16, 3, 32, "planes")
    block_tables, starts, seq_lens, num_tokens = build_batch(gen, 16, [(0, 200, 30)],
                                                             consecutive=True)
    query = torch.randn(num_tokens, 9, 32, generator=gen)
    expected = reference_prefill_attention(query, kv_cache, block_tables, starts, seq_lens, 0.2)
    gathers = []
    original = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select",
                        lambda self, dim, index: gathers.append(len(index))
                        or original(self, dim, index))
    actual = torch_prefill_attention(query, kv_cache, block_tables, starts, seq_lens, 0.2)
    assert gathers == []
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_group_attends_each_row_to_the_shared_blocks_and_its_own_tail_only(dtype, monkeypatch,
                                                                            make_pool) -> None:
    """Turns behind a shared prompt beside a chunk deep into a longer prompt of its own (the
    scheduler admits both in one step): every row attends to the shared keys and its own
    chunk's, never to another chunk's tail. One mask over all tails did (a 5.8 s step for 8
    turns beside one 800-token chunk). Counted as query-head rows x keys over the products."""
    gen = torch.Generator().manual_seed(7)
    num_heads, num_kv_heads = 9, 3
    kv_cache = make_pool(gen, 200, 16, num_kv_heads, 64, "planes").to(dtype)
    specs = [(0, 544, 40), (0, 544, 9), (0, 1100, 30)]
    block_tables, starts, seq_lens, num_tokens = build_batch(gen, 16, specs, pinned=True)
    query = torch.randn(num_tokens, num_heads, 64, generator=gen).to(dtype)
    expected = reference_prefill_attention(query.float(), kv_cache.float(), block_tables, starts,
                                           seq_lens, 0.125)
    work = []
    if matmul_dtype(dtype, torch.device("cpu")) == torch.float32:
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

        def counting(q, k, v, *args, **kwargs):
            work.append(q.shape[1] * q.shape[2] * k.shape[2])
            return flash(q, k, v, *args, **kwargs)

        monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu",
                            counting)
    else:
        bmm = torch.bmm

        def counting(a, b):  # scores: [Hkv, rows * group, D] x [Hkv, D, keys]
            if b.shape[1] == 64:
                work.append(a.shape[0] * a.shape[1] * b.shape[2])
            return bmm(a, b)

        monkeypatch.setattr(torch, "bmm", counting)
    actual = torch_prefill_attention(query, kv_cache, block_tables, starts, seq_lens, 0.125)
    # flash computes a causal chunk's square whole; the bf16 tiles compute keys up to their last
    assert sum(work) == num_heads * sum(rows * (ctx + rows) for _, ctx, rows in specs)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual.float(), expected, atol=tolerance, rtol=tolerance)


def test_without_the_flash_op_shared_keys_join_one_masked_call() -> None:
    """The fallback for a torch without the internal flash op: a group's shared keys join each
    chunk's own (the causal offset grows to match) for one SDPA call, as if never split."""
    from agentd.kernels.prefill_cpu import _sdpa_one_call

    gen = torch.Generator().manual_seed(8)
    query = torch.randn(20, 9, 32, generator=gen)
    shared = (torch.randn(48, 3, 32, generator=gen), torch.randn(48, 3, 32, generator=gen))
    keys, values = torch.randn(25, 3, 32, generator=gen), torch.randn(25, 3, 32, generator=gen)
    all_keys, all_values = torch.cat([shared[0], keys]), torch.cat([shared[1], values])
    positions = torch.arange(53, 73)  # behind 48 + 5 cached keys
    visible = torch.arange(73)[None, :] <= positions[:, None]
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1)[None], all_keys.transpose(0, 1)[None],
        all_values.transpose(0, 1)[None], attn_mask=visible[None, None], scale=0.2,
        enable_gqa=True)[0].transpose(0, 1)
    actual = _sdpa_one_call(query, keys, values, 0.2, 5, shared)
    torch.testing.assert_close(actual, expected)


def test_a_step_plans_once_for_all_layers(monkeypatch, make_pool) -> None:
    """Inside ``attention_step`` every layer (its own pool) reuses the first layer's plan; outside
    one, a block table edited in place between calls is read afresh."""
    from agentd.kernels import attention_step, prefill_attention

    gen = torch.Generator().manual_seed(5)
    layers = [make_pool(gen, 200, 16, 3, 32, "planes") for _ in range(3)]
    block_tables, starts, seq_lens, num_tokens = build_batch(
        gen, 16, [(0, 64, 5), (0, 64, 9), (1, 20, 7)])
    query = torch.randn(num_tokens, 9, 32, generator=gen)
    plans = []
    original = prefill_attention._plan_prefill
    monkeypatch.setattr(prefill_attention, "_plan_prefill",
                        lambda *args: plans.append(1) or original(*args))
    with attention_step():
        outputs = [torch_prefill_attention(query, kv, block_tables, starts, seq_lens, 0.2)
                   for kv in layers]
    assert len(plans) == 1
    for kv, actual in zip(layers, outputs, strict=True):
        expected = reference_prefill_attention(query, kv, block_tables, starts, seq_lens, 0.2)
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    torch_prefill_attention(query, layers[0], block_tables, starts, seq_lens, 0.2)
    block_tables[2, 0] = 199 - int(block_tables[2, 0])  # another block, same shape
    actual = torch_prefill_attention(query, layers[0], block_tables, starts, seq_lens, 0.2)
    assert len(plans) == 3
    expected = reference_prefill_attention(query, layers[0], block_tables, starts, seq_lens, 0.2)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@needs_bf16_gemm
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3)])
@pytest.mark.parametrize("case", list(ALL_CASES))
@pytest.mark.parametrize("layout,consecutive", [("interleaved", False), ("planes", True)])
def test_bf16_prefill_runs_as_tiled_matmuls_and_matches_fp32(num_heads, num_kv_heads, case,
                                                             layout, consecutive, make_pool,
                                                             monkeypatch) -> None:
    """bfloat16 goes through ``matmul_attention`` (SDPA would fail here) and stays within bf16
    rounding of the fp32 reference on the same rounded inputs."""
    gen = torch.Generator().manual_seed(hash((num_heads, case, layout)) % 2**31)
    kv_cache = make_pool(gen, 200, 16, num_kv_heads, 64, layout).to(torch.bfloat16)
    block_tables, starts, seq_lens, num_tokens = build_batch(
        gen, 16, ALL_CASES[case], consecutive=consecutive, pinned=case in PINNED_CASES)
    query = torch.randn(num_tokens, num_heads, 64, generator=gen).to(torch.bfloat16)
    expected = reference_prefill_attention(query.float(), kv_cache.float(), block_tables, starts,
                                           seq_lens, 0.125)

    def no_sdpa(*args, **kwargs):
        raise AssertionError("bfloat16 must not go through SDPA on a CPU with bf16 GEMMs")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", no_sdpa)
    actual = torch_prefill_attention(query, kv_cache, block_tables, starts, seq_lens, 0.125)
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual.float(), expected, atol=2e-2, rtol=2e-2)


def test_a_chunk_behind_a_prefix_needs_no_mask(monkeypatch, make_pool) -> None:
    """fp32: a lone chunk behind cached tokens is two flash calls (the prefix unmasked, its own
    keys causally) merged by log-sum-exp, never SDPA with a [q, L] mask."""
    gen = torch.Generator().manual_seed(6)
    kv_cache = make_pool(gen, 60, 16, 3, 32, "planes")
    block_tables, starts, seq_lens, num_tokens = build_batch(gen, 16, [(0, 45, 150)],
                                                             num_blocks=60)
    query = torch.randn(num_tokens, 9, 32, generator=gen)
    expected = reference_prefill_attention(query, kv_cache, block_tables, starts, seq_lens, 0.2)
    masks = []
    original = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: masks.append(kw.get("attn_mask")) or original(*a, **kw))
    actual = torch_prefill_attention(query, kv_cache, block_tables, starts, seq_lens, 0.2)
    assert masks == []
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
