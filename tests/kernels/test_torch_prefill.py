"""The CPU prefill path (chunks over a shared cached prefix in one call) against the reference."""

from __future__ import annotations

import pytest
import torch

from agentd.kernels.prefill_attention import reference_prefill_attention, torch_prefill_attention


def build_batch(gen: torch.Generator, block_size: int, specs: list[tuple[int, int, int]],
                num_blocks: int = 200):
    """``specs``: (group, context before the chunk, chunk length) per sequence; sequences of one
    group share their leading blocks (as many as the shortest context fills)."""
    free = torch.randperm(num_blocks, generator=gen).tolist()
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
def test_grouped_prefill_matches_reference(num_heads, num_kv_heads, block_size, case) -> None:
    gen = torch.Generator().manual_seed(hash((num_heads, block_size, case)) % 2**31)
    head_dim = 32
    kv_cache = torch.randn(200, 2, block_size, num_kv_heads, head_dim, generator=gen)
    block_tables, starts, seq_lens, num_tokens = build_batch(gen, block_size, CASES[case])
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
        if self is kv_cache:
            calls.append(len(index))
        return original(self, dim, index)

    monkeypatch.setattr(torch.Tensor, "index_select", counting)
    torch_prefill_attention(query, kv_cache, block_tables, starts, seq_lens, 0.2)
    assert len(calls) == 1  # shared blocks + every tail's blocks, in one read
    assert calls[0] == 10 + 4 * 1 + 1  # 10 shared blocks, tails of 1, 1, 1 and 2 blocks
