"""The CPU decode path (shared prefixes read once) against the plain reference."""

from __future__ import annotations

import pytest
import torch

from agentd.kernels._common import matmul_dtype
from agentd.kernels.decode_attention import reference_decode_attention, torch_decode_attention


def build_tables(gen: torch.Generator, num_blocks: int, block_size: int, groups: list[int],
                 shared_blocks: int, consecutive: bool = False
                 ) -> tuple[list[list[int]], list[int]]:
    """Rows in groups that share ``shared_blocks`` leading blocks, each with its own tail; blocks
    handed out in a random order, or in pool order with ``consecutive``."""
    free = (list(range(num_blocks))[::-1] if consecutive
            else torch.randperm(num_blocks, generator=gen).tolist())
    tables, lens = [], []
    for group_rows in groups:
        prefix = [free.pop() for _ in range(shared_blocks)]
        for _ in range(group_rows):
            tail_len = int(torch.randint(1, 3 * block_size, (1,), generator=gen))
            tail = [free.pop() for _ in range(-(-tail_len // block_size))]
            tables.append(prefix + tail)
            lens.append(shared_blocks * block_size + tail_len)
    return tables, lens


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("groups,shared_blocks", [([1], 3), ([5], 4), ([3, 1, 4], 2), ([2], 0)])
@pytest.mark.parametrize("layout,consecutive", [("interleaved", False), ("planes", False),
                                                ("planes", True)])
def test_grouped_decode_matches_reference(num_heads, num_kv_heads, block_size, groups,
                                          shared_blocks, layout, consecutive, make_pool):
    gen = torch.Generator().manual_seed(hash((num_heads, block_size, len(groups))) % 2**31)
    head_dim = 32
    kv_cache = make_pool(gen, 80, block_size, num_kv_heads, head_dim, layout)
    tables, lens = build_tables(gen, 80, block_size, groups, shared_blocks, consecutive)
    width = max(len(t) for t in tables) + 2
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    query = torch.randn(len(lens), num_heads, head_dim, generator=gen)
    expected = reference_decode_attention(query, kv_cache, block_tables, seq_lens, 0.17)
    actual = torch_decode_attention(query, kv_cache, block_tables, seq_lens, 0.17)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_rows_whose_length_ends_on_a_shared_block_boundary():
    gen = torch.Generator().manual_seed(7)
    kv_cache = torch.randn(10, 2, 16, 2, 16, generator=gen)
    block_tables = torch.tensor([[1, 2, 3], [1, 2, 4]], dtype=torch.int32)
    seq_lens = torch.tensor([32, 40], dtype=torch.int32)  # row 0's last block is shared
    query = torch.randn(2, 4, 16, generator=gen)
    torch.testing.assert_close(
        torch_decode_attention(query, kv_cache, block_tables, seq_lens, 0.25),
        reference_decode_attention(query, kv_cache, block_tables, seq_lens, 0.25),
        atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(matmul_dtype(torch.bfloat16, torch.device("cpu")) != torch.bfloat16,
                    reason="this CPU has no bfloat16 GEMMs, so bfloat16 is widened to fp32")
@pytest.mark.parametrize("groups,shared_blocks", [([1], 3), ([3, 1, 4], 2), ([2], 0)])
def test_bf16_decode_multiplies_in_bf16_and_matches_fp32(groups, shared_blocks, make_pool,
                                                         monkeypatch):
    """Every product in bf16, no fp32 copy of the pool: widening the shared prefix every layer
    cost more than the products. Within bf16 rounding of the fp32 reference on the same inputs."""
    gen = torch.Generator().manual_seed(len(groups) * 10 + shared_blocks)
    kv_cache = make_pool(gen, 80, 16, 3, 64, "planes").to(torch.bfloat16)
    tables, lens = build_tables(gen, 80, 16, groups, shared_blocks)
    width = max(len(t) for t in tables) + 2
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    query = torch.randn(len(lens), 9, 64, generator=gen).to(torch.bfloat16)
    expected = reference_decode_attention(query.float(), kv_cache.float(), block_tables, seq_lens,
                                          0.125)
    products = []
    original_bmm, original_einsum = torch.bmm, torch.einsum

    def bmm(a, b, *args, **kwargs):
        products.append((a.dtype, b.dtype))
        return original_bmm(a, b, *args, **kwargs)

    def einsum(equation, *operands):
        products.append(tuple(op.dtype for op in operands))
        return original_einsum(equation, *operands)

    monkeypatch.setattr(torch, "bmm", bmm)
    monkeypatch.setattr(torch, "einsum", einsum)
    actual = torch_decode_attention(query, kv_cache, block_tables, seq_lens, 0.125)
    assert products and all(dtypes == (torch.bfloat16, torch.bfloat16) for dtypes in products)
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual.float(), expected, atol=2e-2, rtol=2e-2)
