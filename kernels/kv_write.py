"""KV write: scatter a step's new keys and values into their slots of the paged pool.

Pool layout (one tensor per layer): ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``;
index 0 of dim 1 holds keys, index 1 values. Slot ``s`` is block ``s // block_size``, offset
``s % block_size``. Invariant: only the slots named in ``slot_mapping`` are written.
"""

from __future__ import annotations

import torch

from agentd.kernels import kv_quant
from agentd.kernels._common import check_float, check_index, check_kv_cache, jit, next_pow2, tl


def reference_write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Torch reference (and CPU path): ``kv_cache[slot] = (key, value)`` for every token."""
    block_size = kv_cache.shape[2]
    block_ids = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    kv_cache[block_ids, 0, offsets] = kv_quant.store(key, kv_cache.dtype)
    kv_cache[block_ids, 1, offsets] = kv_quant.store(value, kv_cache.dtype)


@jit
def _write_kv_kernel(
    key_ptr, value_ptr, kv_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kvb, stride_kvkv, stride_kvt, stride_kvh,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # a -1 slot marks a padding token (e.g. a padded CUDA-graph batch): write nothing
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    key = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :],
                  mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :],
                    mask=mask)
    dst = (kv_ptr + (slot // BLOCK_SIZE) * stride_kvb + (slot % BLOCK_SIZE) * stride_kvt
           + heads[:, None] * stride_kvh + dims[None, :])
    elem_ty = kv_ptr.dtype.element_ty
    tl.store(dst, key.to(elem_ty), mask=mask)
    tl.store(dst + stride_kvkv, value.to(elem_ty), mask=mask)


def _launch_write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Grid ``(num_tokens,)``: each program copies all KV heads of one token's key and value."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    _write_kv_kernel[(key.shape[0],)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=next_pow2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=next_pow2(head_dim), BLOCK_SIZE=kv_cache.shape[2],
        num_warps=4,
    )


def triton_write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton scatter with the contract of :func:`reference_write_kv`.

    ``key``/``value`` may be strided views (e.g. slices of a fused QKV projection) as long as the
    head dim is contiguous. A negative slot is skipped (padding); every other slot must be
    ``< num_blocks * block_size`` and appear at most once.
    """
    check_float("write_kv", "key", key, 3)
    check_float("write_kv", "value", value, 3)
    check_kv_cache("write_kv", kv_cache, key.device)
    check_index("write_kv", "slot_mapping", slot_mapping, 1, key.device)
    expected = [slot_mapping.shape[0], *kv_cache.shape[3:]]
    for name, tensor in (("key", key), ("value", value)):
        if list(tensor.shape) != expected:
            raise ValueError(f"write_kv: {name} must be [num_tokens, num_kv_heads, head_dim] = "
                             f"{expected}, got {list(tensor.shape)}")
        if tensor.device != key.device:
            raise ValueError(f"write_kv: {name} is on {tensor.device}, expected {key.device}")
    if key.shape[0] > 0:
        _launch_write_kv(key, value, kv_cache, slot_mapping)
