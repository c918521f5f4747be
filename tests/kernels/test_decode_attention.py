"""Triton paged decode against ``reference_decode_attention``."""

from __future__ import annotations

import pytest
import torch

from agentd.kernels.decode_attention import (
    _launch_decode,
    reference_decode_attention,
    triton_decode_attention,
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


def _seq_lens(block_size: int) -> list[int]:
    # A lone token, exactly one block, a partial second block, a full-block boundary, a partial
    # third block.
    return [1, block_size, block_size + 5, 2 * block_size, 3 * block_size - 1]


def _run(paged_kv, generator, device, dtype, seq_lens, group_size, head_dim, block_size,
         partition_size=None):
    num_kv_heads = 1 if group_size == 8 else 2
    paged = paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, device, generator)
    query = torch.randn(len(seq_lens), num_kv_heads * group_size, head_dim, generator=generator)
    query = query.to(dtype=dtype, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    expected = reference_decode_attention(query.float(), paged.clean_kv_cache.float(),
                                          paged.block_tables, lens, scale)
    out = torch.full_like(query, float("nan"))  # poisoned: an unwritten element fails the test
    kwargs = {} if partition_size is None else {"partition_size": partition_size}
    _launch_decode(out, query, paged.kv_cache, paged.block_tables, lens, scale, **kwargs)
    return out, expected


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("group_size", "head_dim", "block_size"), SHAPES)
def test_decode_matches_reference(paged_kv, close, generator, device, dtype, group_size,
                                  head_dim, block_size):
    out, expected = _run(paged_kv, generator, device, dtype, _seq_lens(block_size), group_size,
                         head_dim, block_size)
    close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("group_size", "head_dim", "block_size"),
    [
        pytest.param(4, 64, 16, id="gqa4-d64-bs16"),
        pytest.param(3, 128, 32, id="gqa3-d128-bs32"),
        pytest.param(2, 96, 8, id="gqa2-d96-bs8"),  # a padded head dim and the smallest block
    ],
)
def test_decode_split_k_matches_reference(paged_kv, close, generator, device, dtype, group_size,
                                          head_dim, block_size):
    # Partitions of 64 tokens: 300 tokens span 5 of them, 128 ends exactly on a boundary, 65
    # spills one token into a second, and 1 leaves every later partition of its row empty.
    out, expected = _run(paged_kv, generator, device, dtype, [300, 1, 128, 65], group_size,
                         head_dim, block_size, partition_size=64)
    close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_public_wrapper_long_context(paged_kv, close, generator, device, dtype):
    # The default partition (512 tokens) over 1100 tokens: three partitions through the public API.
    seq_lens = [1100, 7, 512]
    paged = paged_kv(seq_lens, 16, 1, 64, dtype, device, generator)
    query = torch.randn(3, 4, 64, generator=generator).to(dtype=dtype, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = triton_decode_attention(query, paged.kv_cache, paged.block_tables, lens, 0.125)
    expected = reference_decode_attention(query.float(), paged.clean_kv_cache.float(),
                                          paged.block_tables, lens, 0.125)
    assert out.shape == query.shape and out.dtype == dtype
    close(out, expected, dtype)


def test_decode_strided_query_and_int64_indices(paged_kv, close, generator, device):
    # The query is a view into a fused projection (row stride > heads * head_dim).
    seq_lens = [20, 33]
    paged = paged_kv(seq_lens, 16, 2, 64, torch.float32, device, generator)
    fused = torch.randn(2, 12 * 64, generator=generator).to(device)
    query = fused[:, : 4 * 64].view(2, 4, 64)
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    tables = paged.block_tables.long()
    out = triton_decode_attention(query, paged.kv_cache, tables, lens, 0.125)
    close(out, reference_decode_attention(query, paged.clean_kv_cache, tables, lens, 0.125),
          torch.float32)


def test_decode_empty_batch(device):
    query = torch.randn(0, 4, 64, device=device)
    kv_cache = torch.randn(2, 2, 16, 1, 64, device=device)
    out = triton_decode_attention(query, kv_cache, torch.zeros(0, 1, dtype=torch.int32,
                                  device=device), torch.zeros(0, dtype=torch.int32,
                                  device=device), 0.125)
    assert out.shape == (0, 4, 64)


def _valid_args(device):
    return {
        "query": torch.randn(2, 4, 64, device=device),
        "kv_cache": torch.randn(4, 2, 16, 2, 64, device=device),
        "block_tables": torch.zeros(2, 2, dtype=torch.int32, device=device),
        "seq_lens": torch.ones(2, dtype=torch.int32, device=device),
        "scale": 0.125,
    }


@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        pytest.param("query", torch.randn(2, 4, 64).double(), "float32, float16 or bfloat16",
                     id="query-float64"),
        pytest.param("query", torch.randn(2, 64, 4).transpose(1, 2), "contiguous",
                     id="query-strided-head-dim"),
        pytest.param("query", torch.randn(2, 3, 64), "multiple of num_kv_heads", id="gqa-mismatch"),
        pytest.param("query", torch.randn(2, 4, 32), "head_dim", id="head-dim-mismatch"),
        pytest.param("kv_cache", torch.randn(4, 3, 16, 2, 64), "dim 1 must be 2", id="pool-shape"),
        pytest.param("block_tables", torch.zeros(2, 2), "int32 or int64", id="table-float"),
        pytest.param("seq_lens", torch.ones(3, dtype=torch.int32), "seq_lens", id="lens-length"),
    ],
)
def test_decode_rejects_bad_inputs(device, name, bad, message):
    args = _valid_args(device)
    args[name] = bad.to(device)
    with pytest.raises(ValueError, match=message):
        triton_decode_attention(**args)
