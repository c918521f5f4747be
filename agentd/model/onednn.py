"""CPU linear layers through oneDNN, and handing freed heap back to the OS: what makes the
model's fp32/bf16 matmuls fast on a CPU and its RSS honest, kept apart from the model's math.

Invariants: a packed layer computes ``F.linear``'s result to rounding (``packing_unsupported``
checks it on this CPU before anything is packed, and nothing is when it disagrees); a layer
whose weight another module shares keeps that weight dense; oneDNN's shape caches are bounded
before its first use.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from agentd.model.libc import libc

ONEDNN_CACHE_ENTRIES = 16  # a step's five layer shapes for three row counts
# bfloat16 attention runs as batched GEMMs over 128-row tiles (kernels.prefill_attention), two
# shapes per tile: a 2,048-token chunk's 32 shapes recur in every layer, so they must all fit, or
# every product recompiles (a 2,100-token bf16 prefill: 1.7 s with 16 entries, 1.2-1.5 s with 64).
# Costs up to ~36 MB more RSS than 16 (260 new row counts of two layer shapes: +91 vs +55 MB).
ONEDNN_CACHE_ENTRIES_BF16 = 64


def bound_onednn_caches(entries: int = ONEDNN_CACHE_ENTRIES,
                        primitive_entries: int | None = None) -> None:
    """Cap the caches in which oneDNN keeps a compiled primitive per input shape.

    Why: a daemon runs a new number of rows (tokens in the step) almost every step, and both
    caches (oneDNN's own and ideep's ``LRU_CACHE_CAPACITY``, which holds the same primitives)
    default to 1,024 entries of ~1-2 MB each here (more for more rows), so RSS only grew: +2 MB
    per new row count for two of the default model's layer shapes, +260 MB over one ``agentd
    bench``. A primitive takes ~0.3 ms to create, so a small cache costs little. Both are read
    at oneDNN's first use; values already set win. ``primitive_entries`` (default ``entries``)
    sizes oneDNN's own cache alone.
    """
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(primitive_entries or entries))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(entries))


class PackedLinear(nn.Module):
    """A CPU linear layer whose weight is reordered once into oneDNN's blocked layout.

    Why: torch's CPU ``F.linear`` goes through MKL, which on this project's AMD test machine
    runs without AVX-512; oneDNN's packed fp32 GEMM was 2-3.5x faster on the default model's
    layer shapes (all 30 layers: batch 1 25.5 -> 11.5 ms, batch 8 35.8 -> 13.6 ms, a 2,048-token
    prefill chunk 2.37 -> 0.95 s). Still true fp32 (differences from MKL are rounding-level), and
    a row's result does not depend on how many rows share the call. The dense weight is dropped,
    so memory does not grow; the layer is inference-only.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [],
                                                  "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN"


class SharedWeightLinear(nn.Module):
    """A CPU linear layer that keeps its dense weight because another module shares it (a tied
    LM head is the embedding matrix), computed by oneDNN on that dense weight: 2.6x faster than
    ``F.linear`` for the default model's head (49,152 x 576) at batch 1, 7.0 -> 2.6 ms per
    decode step. Unlike :class:`PackedLinear`, a row's result may depend on the batch size, as
    with ``F.linear``."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the shared Parameter itself
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self.weight.detach(), bias, "none", [], "")


def shared_parameter_ids(model: nn.Module) -> set[int]:
    """Ids of the parameters that a module other than a linear layer owns (a tied LM head's
    weight is the embedding's)."""
    return {id(p) for m in model.modules() if not isinstance(m, nn.Linear)
            for p in m.parameters(recurse=False)}


def packing_unsupported(dtype: torch.dtype, linear: nn.Linear | None = None) -> str | None:
    """Why oneDNN cannot pack ``dtype`` linear layers on this CPU, or None when it can: packs
    ``linear`` (a small random one by default) and checks it against ``F.linear``.

    The one probe for this path, asked by :func:`pack_linears` and by the tests. It runs the op
    rather than reading CPU flags because the op is internal to torch and its requirements are
    oneDNN's own: bfloat16 needs AVX512-BW/VL/DQ or AVX-NE-CONVERT, which oneDNN reads from the
    CPU itself, so no environment variable hides it.
    """
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    if linear is None:
        linear = nn.Linear(64, 32).to(dtype)
    try:
        with torch.no_grad():
            probe = torch.randn(3, linear.in_features, dtype=dtype)
            expected = F.linear(probe, linear.weight, linear.bias)
            got = PackedLinear(linear)(probe)
    except (RuntimeError, AttributeError, NotImplementedError) as exc:
        return f"oneDNN cannot pack {dtype} linear layers on this CPU: {exc}"
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    if not torch.allclose(got.float(), expected.float(), atol=tolerance, rtol=tolerance):
        return f"oneDNN's packed {dtype} linear disagrees with F.linear on this CPU"
    return None


def pack_linears(model: nn.Module) -> int:
    """Swap every ``nn.Linear`` of a CPU fp32/bf16 model for a :class:`PackedLinear`, after a
    self-check against ``F.linear``; returns how many were packed (0 when oneDNN is missing or
    disagrees). A linear sharing its weight with another module (a tied LM head) becomes a
    :class:`SharedWeightLinear` instead (not counted), so the shared tensor stays dense."""
    slots = [(parent, name) for parent in model.modules()
             for name, child in parent.named_children() if type(child) is nn.Linear]
    if not slots or not torch.backends.mkldnn.is_available():
        return 0
    first = getattr(*slots[0])
    bound_onednn_caches(primitive_entries=ONEDNN_CACHE_ENTRIES_BF16
                        if first.weight.dtype == torch.bfloat16 else None)
    if first.weight.device.type != "cpu" or first.weight.dtype not in (torch.float32,
                                                                       torch.bfloat16):
        return 0
    shared = shared_parameter_ids(model)
    if packing_unsupported(first.weight.dtype, first) is not None:
        return 0
    del first
    num_packed = 0
    for parent, name in slots:  # one at a time, so each dense weight is freed as it is packed
        child = getattr(parent, name)
        if id(child.weight) in shared:
            setattr(parent, name, SharedWeightLinear(child))
            continue
        setattr(parent, name, PackedLinear(child))
        del child
        num_packed += 1
    return num_packed


# mallopt's parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def reuse_large_buffers() -> bool:
    """Let glibc hand a freed large buffer to the next allocation instead of back to the OS.

    By default glibc maps every allocation of more than 32 MiB (less, before its threshold
    adapts) with its own mmap and unmaps it on free, so each of a prefill step's activations
    (2,000 tokens x 8,192 features in fp32: 65 MB) and each dequantized weight tile arrives as
    fresh pages, zeroed by the kernel one page fault at a time. A 2,000-token prefill of a 1.7B
    model took 1.36 million minor faults (5.2 GB of zeroed pages) and 25.4-25.7 s on a 2-core
    AMD EPYC; from the heap, 50-60 thousand faults and 21.9-22.2 s, peak RSS +52 MB. The heap
    is still handed back after each long step (:func:`release_free_memory`), so RSS between
    steps is unchanged. Process-wide and irreversible; returns False off glibc."""
    try:
        c = libc()
        return bool(c.mallopt(_M_MMAP_MAX, 0)) and bool(c.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):
        return False


def release_free_memory() -> None:
    """Hand freed heap memory back to the OS: glibc keeps it otherwise, ~210 MB of RSS after
    loading the default model (dense weights, reads), ~50-90 MB after a long prefill step
    (activations). Takes ~1-5 ms. A no-op off glibc."""
    try:
        libc().malloc_trim(0)
    except (OSError, AttributeError):
        pass
