"""The q8_0 KV pool (``--kv-cache-dtype q8_0``, agentd.kernels.kv_quant): the quantizer's bytes,
the C++ KV write giving the same bytes as the torch reference, and every attention path (the
C++ decode and prefill kernels on each ISA this CPU runs, torch's) over q8_0 bytes equal to
fp32 attention over the dequantized keys and values; slots a kernel must not read hold a NaN
scale, so a read of one shows."""

from __future__ import annotations

import pytest
import torch

from agentd.kernels import kv_quant
from agentd.kernels.cpu import fused
from agentd.kernels.decode_attention import reference_decode_attention, torch_decode_attention
from agentd.kernels.prefill_attention import reference_prefill_attention, torch_prefill_attention

NAN_SCALE = torch.tensor([float("nan")], dtype=torch.float16).view(torch.int8)  # 2 bytes


def q8_pool(gen: torch.Generator, num_blocks: int, block_size: int, num_kv_heads: int,
            head_dim: int) -> torch.Tensor:
    """Random keys and values quantized, in the runner's layout (all keys, then all values)."""
    planes = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen) * 2
    return kv_quant.quantize_q8_0(planes).transpose(0, 1)


def poisoned(pool: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """A copy of ``pool`` whose every slot outside the sequences' contexts has NaN scales."""
    out = pool.clone()
    blocks = out.view(*out.shape[:-1], -1, kv_quant.Q8_BYTES)
    blocks[..., :2] = NAN_SCALE
    block_size = pool.shape[2]
    for table, length in zip(tables.tolist(), lens.tolist(), strict=True):
        for slot in range(length):
            block, offset = table[slot // block_size], slot % block_size
            out[block, :, offset] = pool[block, :, offset]
    return out


def test_quantize_q8_0_holds_each_value_within_half_a_step() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 96, generator=gen) * torch.logspace(-3, 3, 7)[:, None, None]
    x[0, 0, :32] = 0.0  # a block of zeros
    x[1, 1, 5] = -50.0  # a block whose largest value is negative
    q = kv_quant.quantize_q8_0(x)
    assert q.dtype == torch.int8 and q.shape == (7, 3, 3 * 34)
    blocks = q.view(7, 3, 3, 34)
    d = blocks[..., :2].contiguous().view(torch.float16).float()
    values = blocks[..., 2:].float()
    groups = x.view(7, 3, 3, 32)
    assert torch.equal(d, (groups.abs().amax(-1, keepdim=True) / 127).half().float())
    assert values.abs().max() <= 127
    assert torch.equal(values[0, 0, 0], torch.zeros(32)) and d[0, 0, 0] == 0
    assert values[1, 1, 0, 5] == -127
    back = kv_quant.dequantize_q8_0(q)
    assert torch.all((back - x).abs() <= d.repeat_interleave(32, -1).view_as(x) * 0.5 + 1e-7)
    assert kv_quant.row_width(128, torch.int8) == 136 and kv_quant.head_dim_of(q) == 96
    with pytest.raises(ValueError, match="divisible by 32"):
        kv_quant.row_width(80, torch.int8)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_write_kv_writes_the_references_q8_0_bytes(interleaved, isa, generator) -> None:
    tokens, num_heads, num_kv_heads, head_dim, block_size = 9, 4, 2, 64, 16
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=generator) * 3
    qkv[2, q_size:q_size + 32] = 0.0  # a key block of zeros
    angles = torch.rand(tokens, head_dim // 2, generator=generator) * 6.0
    slots = torch.tensor([3, 17, 18, 40, 63, 0, 1, 2, 30])
    pools = []
    for impl in (fused.rope_write_kv, fused.reference_rope_write_kv):
        x = qkv.clone()
        q, k, v = (part.reshape(tokens, -1, head_dim)
                   for part in x.split([q_size, kv_size, kv_size], dim=-1))
        pool = torch.full((2, 4, block_size, num_kv_heads, 68), 7, dtype=torch.int8)
        impl(q, k, v, angles.cos(), angles.sin(), interleaved, pool.transpose(0, 1), slots)
        pools.append(pool)
    assert torch.equal(pools[0], pools[1])
    by_slot = pools[0].permute(1, 2, 0, 3, 4).reshape(4 * block_size, -1)
    untouched = torch.ones(4 * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert (by_slot[untouched] == 7).all() and not (by_slot[slots] == 7).all(dim=-1).any()


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"),
                         [(4, 4, 64), (8, 2, 128), (6, 1, 96), (4, 4, 96),  # 96: chunk + tail
                          (8, 1, 64), (10, 2, 64), (12, 2, 64), (6, 2, 64)])  # G = 8, 5, 6, 3
@pytest.mark.parametrize("rows_share", [False, True])
def test_decode_over_a_q8_pool_is_fp32_attention_over_the_dequantized_kv(
        num_heads, num_kv_heads, head_dim, rows_share, isa, generator) -> None:
    block_size = 16
    pool = q8_pool(generator, 64, block_size, num_kv_heads, head_dim)
    order = torch.randperm(64, generator=generator).tolist()
    lens = [1, 16, 19, 79, 200]
    tables = []
    for length in lens:  # rows_share: every row starts on the same 1 block (agents on a prompt)
        own = [order.pop() for _ in range(-(-length // block_size))]
        tables.append(([tables[0][0]] + own[1:]) if rows_share and tables else own)
    width = max(map(len, tables)) + 1
    tables = torch.tensor([t + [order[0]] * (width - len(t)) for t in tables], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    query = torch.randn(len(lens), num_heads, head_dim, generator=generator)
    expected = reference_decode_attention(query, kv_quant.dequantize_q8_0(pool), tables,
                                          seq_lens, 0.2)
    # the torch path may read a partial block's unused slots (masked after): its pool is clean
    actual = fused.decode_attention(query, pool if isa == "torch" else
                                    poisoned(pool, tables, seq_lens), tables, seq_lens, 0.2)
    assert not actual.isnan().any(), "a NaN (unused) slot of the pool was read"
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)
    grouped = torch_decode_attention(query, pool, tables, seq_lens, 0.2)
    torch.testing.assert_close(grouped, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"),
                         [(4, 4, 64), (9, 3, 64), (8, 1, 128)])
def test_prefill_over_a_q8_pool_is_fp32_attention_over_the_dequantized_kv(
        num_heads, num_kv_heads, head_dim, isa, generator) -> None:
    block_size = 16
    rows, cached = [150, 1, 37, 64], [0, 290, 63, 129]
    pool = q8_pool(generator, 96, block_size, num_kv_heads, head_dim)
    order = torch.randperm(96, generator=generator).tolist()
    lens = [r + c for r, c in zip(rows, cached, strict=True)]
    tables = [[order.pop() for _ in range(-(-length // block_size))] for length in lens]
    width = max(map(len, tables))
    tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    query = torch.randn(sum(rows), num_heads, head_dim, generator=generator)
    expected = reference_prefill_attention(query, kv_quant.dequantize_q8_0(pool), tables, starts,
                                           seq_lens, 0.125)
    actual = fused.prefill_attention(query, pool if isa == "torch" else
                                     poisoned(pool, tables, seq_lens), tables, starts, seq_lens,
                                     0.125, bf16=False)
    assert not actual.isnan().any(), "a NaN (unused) slot of the pool was read"
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)
    grouped = torch_prefill_attention(query, pool, tables, starts, seq_lens, 0.125)
    torch.testing.assert_close(grouped, expected, atol=2e-5, rtol=2e-5)


def test_prefill_in_bfloat16_products_over_a_q8_pool_stays_near_the_fp32_reference(
        generator) -> None:
    from agentd.kernels import cpu

    if cpu.active_isa() != "avx512_vnni" or not cpu._native().module.has_bf16_attention():
        pytest.skip("this CPU has no AVX512-BF16: prefill attention's products stay fp32")
    pool = q8_pool(generator, 128, 16, 2, 64)
    tables = torch.randperm(128, generator=generator)[:80].view(1, 80).int()
    starts = torch.tensor([0, 300], dtype=torch.int32)
    seq_lens = torch.tensor([1200], dtype=torch.int32)
    query = torch.randn(300, 8, 64, generator=generator)
    expected = reference_prefill_attention(query, kv_quant.dequantize_q8_0(pool), tables, starts,
                                           seq_lens, 0.125)
    actual = fused.prefill_attention(query, poisoned(pool, tables, seq_lens), tables, starts,
                                     seq_lens, 0.125, bf16=True)
    error = (actual - expected).abs()
    assert error.max() < 0.05 and error.mean() < 4e-3, (error.max(), error.mean())
