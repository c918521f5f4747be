"""Shared pieces of the Triton kernels: the optional import and the wrappers' input checks.

Invariant: importing this module never fails without Triton, so the torch references (which
live beside the kernels) stay importable on a plain CPU install; ``triton_backend`` is the one
import that requires Triton.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is an optional extra
    triton = None
    tl = None

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


class _LazyJit:
    """Defers ``triton.jit`` to the first launch, so ``TRITON_INTERPRET`` is read then and not
    at import (whoever imported the references first cannot fix the mode by accident)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._kernel: Any = None

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        if self._kernel is None:
            self._kernel = triton.jit(self.fn)
        return self._kernel[grid]


def jit(fn: Callable[..., Any]) -> _LazyJit:
    """``triton.jit``, applied at the first launch; importable without Triton."""
    return _LazyJit(fn)


def dot_dtype(dtype: torch.dtype) -> Any:
    """The ``tl`` dtype that a kernel feeds ``tl.dot`` for inputs of ``dtype``.

    Triton 3.9's interpreter multiplies bfloat16 operands as their raw uint16 bits, so under
    ``TRITON_INTERPRET`` bfloat16 dots are widened to fp32; compiled kernels keep bfloat16.
    """
    if dtype == torch.bfloat16:
        return tl.float32 if triton.knobs.runtime.interpret else tl.bfloat16
    return tl.float16 if dtype == torch.float16 else tl.float32


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def check_float(op: str, name: str, tensor: torch.Tensor, ndim: int) -> None:
    if tensor.dim() != ndim:
        raise ValueError(f"{op}: {name} must be {ndim}-D, got shape {list(tensor.shape)}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: {name} must be float32, float16 or bfloat16, got {tensor.dtype}")
    if tensor.numel() > 0 and tensor.stride(-1) != 1:
        raise ValueError(f"{op}: {name} must be contiguous in its last dim, strides "
                         f"{tensor.stride()}")


def check_index(op: str, name: str, tensor: torch.Tensor, ndim: int,
                device: torch.device) -> None:
    if tensor.dim() != ndim:
        raise ValueError(f"{op}: {name} must be {ndim}-D, got shape {list(tensor.shape)}")
    if tensor.dtype not in INDEX_DTYPES:
        raise ValueError(f"{op}: {name} must be int32 or int64, got {tensor.dtype}")
    if tensor.device != device:
        raise ValueError(f"{op}: {name} is on {tensor.device}, expected {device}")
    if tensor.numel() > 0 and tensor.stride(-1) != 1:
        raise ValueError(f"{op}: {name} must be contiguous in its last dim, strides "
                         f"{tensor.stride()}")


def check_kv_cache(op: str, kv_cache: torch.Tensor, device: torch.device) -> None:
    """The pool: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` on ``device``."""
    check_float(op, "kv_cache", kv_cache, 5)
    if kv_cache.shape[1] != 2:
        raise ValueError(f"{op}: kv_cache dim 1 must be 2 (keys, values), got "
                         f"{list(kv_cache.shape)}")
    if kv_cache.device != device:
        raise ValueError(f"{op}: kv_cache is on {kv_cache.device}, expected {device}")
    check_runnable(op, device)


def check_attention_inputs(op: str, query: torch.Tensor, kv_cache: torch.Tensor,
                           block_tables: torch.Tensor) -> None:
    """Query ``[*, H, D]`` against the pool's head dim and GQA grouping; ``block_tables``."""
    check_float(op, "query", query, 3)
    check_kv_cache(op, kv_cache, query.device)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    if kv_cache.shape[4] != head_dim:
        raise ValueError(f"{op}: query head_dim {head_dim} != kv_cache head_dim "
                         f"{kv_cache.shape[4]}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"{op}: num_heads {num_heads} is not a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    if head_dim < 16:
        raise ValueError(f"{op}: head_dim must be >= 16, got {head_dim}")
    check_index(op, "block_tables", block_tables, 2, query.device)


def check_runnable(op: str, device: torch.device) -> None:
    if triton is None:
        raise ValueError(f"{op}: triton is not installed; use the torch backend")
    if device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise ValueError(f"{op}: Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 to "
                         f"run them on {device.type}); got {device}")
