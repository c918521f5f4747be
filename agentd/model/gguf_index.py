"""Read a GGUF file's index: its scalar metadata and where each tensor's bytes lie.

Why our own reader: ``gguf.GGUFReader`` builds a memory-mapped view of every metadata item, and a
tokenizer's 49,152-entry vocab made opening the default model take ~30 s on the 2-core machine;
this one skips arrays and reads only the header (~0.1 s).
Invariant: the index says nothing the file does not (GGUF v2/v3, little-endian); an unknown value
type or a tensor type without a known block size fails with a ``ValueError`` that names it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

# Value types of GGUF metadata: struct code per scalar type; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9
# ggml tensor types: name, weights per block, bytes per block.
TENSOR_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
                6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34),
                10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
                13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 30: ("BF16", 1, 2)}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: the innermost (input) dim first
    type_name: str
    offset: int  # absolute, in bytes
    num_bytes: int


@dataclass(frozen=True)
class GgufIndex:
    fields: dict[str, Any]  # scalar and string metadata (arrays are skipped)
    tensors: list[TensorInfo]


def _read(f: BinaryIO, code: str) -> Any:
    size = struct.calcsize("<" + code)
    return struct.unpack("<" + code, f.read(size))[0]


def _string(f: BinaryIO) -> str:
    return f.read(_read(f, "Q")).decode("utf-8", errors="replace")


def _value(f: BinaryIO, value_type: int) -> Any:
    if value_type in _SCALARS:
        return _read(f, _SCALARS[value_type])
    if value_type == _STRING:
        return _string(f)
    if value_type == _ARRAY:
        item_type, count = _read(f, "I"), _read(f, "Q")
        if item_type in _SCALARS:  # skipped whole
            f.seek(count * struct.calcsize("<" + _SCALARS[item_type]), 1)
        elif item_type == _STRING:
            for _ in range(count):
                f.seek(_read(f, "Q"), 1)
        else:
            for _ in range(count):
                _value(f, item_type)
        return None
    raise ValueError(f"unknown GGUF metadata value type {value_type}")


def read_index(path: Path) -> GgufIndex:
    """The metadata and tensor table of the GGUF at ``path``."""
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, num_tensors, num_fields = _read(f, "I"), _read(f, "Q"), _read(f, "Q")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is too old (need 2 or newer)")
        fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = _string(f)
            value = _value(f, _read(f, "I"))
            if value is not None:
                fields[key] = value
        raw_tensors = []
        for _ in range(num_tensors):
            name = _string(f)
            shape = tuple(_read(f, "Q") for _ in range(_read(f, "I")))
            raw_tensors.append((name, shape, _read(f, "I"), _read(f, "Q")))
        alignment = int(fields.get("general.alignment", 32))
        data_start = -(-f.tell() // alignment) * alignment
    tensors = []
    for name, shape, type_id, offset in raw_tensors:
        if type_id not in TENSOR_TYPES:
            raise ValueError(f"{path}: tensor {name} has ggml type {type_id}, unknown here")
        type_name, block_weights, block_bytes = TENSOR_TYPES[type_id]
        count = 1
        for dim in shape:
            count *= dim
        tensors.append(TensorInfo(name, shape, type_name, data_start + offset,
                                  count // block_weights * block_bytes))
    return GgufIndex(fields, tensors)
