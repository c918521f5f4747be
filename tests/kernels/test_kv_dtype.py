"""The Triton kernels over a pool narrower than the queries (fp32 activations, fp16/bf16 KV):
fp32 math over the rounded keys and values, and a write that rounds to the pool's dtype.

A few shapes only (GQA, a partial last block, a split-K decode): the full grid of
``test_decode_attention`` / ``test_prefill_attention`` runs with one dtype throughout; these
cover the mixed case the CPU runner uses with ``--kv-cache-dtype``.
"""

from __future__ import annotations

import pytest
import torch

from agentd.kernels.decode_attention import _launch_decode, reference_decode_attention
from agentd.kernels.kv_write import reference_write_kv, triton_write_kv
from agentd.kernels.prefill_attention import reference_prefill_attention, triton_prefill_attention

NARROW = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]


@pytest.mark.parametrize("kv_dtype", NARROW)
@pytest.mark.parametrize("partition_size", [512, 32], ids=["one-partition", "split-k"])
def test_decode_fp32_queries_over_a_narrow_pool(paged_kv, close, generator, device, kv_dtype,
                                                partition_size):
    seq_lens = [1, 16, 37, 70]
    paged = paged_kv(seq_lens, 16, 2, 64, kv_dtype, device, generator)
    query = torch.randn(len(seq_lens), 8, 64, generator=generator).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    expected = reference_decode_attention(query, paged.clean_kv_cache.float(),
                                          paged.block_tables, lens, 0.125)
    out = torch.full_like(query, float("nan"))
    _launch_decode(out, query, paged.kv_cache, paged.block_tables, lens, 0.125,
                   partition_size=partition_size)
    close(out, expected, torch.float32)


@pytest.mark.parametrize("kv_dtype", NARROW)
def test_prefill_fp32_queries_over_a_narrow_pool(paged_kv, close, generator, device, kv_dtype):
    chunks = [(0, 5), (16, 7), (19, 1)]  # cold, behind a full block, behind a partial one
    seq_lens = [prefix + new for prefix, new in chunks]
    paged = paged_kv(seq_lens, 16, 2, 64, kv_dtype, device, generator)
    starts = torch.tensor([0, 5, 12, 13], dtype=torch.int32, device=device)
    query = torch.randn(13, 6, 64, generator=generator).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = triton_prefill_attention(query, paged.kv_cache, paged.block_tables, starts, lens, 0.125)
    expected = reference_prefill_attention(query, paged.clean_kv_cache.float(),
                                           paged.block_tables, starts, lens, 0.125)
    assert out.dtype == torch.float32
    close(out, expected, torch.float32)


@pytest.mark.parametrize("kv_dtype", NARROW)
def test_write_rounds_fp32_keys_to_the_pool_dtype(generator, device, kv_dtype):
    pool = torch.zeros(3, 2, 16, 2, 64, dtype=kv_dtype, device=device)
    key = torch.randn(5, 2, 64, generator=generator).to(device)
    value = torch.randn(5, 2, 64, generator=generator).to(device)
    slots = torch.tensor([0, 15, 16, 33, 47], device=device)
    expected = pool.clone()
    reference_write_kv(key, value, expected, slots)
    triton_write_kv(key, value, pool, slots)
    if kv_dtype == torch.bfloat16 and device.type != "cuda":
        # Triton 3.9's interpreter truncates fp32 to bf16 (compiled kernels round to nearest
        # even, as torch does): at most one bf16 step apart, nowhere else written.
        torch.testing.assert_close(pool.float(), expected.float(), rtol=2**-7, atol=0)
        assert torch.equal(pool == 0, expected == 0)
    else:
        assert torch.equal(pool, expected)
        assert torch.equal(pool[2, 0, 1], key[3].to(kv_dtype))
