"""The ggml block formats agentd multiplies in place, and the int8 activation blocks they take.

Invariant: these numbers are the GGUF file format's (and ``ggml_blocks.h``'s static_asserts), so
``row_bytes`` of a tensor's input dim is exactly the stride of its rows in the file.
"""

from __future__ import annotations

from typing import NamedTuple


class GgmlType(NamedTuple):
    type_id: int  # as written in a GGUF tensor table
    block_weights: int
    block_bytes: int


GGML_TYPES: dict[str, GgmlType] = {
    "F32": GgmlType(0, 1, 4),
    "F16": GgmlType(1, 1, 2),
    "Q4_0": GgmlType(2, 32, 18),
    "Q4_1": GgmlType(3, 32, 20),
    "Q8_0": GgmlType(8, 32, 34),
    "Q4_K": GgmlType(12, 256, 144),
    "Q5_K": GgmlType(13, 256, 176),
    "Q6_K": GgmlType(14, 256, 210),
    "BF16": GgmlType(30, 1, 2),
}

# The activation format each product quantizes its inputs into (ggml_blocks.h: ActQ8_32 is
# {f32 d, f32 s, i8 qs[32]}, ActQ8_256 {f32 d, i8 qs[256], i16 bsums[16]}); None: fp32 rows.
ACT_Q8_32, ACT_Q8_256 = 1, 2
ACT_BLOCK = {ACT_Q8_32: 32, ACT_Q8_256: 256}
ACT_KIND: dict[str, int | None] = {
    "F32": None, "F16": None, "BF16": None, "Q4_0": ACT_Q8_32, "Q4_1": ACT_Q8_32,
    "Q8_0": ACT_Q8_32, "Q4_K": ACT_Q8_256, "Q5_K": ACT_Q8_256, "Q6_K": ACT_Q8_256,
}


def ggml_type(type_name: str) -> GgmlType:
    try:
        return GGML_TYPES[type_name]
    except KeyError:
        raise ValueError(f"unsupported ggml type {type_name!r}; the CPU kernels take "
                         f"{', '.join(GGML_TYPES)}") from None


def row_bytes(type_name: str, K: int) -> int:
    """Bytes of one row of K weights; K must be a whole number of blocks."""
    t = ggml_type(type_name)
    if K % t.block_weights:
        raise ValueError(f"{type_name} rows hold whole blocks of {t.block_weights} weights, "
                         f"got K = {K}")
    return K // t.block_weights * t.block_bytes
