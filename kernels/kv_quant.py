"""The q8_0 KV pool: each head row of ``D`` values stored as ``D / 32`` blocks of 34 bytes, an
fp16 scale ``d`` then 32 int8 ``q`` (value = d * q), llama.cpp's ``block_q8_0`` layout. The pool
tensor is ``int8`` with a last dimension of ``D / 32 * 34`` bytes; ``torch.int8`` stands for
q8_0 wherever a KV dtype is named (no other pool is int8).

Quantizing a block: ``d = max|x| / 127`` rounded to fp16, ``q = round_half_even(x / d)``
(``x * (1 / d)`` in fp32) clamped to [-127, 127]; a block of zeros has ``d = 0``, ``q = 0``. The
C++ store (``ops_convert.h``) gives the same bytes, and a dequantized value (an fp16 times a
small integer) is exact in fp32, so every reader widens the same numbers.

Invariant: the torch functions here are the reference the kernels are tested against.
"""

from __future__ import annotations

import torch

Q8_GROUP = 32  # values per block
Q8_BYTES = 34  # bytes per block: fp16 scale + 32 int8
Q8_DTYPE = torch.int8  # the pool's storage dtype that stands for q8_0


def is_q8(kv: torch.Tensor | torch.dtype) -> bool:
    dtype = kv if isinstance(kv, torch.dtype) else kv.dtype
    return dtype == Q8_DTYPE


def dtype_name(dtype: torch.dtype) -> str:
    """A pool dtype's name as ``--kv-cache-dtype`` spells it."""
    return "q8_0" if is_q8(dtype) else str(dtype).removeprefix("torch.")


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """The pool's last dimension for head rows of ``head_dim`` values in ``dtype``."""
    if not is_q8(dtype):
        return head_dim
    if head_dim % Q8_GROUP:
        raise ValueError(f"a q8_0 KV cache needs a head size divisible by {Q8_GROUP}, "
                         f"this model's is {head_dim}")
    return head_dim // Q8_GROUP * Q8_BYTES


def head_dim_of(kv_cache: torch.Tensor) -> int:
    """The head size a pool holds (its last dimension, or the values its q8_0 bytes hold)."""
    width = kv_cache.shape[-1]
    return width // Q8_BYTES * Q8_GROUP if is_q8(kv_cache) else width


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` (float) as q8_0 bytes ``[..., D / 32 * 34]`` (int8)."""
    *lead, width = x.shape
    groups = x.float().reshape(*lead, width // Q8_GROUP, Q8_GROUP)
    d = (groups.abs().amax(-1, keepdim=True) / 127).half()
    df = d.float()
    inv = torch.where(df > 0, 1.0 / df, torch.zeros_like(df))
    q = torch.round(groups * inv).clamp_(-127, 127).to(torch.int8)
    out = torch.cat([d.view(torch.int8), q], dim=-1)  # [..., nb, 34]: 2 scale bytes, 32 values
    return out.reshape(*lead, width // Q8_GROUP * Q8_BYTES)


def dequantize_q8_0(b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q8_0 bytes ``[..., D / 32 * 34]`` (int8) as ``[..., D]`` in ``dtype``."""
    *lead, width = b.shape
    blocks = b.reshape(*lead, width // Q8_BYTES, Q8_BYTES)
    d = blocks[..., :2].contiguous().view(torch.float16).float()
    out = blocks[..., 2:].float() * d
    return out.reshape(*lead, width // Q8_BYTES * Q8_GROUP).to(dtype)


def widen(kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pool rows (any dtype, q8_0 bytes included) as ``dtype`` values."""
    return dequantize_q8_0(kv, dtype) if is_q8(kv) else kv.to(dtype)


def store(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Head rows of values as the pool stores them in ``dtype`` (rounded, or quantized)."""
    return quantize_q8_0(values) if is_q8(dtype) else values.to(dtype)
