"""Triton KV write against ``reference_write_kv``: the whole pool must match, slot for slot."""

from __future__ import annotations

import pytest
import torch

from agentd.kernels.kv_write import reference_write_kv, triton_write_kv

DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
]
SHAPES = [
    pytest.param(num_kv_heads, head_dim, block_size,
                 id=f"kvh{num_kv_heads}-d{head_dim}-bs{block_size}")
    for num_kv_heads in (1, 3, 8)
    for head_dim in (64, 128)
    for block_size in (16, 32)
]


def _pool(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, generator):
    shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=generator).to(dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_kv_heads", "head_dim", "block_size"), SHAPES)
def test_write_kv_matches_reference(generator, device, dtype, num_kv_heads, head_dim,
                                    block_size):
    num_blocks, num_tokens = 5, 11
    pool = _pool(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, generator)
    before = pool.clone()
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)
    key, value = key.to(dtype=dtype, device=device), value.to(dtype=dtype, device=device)
    # Distinct random slots across the pool, including a block's first and last slot.
    others = torch.randperm(num_blocks * block_size - 2, generator=generator) + 1
    others[others == block_size - 1] = num_blocks * block_size - 1
    slots = torch.cat([others[: num_tokens - 2], torch.tensor([0, block_size - 1])]).to(device)
    expected = pool.clone()
    reference_write_kv(key, value, expected, slots)

    triton_write_kv(key, value, pool, slots)

    assert torch.equal(pool, expected)
    blocks, offsets = slots // block_size, slots % block_size
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool, device=device)
    written[blocks, offsets] = True
    untouched = ~written
    assert torch.equal(pool.transpose(1, 2)[untouched], before.transpose(1, 2)[untouched])


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_write_kv_strided_inputs(generator, device, slot_dtype):
    # Keys and values are views into a fused QKV projection: rows strided, head dim contiguous.
    num_tokens, num_heads, num_kv_heads, head_dim = 6, 8, 2, 64
    fused = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim,
                        generator=generator).to(device)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    key = fused[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    value = fused[:, q_size + kv_size:].view(num_tokens, num_kv_heads, head_dim)
    pool = _pool(3, 16, num_kv_heads, head_dim, torch.float32, device, generator)
    slots = torch.tensor([47, 0, 16, 17, 5, 31], dtype=slot_dtype, device=device)
    expected = pool.clone()
    reference_write_kv(key, value, expected, slots)
    triton_write_kv(key, value, pool, slots)
    assert torch.equal(pool, expected)


def test_write_kv_skips_padding_slots(generator, device):
    # A -1 slot marks a padding token: nothing is written for it (the reference has no padding).
    pool = _pool(2, 16, 2, 64, torch.float16, device, generator)
    key = torch.randn(3, 2, 64, generator=generator).to(dtype=torch.float16, device=device)
    value = torch.randn(3, 2, 64, generator=generator).to(dtype=torch.float16, device=device)
    slots = torch.tensor([3, -1, 20], device=device)
    expected = pool.clone()
    reference_write_kv(key[[0, 2]], value[[0, 2]], expected, slots[[0, 2]])
    triton_write_kv(key, value, pool, slots)
    assert torch.equal(pool, expected)


def test_write_kv_casts_to_pool_dtype(generator, device):
    pool = _pool(2, 16, 1, 64, torch.float16, device, generator)
    key = torch.randn(2, 1, 64, generator=generator).to(device)
    value = torch.randn(2, 1, 64, generator=generator).to(device)
    slots = torch.tensor([9, 30], device=device)
    expected = pool.clone()
    reference_write_kv(key, value, expected, slots)
    triton_write_kv(key, value, pool, slots)
    assert torch.equal(pool, expected)


def test_write_kv_no_tokens(device):
    pool = torch.randn(2, 2, 16, 1, 64, device=device)
    before = pool.clone()
    empty = torch.empty(0, 1, 64, device=device)
    triton_write_kv(empty, empty, pool, torch.empty(0, dtype=torch.int64, device=device))
    assert torch.equal(pool, before)


@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        pytest.param("key", torch.randn(4, 2, 32), r"key must be \[num_tokens", id="key-shape"),
        pytest.param("value", torch.randn(4, 2, 64).double(), "float32, float16 or bfloat16",
                     id="value-float64"),
        pytest.param("kv_cache", torch.randn(3, 16, 2, 64), "5-D", id="pool-4d"),
        pytest.param("slot_mapping", torch.zeros(4), "int32 or int64", id="slots-float"),
        pytest.param("slot_mapping", torch.zeros(3, dtype=torch.int64), r"\[4, 2, 64\]",
                     id="slots-length"),
    ],
)
def test_write_kv_rejects_bad_inputs(device, name, bad, message):
    args = {
        "key": torch.randn(4, 2, 64, device=device),
        "value": torch.randn(4, 2, 64, device=device),
        "kv_cache": torch.randn(3, 2, 16, 2, 64, device=device),
        "slot_mapping": torch.arange(4, device=device),
    }
    args[name] = bad.to(device)
    with pytest.raises(ValueError, match=message):
        triton_write_kv(**args)
