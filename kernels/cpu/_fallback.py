"""The products without the C++ extension: each ggml format dequantized by vectorized torch ops
straight into the caller's fp32 tile (in place: no fp32 temporaries, which halved the time of a
Q4_0 tile), then a dense product.

Invariant: ``dequantize_into`` equals the C++ and NumPy dequantizers bit for bit: each value is
one fp32 product of exact factors (an fp16 times small integers), plus at most one rounded
addition or subtraction, in the same order.
"""

from __future__ import annotations

import torch

from agentd.kernels.cpu.block_formats import ggml_type

_HALF_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def aligned(weight: torch.Tensor, itemsize: int) -> torch.Tensor:
    """The bytes in storage aligned to itemsize (a view of dtype needs it; mmapped rows may not
    be): the tensor itself when aligned, else a copy."""
    if weight.is_contiguous() and weight.storage_offset() % itemsize == 0:
        return weight
    return weight.clone(memory_format=torch.contiguous_format)


def _fp16(b: torch.Tensor) -> torch.Tensor:
    """The fp16 in the last axis's two bytes as float32, that axis kept (size 1)."""
    return b.contiguous().view(torch.float16).float()


def _nibbles_into(qs: torch.Tensor, out: torch.Tensor) -> None:
    """qs [..., 16] -> out [..., 2, 16] (float): low nibbles, then high ones."""
    out[..., 0, :].copy_(qs & 15)
    out[..., 1, :].copy_(qs >> 4)


def _q4(b: torch.Tensor, out: torch.Tensor, has_min: bool) -> None:
    rows, nb = b.shape[:2]
    _nibbles_into(b[..., 4 if has_min else 2:], out.view(rows, nb, 2, 16))
    o = out.view(rows, nb, 32)
    if has_min:  # w = d q + m
        o.mul_(_fp16(b[..., 0:2])).add_(_fp16(b[..., 2:4]))
    else:  # w = d (q - 8)
        o.sub_(8).mul_(_fp16(b[..., 0:2]))


def _q8_0(b: torch.Tensor, out: torch.Tensor) -> None:
    rows, nb = b.shape[:2]
    o = out.view(rows, nb, 32)
    o.copy_(b[..., 2:].contiguous().view(torch.int8))
    o.mul_(_fp16(b[..., 0:2]))


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's eight 6-bit scales and minimums from their 12 packed bytes."""
    s = s.int()
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    m = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return sc.float(), m.float()


def _q45_k(b: torch.Tensor, out: torch.Tensor, high_bits: bool) -> None:
    """w = d sc_j q - dmin m_j per 32-weight sub-block j; Q5_K's bit 4 of q from qh."""
    rows, nb = b.shape[:2]
    qs = b[..., 48:176] if high_bits else b[..., 16:144]
    pairs = out.view(rows, nb, 4, 2, 32)  # sub-blocks 2i (low nibbles), 2i + 1 (high)
    pairs[..., 0, :].copy_(qs.reshape(rows, nb, 4, 32) & 15)
    pairs[..., 1, :].copy_(qs.reshape(rows, nb, 4, 32) >> 4)
    o = out.view(rows, nb, 8, 32)
    if high_bits:  # bit j of qh[l]: bit 4 of weight l of sub-block j
        shifts = torch.arange(8, dtype=torch.uint8).view(8, 1)
        o.add_(((b[..., 16:48].unsqueeze(-2) >> shifts) & 1) << 4)
    sc, m = _k_scales(b[..., 4:16])
    o.mul_((_fp16(b[..., 0:2]) * sc).unsqueeze(-1)).sub_((_fp16(b[..., 2:4]) * m).unsqueeze(-1))


def _q6_k(b: torch.Tensor, out: torch.Tensor) -> None:
    """Per 128-weight half: quarters of 32 from ql's low/high nibbles and 2 bits of qh each,
    q - 32, times d * scale per 16 weights."""
    rows, nb = b.shape[:2]
    ql = b[..., 0:128].reshape(rows, nb, 2, 2, 32)
    o = out.view(rows, nb, 2, 4, 32)
    o[:, :, :, 0:2].copy_(ql & 15)
    o[:, :, :, 2:4].copy_(ql >> 4)
    shifts = (2 * torch.arange(4, dtype=torch.uint8)).view(4, 1)
    o.add_(((b[..., 128:192].reshape(rows, nb, 2, 1, 32) >> shifts) & 3) << 4).sub_(32)
    scales = b[..., 192:208].contiguous().view(torch.int8).reshape(rows, nb, 2, 8).float()
    d = _fp16(b[..., 208:210]).unsqueeze(-1)
    out.view(rows, nb, 2, 8, 16).mul_((d * scales).unsqueeze(-1))


_BLOCK_DEQUANT = {
    "Q4_0": lambda b, out: _q4(b, out, has_min=False),
    "Q4_1": lambda b, out: _q4(b, out, has_min=True),
    "Q8_0": _q8_0,
    "Q4_K": lambda b, out: _q45_k(b, out, high_bits=False),
    "Q5_K": lambda b, out: _q45_k(b, out, high_bits=True),
    "Q6_K": _q6_k,
}


def dequantize_into(weight: torch.Tensor, type_name: str, K: int, out: torch.Tensor) -> None:
    """uint8 rows ``[rows, row_bytes]`` -> ``out``, a contiguous float32 ``[rows, K]``."""
    rows = weight.shape[0]
    if type_name in _HALF_DTYPES:
        dtype = _HALF_DTYPES[type_name]
        out.copy_(aligned(weight, dtype.itemsize).view(dtype).reshape(rows, K))
        return
    t = ggml_type(type_name)
    _BLOCK_DEQUANT[type_name](weight.reshape(rows, K // t.block_weights, t.block_bytes), out)


def dequantize(weight: torch.Tensor, type_name: str, K: int) -> torch.Tensor:
    """uint8 rows ``[rows, row_bytes]`` -> a new float32 ``[rows, K]``."""
    out = torch.empty(weight.shape[0], K)
    dequantize_into(weight, type_name, K, out)
    return out
