"""Triton varlen causal paged prefill against ``reference_prefill_attention``."""

from __future__ import annotations

import pytest
import torch

from agentd.kernels.prefill_attention import (
    _launch_prefill,
    reference_prefill_attention,
    triton_prefill_attention,
)

DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
]
# Every value of each axis is in CI's four shapes; the whole grid (16, each a Triton run of seconds
# in the CPU interpreter) is -m full's.
CI_SHAPES = {(1, 64, 16), (3, 128, 32), (4, 64, 32), (8, 128, 16)}
SHAPES = [
    pytest.param(group_size, head_dim, block_size, id=f"gqa{group_size}-d{head_dim}-bs{block_size}",
                 marks=() if (group_size, head_dim, block_size) in CI_SHAPES else pytest.mark.full)
    for group_size in (1, 3, 4, 8)
    for head_dim in (64, 128)
    for block_size in (16, 32)
]


def _chunks(block_size: int) -> list[tuple[int, int]]:
    """``(cached prefix, new tokens)`` per sequence."""
    return [
        (0, 5),  # a fresh prompt inside one partial block
        (block_size, 7),  # the prefix ends exactly on a block boundary
        (block_size + 3, 1),  # a one-token chunk behind a partial block
        (5, 2 * block_size - 5),  # the chunk ends exactly on a block boundary
    ]


def _run(paged_kv, generator, device, dtype, chunks, group_size, head_dim, block_size):
    num_kv_heads = 1 if group_size == 8 else 2
    seq_lens = [prefix + new for prefix, new in chunks]
    paged = paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, device, generator)
    starts = [0]
    for _, new in chunks:
        starts.append(starts[-1] + new)
    query = torch.randn(starts[-1], num_kv_heads * group_size, head_dim, generator=generator)
    query = query.to(dtype=dtype, device=device)
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    expected = reference_prefill_attention(query.float(), paged.clean_kv_cache.float(),
                                           paged.block_tables, query_start_loc, lens, scale)
    out = torch.full_like(query, float("nan"))  # poisoned: an unwritten row fails the test
    _launch_prefill(out, query, paged.kv_cache, paged.block_tables, query_start_loc, lens, scale)
    return out, expected


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("group_size", "head_dim", "block_size"), SHAPES)
def test_prefill_matches_reference(paged_kv, close, generator, device, dtype, group_size,
                                   head_dim, block_size):
    out, expected = _run(paged_kv, generator, device, dtype, _chunks(block_size), group_size,
                         head_dim, block_size)
    close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "block_size"), [
    pytest.param(64, 16, id="d64-bs16"),
    pytest.param(96, 8, id="d96-bs8"),  # a padded head dim and the smallest block
])
def test_prefill_chunk_spans_several_query_tiles(paged_kv, close, generator, device, dtype,
                                                 head_dim, block_size):
    # 150 new rows are three BLOCK_M=64 tiles; a second sequence is short, so most of its
    # programs exit; the prefix (37) leaves a partial block before the chunk.
    out, expected = _run(paged_kv, generator, device, dtype, [(37, 150), (0, 3)], 4, head_dim,
                         block_size)
    close(out, expected, dtype)


def test_prefill_public_wrapper_with_empty_chunk(paged_kv, close, generator, device):
    # The middle sequence schedules no tokens this step; its neighbours must be unaffected.
    chunks = [(3, 20), (40, 0), (0, 9)]
    seq_lens = [prefix + new for prefix, new in chunks]
    paged = paged_kv(seq_lens, 16, 2, 64, torch.float16, device, generator)
    query = torch.randn(29, 4, 64, generator=generator).to(dtype=torch.float16, device=device)
    query_start_loc = torch.tensor([0, 20, 20, 29], dtype=torch.int64, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    out = triton_prefill_attention(query, paged.kv_cache, paged.block_tables, query_start_loc,
                                   lens, 0.125)
    expected = reference_prefill_attention(query.float(), paged.clean_kv_cache.float(),
                                           paged.block_tables, query_start_loc, lens, 0.125)
    assert out.shape == query.shape and out.dtype == torch.float16
    close(out, expected, torch.float16)


def test_prefill_strided_query(paged_kv, close, generator, device):
    # The query is a view into a fused QKV projection (row stride > heads * head_dim).
    paged = paged_kv([30], 16, 1, 64, torch.float32, device, generator)
    fused = torch.randn(12, 6 * 64, generator=generator).to(device)
    query = fused[:, : 4 * 64].view(12, 4, 64)
    query_start_loc = torch.tensor([0, 12], dtype=torch.int32, device=device)
    lens = torch.tensor([30], dtype=torch.int32, device=device)
    out = triton_prefill_attention(query, paged.kv_cache, paged.block_tables, query_start_loc,
                                   lens, 0.125)
    close(out, reference_prefill_attention(query, paged.clean_kv_cache, paged.block_tables,
                                           query_start_loc, lens, 0.125), torch.float32)


@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        pytest.param("query", torch.randn(5, 4, 64).double(), "float32, float16 or bfloat16",
                     id="query-float64"),
        pytest.param("query", torch.randn(5, 6, 64), "multiple of num_kv_heads",
                     id="gqa-mismatch"),
        pytest.param("query_start_loc", torch.tensor([0, 5], dtype=torch.int32),
                     "query_start_loc", id="starts-length"),
        pytest.param("seq_lens", torch.tensor([5.0, 1.0]), "int32 or int64", id="lens-float"),
        pytest.param("kv_cache", torch.randn(4, 2, 16, 4, 64).transpose(3, 4), "contiguous",
                     id="pool-strided-head-dim"),
    ],
)
def test_prefill_rejects_bad_inputs(device, name, bad, message):
    args = {
        "query": torch.randn(5, 4, 64, device=device),
        "kv_cache": torch.randn(4, 2, 16, 4, 64, device=device),
        "block_tables": torch.zeros(2, 2, dtype=torch.int32, device=device),
        "query_start_loc": torch.tensor([0, 2, 5], dtype=torch.int32, device=device),
        "seq_lens": torch.tensor([2, 3], dtype=torch.int32, device=device),
        "scale": 0.125,
    }
    args[name] = bad.to(device)
    with pytest.raises(ValueError, match=message):
        triton_prefill_attention(**args)
