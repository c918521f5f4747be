"""Shared pieces of the Triton kernels: the deferred import and the wrappers' input checks.

Invariant: importing this module never imports Triton, so the torch references and CPU paths
(which live beside the kernels) load without it: on a plain CPU install, and without the ~70 MB
of RSS that importing Triton costs a CPU daemon. Triton is imported at the first launch or check
(:func:`load_triton`); ``triton_backend`` is the one import that requires it up front.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from agentd.kernels import kv_quant

# The real modules once load_triton() ran; the kernel modules import these names, and each
# kernel's module gets them at its first launch (Triton resolves a kernel's globals when it
# compiles it).
triton: Any = None
tl: Any = None
_TRITON_MISSING = False


def load_triton() -> Any:
    """Import Triton on first use; ``None`` when it is not installed."""
    global triton, tl, _TRITON_MISSING
    if triton is None and not _TRITON_MISSING:
        try:
            import triton as triton_module
            import triton.language as tl_module
        except ImportError:  # pragma: no cover - triton is an optional extra
            _TRITON_MISSING = True
            return None
        triton, tl = triton_module, tl_module
    return triton


def cdiv(a: int, b: int) -> int:
    return -(-a // b)

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
            load_triton()
            self.fn.__globals__.update(triton=triton, tl=tl)
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
    load_triton()
    if dtype == torch.bfloat16:
        return tl.float32 if triton.knobs.runtime.interpret else tl.bfloat16
    return tl.float16 if dtype == torch.float16 else tl.float32


_T = TypeVar("_T")
_step = threading.local()


@contextmanager
def attention_step() -> Iterator[None]:
    """The scope of one forward pass, inside which the metadata tensors do not change.

    Every layer calls attention with the same block tables and lengths. Inside a step the CPU
    paths turn them into their plan (Python lists, block runs, masks) on the first layer and
    reuse it for the others; outside one, each call builds its own.
    """
    _step.plans = {}
    try:
        yield
    finally:
        _step.plans = None


def step_plan(kind: str, tensors: tuple[torch.Tensor, ...], build: Callable[[], _T]) -> _T:
    """``build()``, or inside :func:`attention_step` the plan built for these same tensors.

    The entry keeps the tensors alive, so their ids cannot be reused by others in the step.
    """
    plans = getattr(_step, "plans", None)
    if plans is None:
        return build()
    key = (kind, *(id(t) for t in tensors))
    entry = plans.get(key)
    if entry is None:
        entry = plans[key] = (build(), tensors)
    return entry[0]


def block_run(block_ids: list[int], device: torch.device) -> slice | torch.Tensor:
    """Blocks as a slice of the pool when they are consecutive (read in place), else an index."""
    if block_ids and all(b - a == 1 for a, b in itertools.pairwise(block_ids)):
        return slice(block_ids[0], block_ids[-1] + 1)
    return torch.tensor(block_ids, dtype=torch.long, device=device)


def take_blocks(kv_cache: torch.Tensor, which: int, blocks: slice | torch.Tensor) -> torch.Tensor:
    """Keys (``which=0``) or values (1) of ``blocks``, token after token: ``[n * B, Hkv, D]``.

    The runner's pool keeps all keys before all values, so consecutive blocks are a view; a
    q8_0 pool's come out dequantized to fp32.
    """
    plane = kv_cache[:, which]
    part = plane[blocks] if isinstance(blocks, slice) else plane.index_select(0, blocks)
    if kv_quant.is_q8(part):  # q8_0 bytes: dequantized (the torch paths' reference, not fast)
        part = kv_quant.dequantize_q8_0(part)
    return part.reshape(-1, kv_cache.shape[3], part.shape[-1])


def matmul_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the CPU attention paths multiply in: bfloat16 inputs stay bfloat16 where oneDNN
    has bfloat16 GEMMs (AVX512-BF16 or AMX), else everything is widened to fp32.

    Why: on such CPUs a bfloat16 ``torch.bmm`` runs on oneDNN at 4-5x the fp32 rate (measured on
    this project's 2-core AMD EPYC: 556 vs 123 GFLOP/s for a decode-sized score product), while
    SDPA's bfloat16 CPU kernel is no faster than fp32.
    """
    if dtype == torch.bfloat16 and device.type == "cpu" and _bf16_gemm():
        return torch.bfloat16
    return torch.float32


def heads_first(tokens: torch.Tensor) -> torch.Tensor:
    """``[L, Hkv, D]`` as ``[Hkv, L, D]``: a view in fp32 (MKL reads the pool's interleaved
    heads in place), a contiguous copy otherwise (oneDNN's bf16 products over interleaved heads
    ran 3x slower: 0.17 vs 0.05 ms for 27 rows over 2,100 keys, the copy 0.01 ms)."""
    heads = tokens.transpose(0, 1)
    return heads if tokens.dtype == torch.float32 else heads.contiguous()


@functools.cache
def _bf16_gemm() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # pragma: no cover - a torch without oneDNN
        return False


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
    if load_triton() is None:
        raise ValueError(f"{op}: triton is not installed; use the torch backend")
    if device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise ValueError(f"{op}: Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 to "
                         f"run them on {device.type}); got {device}")
