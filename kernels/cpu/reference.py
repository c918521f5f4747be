"""NumPy references for the CPU kernels: ggml block dequantization written from the layout
comments of ``ggml_blocks.h``, the int8 activation quantizer, and the exact product.

Invariant: ``dequantize`` equals ``gguf.quants.dequantize`` bit for bit on every block whose
fp16 fields are finite (tests check it), and ``quantize_act`` produces the same bytes as every
ISA's C++ quantizer (the same fp32 operations: absmax / 127, x * (1 / d), round half to even).
"""

from __future__ import annotations

import numpy as np

from agentd.kernels.cpu.block_formats import ACT_BLOCK, ACT_Q8_32, ACT_Q8_256, ggml_type, row_bytes

ACT_DTYPES = {
    ACT_Q8_32: np.dtype([("d", "<f4"), ("s", "<f4"), ("qs", "i1", (32,))]),
    ACT_Q8_256: np.dtype([("d", "<f4"), ("qs", "i1", (256,)), ("bsums", "<i2", (16,))]),
}


def _fp16(b: np.ndarray) -> np.ndarray:
    """The fp16 stored in the last axis's two bytes, as float32 (that axis dropped)."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """A 32-weight block's values: the low nibbles are weights 0..15, the high ones 16..31."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float32)


def _q4_0(b: np.ndarray) -> np.ndarray:
    return _fp16(b[..., 0:2])[..., None] * (_nibbles(b[..., 2:]) - 8)


def _q4_1(b: np.ndarray) -> np.ndarray:
    return _fp16(b[..., 0:2])[..., None] * _nibbles(b[..., 4:]) + _fp16(b[..., 2:4])[..., None]


def _q8_0(b: np.ndarray) -> np.ndarray:
    return _fp16(b[..., 0:2])[..., None] * b[..., 2:].view(np.int8).astype(np.float32)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's eight 6-bit scales and minimums from their 12 packed bytes."""
    s = s.astype(np.int32)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return sc.astype(np.float32), m.astype(np.float32)


def _q45_k(b: np.ndarray, qh: np.ndarray | None, qs: np.ndarray) -> np.ndarray:
    d, dmin = _fp16(b[..., 0:2])[..., None], _fp16(b[..., 2:4])[..., None]
    sc, m = _k_scales(b[..., 4:16])
    pairs = qs.reshape(*qs.shape[:-1], 4, 1, 32)  # sub-blocks 2i (low nibble), 2i + 1 (high)
    q = np.concatenate([pairs & 15, pairs >> 4], axis=-2).reshape(*qs.shape[:-1], 8, 32)
    q = q.astype(np.int32)
    if qh is not None:  # bit j of qh[l]: bit 4 of weight l of sub-block j
        q |= ((qh[..., None, :].astype(np.int32) >> np.arange(8)[:, None]) & 1) << 4
    w = (d * sc)[..., None] * q.astype(np.float32) - (dmin * m)[..., None]
    return w.reshape(*w.shape[:-2], 256)


def _q4_k(b: np.ndarray) -> np.ndarray:
    return _q45_k(b, None, b[..., 16:144])


def _q5_k(b: np.ndarray) -> np.ndarray:
    return _q45_k(b, b[..., 16:48], b[..., 48:176])


def _q6_k(b: np.ndarray) -> np.ndarray:
    lead = b.shape[:-1]
    ql = b[..., 0:128].reshape(*lead, 2, 2, 32).astype(np.int32)  # half, which 32, l
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32).astype(np.int32)
    scales = b[..., 192:208].view(np.int8).reshape(*lead, 2, 8).astype(np.float32)
    d = _fp16(b[..., 208:210])[..., None, None, None]
    low = np.concatenate([ql & 15, ql >> 4], axis=-2)  # quarters 0..3 of each half
    high = (qh >> (2 * np.arange(4))[:, None]) & 3
    y = (low | (high << 4)).reshape(*lead, 2, 8, 16).astype(np.float32) - 32
    return ((d * scales[..., None]) * y).reshape(*lead, 256)


_BLOCK_DEQUANT = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q5_K": _q5_k,
                  "Q6_K": _q6_k}


# Byte offsets of each block type's fp16 fields (scales, minimums).
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
               "Q6_K": (208,)}


def random_blocks(rng: np.random.Generator, type_name: str, rows: int, K: int,
                  wild: bool = False) -> np.ndarray:
    """Valid uint8 rows ``[rows, row_bytes]``: random bytes whose fp16 scale fields are finite.
    ``wild``: any finite fp16 (subnormals to 65504); else realistic scales around 0.01. F16,
    BF16 and F32 rows are normal samples (times 0.05)."""
    if type_name in ("F32", "F16", "BF16"):
        w = rng.standard_normal((rows, K)).astype(np.float32) * np.float32(0.05)
        if type_name == "F32":
            return w.view(np.uint8)
        if type_name == "F16":
            return w.astype(np.float16).view(np.uint8)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    t = ggml_type(type_name)
    raw = rng.integers(0, 256, (rows, K // t.block_weights, t.block_bytes), dtype=np.uint8)
    for off in FP16_FIELDS[type_name]:
        if wild:
            bits = rng.integers(0, 0x7C00, raw.shape[:2], dtype=np.uint16)  # exponent < 31
            bits |= rng.integers(0, 2, raw.shape[:2], dtype=np.uint16) << 15
            field = bits.view(np.float16)
        else:
            field = (rng.uniform(0.5, 1.5, raw.shape[:2]) * 0.01).astype(np.float16)
        raw[..., off:off + 2] = field[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def dequantize(weight: np.ndarray, type_name: str, K: int) -> np.ndarray:
    """uint8 rows ``[rows, row_bytes]`` of a ggml type -> float32 ``[rows, K]``."""
    raw = np.ascontiguousarray(weight, dtype=np.uint8).reshape(-1, row_bytes(type_name, K))
    if type_name in ("F32", "F16"):
        return raw.view("<f4" if type_name == "F32" else "<f2").astype(np.float32)
    if type_name == "BF16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    t = ggml_type(type_name)
    blocks = raw.reshape(raw.shape[0], K // t.block_weights, t.block_bytes)
    return _BLOCK_DEQUANT[type_name](blocks).reshape(raw.shape[0], K).astype(np.float32)


def quantize_act(x: np.ndarray, kind: int) -> np.ndarray:
    """float32 ``[n, K]`` -> activation blocks ``[n, K / block]`` (a structured array whose
    bytes are the C++ layout): per block d = absmax / 127, qs = round-half-even(x * (1 / d))."""
    qk = ACT_BLOCK[kind]
    xb = np.asarray(x, dtype=np.float32).reshape(x.shape[0], -1, qk)
    a = np.abs(xb)
    non_finite = ~np.all(a < np.inf, axis=-1)
    amax = np.where(non_finite[..., None], 0, a).max(axis=-1)
    with np.errstate(divide="ignore"):
        d = np.where(amax < 1e-30, np.float32(0), amax / np.float32(127)).astype(np.float32)
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    d = np.where(non_finite, np.float32(np.nan), d)
    inv = np.where(non_finite, np.float32(0), inv)
    with np.errstate(invalid="ignore"):
        q = np.rint(xb * inv[..., None])
    qs = np.where(inv[..., None] == 0, 0, q).astype(np.int8)
    out = np.zeros(xb.shape[:2], ACT_DTYPES[kind])
    out["d"], out["qs"] = d, qs
    if kind == ACT_Q8_32:
        out["s"] = d * qs.astype(np.int32).sum(-1).astype(np.float32)
    else:
        out["bsums"] = qs.reshape(*qs.shape[:2], 16, 16).astype(np.int32).sum(-1)
    return out


def dequantize_act(blocks: np.ndarray) -> np.ndarray:
    """Activation blocks ``[n, nb]`` -> the float32 ``[n, K]`` a product multiplies (d * qs)."""
    x = blocks["d"][..., None] * blocks["qs"].astype(np.float32)
    return x.reshape(blocks.shape[0], -1)


def reference_linear(x: np.ndarray, weight: np.ndarray, type_name: str) -> np.ndarray:
    """``x @ dequantize(weight).T`` in float64: the exact product of fp32 activations."""
    x = np.asarray(x, dtype=np.float64)
    return x @ dequantize(weight, type_name, x.shape[1]).astype(np.float64).T
