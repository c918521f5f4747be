"""The CPU prefill path (chunks over a shared cached prefix in one call) against the reference."""

from __future__ import annotations

import pytest
import torch

from agentd.kernels.prefill_attention import reference_prefill_attention, torch_prefill_attention


def build_batch(gen: torch.Generator, block_size: int, specs: list[tuple[int, int, int]],
                num_blocks: int = 200, consecutive: bool = False):
    """``specs``: (group, context before the chunk, chunk length) per sequence; sequences of one
    group share their leading blocks (as many as the shortest context fills). Blocks are handed
    out in a random order, or in pool order with ``consecutive``."""
    free = (list(range(num_blocks))[::-1] if consecutive
            else torch.randperm(num_blocks, generator=gen).tolist())
    shared: dict[int, list[int]] = {}
    min_ctx: dict[int, int] = {}
    for group, ctx, _ in specs:
        min_ctx[group] = min(min_ctx.get(group, ctx), ctx)
    tables, lens, chunks = [], [], []
    for group, ctx, chunk in specs:
        if group not in shared:
            shared[group] = [free.pop() for _ in range(min_ctx[group] // block_size)]
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


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout,consecutive", [("interleaved", False), ("planes", False),
                                                ("planes", True)])
def test_grouped_prefill_matches_reference(num_heads, num_kv_heads, block_size, case, layout,
                                           consecutive, make_pool) -> None:
    gen = torch.Generator().manual_seed(hash((num_heads, block_size, case)) % 2**31)
    head_dim = 32
    kv_cache = make_pool(gen, 200, block_size, num_kv_heads, head_dim, layout)
    block_tables, starts, seq_lens, num_tokens = build_batch(gen, block_size, CASES[case],
                                                             consecutive=consecutive)
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
    assert len(calls) == 2  # keys, then values: shared blocks + every tail's blocks, one read
    assert calls == [10 + 4 * 1 + 1] * 2  # 10 shared blocks, tails of 1, 1, 1 and 2 blocks


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
