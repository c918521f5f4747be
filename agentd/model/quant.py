"""Low-precision weights for CPU linear layers: integer groups, quantizers and weight-only products.

A weight format says how a linear layer's weight is stored; the activations keep the model's
dtype (``--dtype``) between layers. Every low-precision layer has two ways to multiply:
- ``kernel``: torch's weight-only product on the stored format (a GEMV-class kernel that reads
  the few bytes per weight; decode rows), with bf16 (or fp16) inputs and fp32 accumulation;
- ``dense``: a dense GEMM (prefill chunks and warm turns, where the product is compute-bound and
  the weight-only kernels fall far behind; see ``agentd.model.dispatch``), either on a resident
  fp32 twin of the weight packed for oneDNN (``--prefill-weights keep``: the fastest, costs the
  fp32 bytes again) or on the weight dequantized on the fly (``dequantize``: no second copy).
Which one a call takes depends only on its number of rows (``max_kernel_rows``, measured at load).

Invariant: ``IntGroups.dequantize()`` is the weight the layer multiplies by, up to the rounding of
the scales to the kernel's dtype (bf16 for int4 and int8), which the tests bound.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

INT4_GROUP = 32  # GGUF's Q4_0/Q4_1 block and the K-quants' sub-block
INT4_SPLIT_TILES = 2  # innerKTiles of torch's CPU int4 packing (its only value on CPU)


@dataclass
class IntGroups:
    """Unsigned 4-bit values in groups along the input dim: ``w = (q - 8) * scale + zero``
    (torch's int4 convention; GGUF's Q4_1 ``d * q + m`` is ``scale = d, zero = m + 8 d``).

    Attributes:
        values: ``[out, in]`` uint8 in 0..15.
        scales: ``[out, in // group_size]`` float32.
        zeros: ``[out, in // group_size]`` float32.
        group_size: weights per group along the input dim.
    """

    values: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int = INT4_GROUP

    def dequantize(self) -> torch.Tensor:
        out_features, in_features = self.values.shape
        q = self.values.float().reshape(out_features, -1, self.group_size) - 8
        w = q * self.scales.unsqueeze(-1) + self.zeros.unsqueeze(-1)
        return w.reshape(out_features, in_features)

    @staticmethod
    def cat(parts: list[IntGroups]) -> IntGroups:
        """Stack layers along the output dim (fused q/k/v or gate/up)."""
        return IntGroups(torch.cat([p.values for p in parts]), torch.cat([p.scales for p in parts]),
                         torch.cat([p.zeros for p in parts]), parts[0].group_size)


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP) -> IntGroups:
    """Asymmetric round-to-nearest 4-bit groups (min/max per group), for weights that come dense."""
    out_features, in_features = weight.shape
    w = weight.float().reshape(out_features, -1, group_size)
    low, high = w.amin(-1), w.amax(-1)
    scales = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    q = ((w - low.unsqueeze(-1)) / scales.unsqueeze(-1)).round_().clamp_(0, 15)
    values = q.to(torch.uint8).reshape(out_features, in_features)
    return IntGroups(values, scales, low + 8 * scales, group_size)


def int4_supported(out_features: int, in_features: int, group_size: int = INT4_GROUP) -> bool:
    """The shapes torch's CPU int4 kernel takes: whole groups, whole 64-row blocks of outputs."""
    return in_features % group_size == 0 and out_features % 64 == 0 and in_features % 2 == 0


@functools.cache
def _int4_block_rows() -> int:
    """Output rows per block of torch's CPU int4 packing, which depends on the kernel's ISA (32 on
    AVX2, 64 on AVX-512): found by packing a probe, so unpacking never assumes it."""
    probe = torch.arange(128 * 64, dtype=torch.int32).reshape(128, 64) % 16
    probe = (probe + torch.arange(128, dtype=torch.int32).unsqueeze(1)) % 16
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, INT4_SPLIT_TILES)
    for rows in (16, 32, 64, 128):
        if torch.equal(_unpack_int4(packed, rows), probe.to(torch.uint8)):
            return rows
    raise RuntimeError("unknown layout of torch's CPU int4 packing")


def _unpack_int4(packed: torch.Tensor, block_rows: int) -> torch.Tensor:
    """``[out, in/2]`` packed bytes back to ``[out, in]`` values: blocks of ``block_rows`` outputs,
    each stored ``[in, block_rows/2]`` with row ``r`` in the low nibble and ``r + block_rows/2``
    in the high one."""
    out_features, in_features = packed.shape[0], packed.shape[1] * 2
    blocks = packed.reshape(out_features // block_rows, in_features, block_rows // 2)
    values = torch.cat([blocks & 15, blocks >> 4], dim=-1)  # [blocks, in, block_rows]
    return values.transpose(1, 2).reshape(out_features, in_features)


class LowPrecisionLinear(nn.Module):
    """Base of the weight-only layers: picks ``kernel`` or ``dense`` by rows (module docstring)."""

    format_name = "?"
    kernel_name = "?"
    max_kernel_rows: int | None = None  # None: always the kernel (set by agentd.model.dispatch)
    dense_dtype = torch.float32  # dtype of the on-the-fly dense GEMM

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else bias.detach().float()
        self.dense_twin: nn.Module | None = None  # a resident dense layer (no bias) for big calls

    def keep_dense_twin(self, twin: nn.Module) -> None:
        """Multiply big calls by ``twin`` (e.g. a oneDNN-packed fp32 copy) instead of
        dequantizing per call."""
        self.dense_twin = twin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.max_kernel_rows is None or x.shape[0] <= self.max_kernel_rows:
            out = self.kernel(x)
        else:
            out = self.dense(x)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a dense ``[out, in]`` tensor of ``dtype`` (made per call, not kept)."""
        raise NotImplementedError

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense_twin is not None:
            return self.dense_twin(x)
        dtype = self.dense_dtype
        return F.linear(x.to(dtype), self.dense_weight(dtype)).to(x.dtype)

    def weight_bytes(self) -> int:
        """Bytes of the low-precision weight (the dense twin not counted)."""
        return sum(t.numel() * t.element_size() for t in self._buffers.values() if t is not None)

    def extra_repr(self) -> str:
        rows = "all rows" if self.max_kernel_rows is None else f"<= {self.max_kernel_rows} rows"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{self.format_name}: {self.kernel_name} for {rows}"
                f"{', dense twin kept' if self.dense_twin is not None else ''}")


class Int4Linear(LowPrecisionLinear):
    """int4 groups through ``_weight_int4pack_mm_for_cpu`` (bf16 inputs, scales and zeros)."""

    format_name = "int4"
    kernel_name = "int4pack_mm(bf16)"

    def __init__(self, groups: IntGroups, bias: torch.Tensor | None = None) -> None:
        out_features, in_features = groups.values.shape
        super().__init__(in_features, out_features, bias)
        self.group_size = groups.group_size
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            groups.values.to(torch.int32), INT4_SPLIT_TILES), persistent=False)
        scales_zeros = torch.stack([groups.scales.t(), groups.zeros.t()], dim=-1)
        self.register_buffer("scales_zeros", scales_zeros.to(torch.bfloat16).contiguous(),
                             persistent=False)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed, self.group_size, self.scales_zeros)
        return out.to(x.dtype)

    def groups(self) -> IntGroups:
        """What the layer holds, as :class:`IntGroups` (scales and zeros as rounded to bf16)."""
        values = _unpack_int4(self.packed, _int4_block_rows())
        scales, zeros = self.scales_zeros.float().unbind(-1)
        return IntGroups(values, scales.t().contiguous(), zeros.t().contiguous(), self.group_size)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized as ``[in, out]`` and returned transposed (a view): the packing's blocks
        are laid out along the input dim, and the scales broadcast along the contiguous output
        dim, so every pass is a plain vectorized one (8 -> 32 ms a 3,072 x 576 layer the other
        way round)."""
        block_rows = _int4_block_rows()
        blocks = self.packed.reshape(self.out_features // block_rows, self.in_features,
                                     block_rows // 2).transpose(0, 1)
        out = torch.empty(self.in_features, self.out_features // block_rows, block_rows,
                          dtype=dtype)
        out[..., :block_rows // 2] = blocks & 15
        out[..., block_rows // 2:] = blocks >> 4
        scales, zeros = self.scales_zeros.to(dtype).unbind(-1)  # [groups, out]
        w_t = out.view(-1, self.group_size, self.out_features)
        w_t.mul_(scales.unsqueeze(1)).add_((zeros - 8 * scales).unsqueeze(1))
        return w_t.view(self.in_features, self.out_features).t()


class Int8Linear(LowPrecisionLinear):
    """int8 per output channel through ``_weight_int8pack_mm`` (bf16 inputs and scales)."""

    format_name = "int8"
    kernel_name = "int8pack_mm(bf16)"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias)
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        values = (w / scales.unsqueeze(1)).round_().clamp_(-127, 127).to(torch.int8)
        self.register_buffer("values", values, persistent=False)
        self.register_buffer("scales", scales.to(torch.bfloat16), persistent=False)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.values,
                                                  self.scales).to(x.dtype)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return self.values.to(dtype) * self.scales.to(dtype).unsqueeze(1)


class HalfLinear(LowPrecisionLinear):
    """bf16 or fp16 weights: ``F.linear`` in that dtype (torch's reduced-precision GEMV with fp32
    accumulation for one row), or oneDNN's packed bf16 GEMM where the CPU has bf16 GEMMs."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, onednn: bool,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias)
        self.dtype = dtype
        self.format_name = str(dtype).removeprefix("torch.")
        w = weight.detach().to(dtype)
        self.onednn = onednn and dtype == torch.bfloat16
        if self.onednn:
            w = torch.ops.mkldnn._reorder_linear_weight(w)
        self.kernel_name = "onednn(bf16)" if self.onednn else f"F.linear({self.format_name})"
        self.register_buffer("weight", w, persistent=False)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.weight, None, "none",
                                                      [], "").to(x.dtype)
        return F.linear(x.to(self.dtype), self.weight).to(x.dtype)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.onednn:  # the packed layout is oneDNN's own; its dense twin is the kernel itself
            raise RuntimeError("a oneDNN-packed bf16 layer has no dense weight")
        return self.weight.to(dtype)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x) if self.onednn and self.dense_twin is None else super().dense(x)


def make_linear(weights: str, weight: torch.Tensor | IntGroups, bias: torch.Tensor | None,
                bf16_gemm: bool) -> LowPrecisionLinear | None:
    """The layer of format ``weights`` for a dense weight or int4 groups; ``None`` when the kernel
    does not take this shape (the caller keeps the layer as it is)."""
    if isinstance(weight, IntGroups):
        groups = weight
        if weights == "int4":
            out_features, in_features = groups.values.shape
            if int4_supported(out_features, in_features, groups.group_size):
                return Int4Linear(groups, bias)
            return None
        weight = groups.dequantize()
    if weights == "int4":
        if not int4_supported(*weight.shape):
            return None
        return Int4Linear(quantize_int4(weight), bias)
    if weights == "int8":
        return Int8Linear(weight, bias)
    if weights in ("bfloat16", "float16"):
        return HalfLinear(weight, getattr(torch, weights), bf16_gemm, bias)
    raise ValueError(f"unknown weight format {weights!r}")
