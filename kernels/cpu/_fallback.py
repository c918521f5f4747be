"""The products without the C++ extension: each ggml format dequantized by vectorized torch ops
(one pass over the blocks, threaded by torch), then a dense fp32 product.

Invariant: ``dequantize`` equals the C++ and NumPy dequantizers bit for bit (each value is one
fp32 product of exact factors, plus at most one rounded subtraction or addition).
"""

from __future__ import annotations

import torch

from agentd.kernels.cpu.formats import ggml_type


def aligned(weight: torch.Tensor, itemsize: int) -> torch.Tensor:
    """The bytes in storage aligned to itemsize (a view of dtype needs it; mmapped rows may not
    be): the tensor itself when aligned, else a copy."""
    if weight.is_contiguous() and weight.storage_offset() % itemsize == 0:
        return weight
    return weight.clone(memory_format=torch.contiguous_format)


def _fp16(b: torch.Tensor) -> torch.Tensor:
    """The fp16 in the last axis's two bytes as float32, that axis kept (size 1)."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _fp16(b[..., 0:2]) * (_nibbles(b[..., 2:]).float() - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _fp16(b[..., 0:2]) * _nibbles(b[..., 4:]).float() + _fp16(b[..., 2:4])


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _fp16(b[..., 0:2]) * b[..., 2:].contiguous().view(torch.int8).float()


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = s.int()
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    m = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return sc.float(), m.float()


def _q45_k(b: torch.Tensor, qh: torch.Tensor | None, qs: torch.Tensor) -> torch.Tensor:
    d, dmin = _fp16(b[..., 0:2]), _fp16(b[..., 2:4])
    sc, m = _k_scales(b[..., 4:16])
    pairs = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    q = torch.cat([pairs & 15, pairs >> 4], dim=-2).reshape(*qs.shape[:-1], 8, 32)
    if qh is not None:
        shifts = torch.arange(8, dtype=torch.uint8).view(8, 1)
        q = q | (((qh.unsqueeze(-2) >> shifts) & 1) << 4)
    w = (d * sc).unsqueeze(-1) * q.float() - (dmin * m).unsqueeze(-1)
    return w.flatten(-2)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    lead = b.shape[:-1]
    ql = b[..., 0:128].reshape(*lead, 2, 2, 32)
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32)
    scales = b[..., 192:208].contiguous().view(torch.int8).reshape(*lead, 2, 8, 1).float()
    d = _fp16(b[..., 208:210]).unsqueeze(-1).unsqueeze(-1)
    low = torch.cat([ql & 15, ql >> 4], dim=-2)
    high = (qh >> (2 * torch.arange(4, dtype=torch.uint8)).view(4, 1)) & 3
    y = (low | (high << 4)).reshape(*lead, 2, 8, 16).float() - 32
    return ((d * scales) * y).reshape(*lead, 256)


_BLOCK_DEQUANT = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q6_K": _q6_k,
    "Q4_K": lambda b: _q45_k(b, None, b[..., 16:144]),
    "Q5_K": lambda b: _q45_k(b, b[..., 16:48], b[..., 48:176]),
}


def dequantize(weight: torch.Tensor, type_name: str, K: int) -> torch.Tensor:
    """uint8 rows ``[rows, row_bytes]`` -> float32 ``[rows, K]``."""
    rows = weight.shape[0]
    if type_name in ("F32", "F16", "BF16"):
        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[type_name]
        halves = aligned(weight, 4 if type_name == "F32" else 2).view(dtype)
        return halves.to(torch.float32, copy=True).reshape(rows, K)
    t = ggml_type(type_name)
    blocks = weight.reshape(rows, K // t.block_weights, t.block_bytes)
    return _BLOCK_DEQUANT[type_name](blocks).reshape(rows, K)
