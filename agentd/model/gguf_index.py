"""Read a GGUF file's index: its scalar metadata and where each tensor's bytes lie.

Why our own reader: ``gguf.GGUFReader`` builds a memory-mapped view of every metadata item, and a
tokenizer's 49,152-entry vocab made opening the default model take ~30 s on the 2-core machine;
this one skips arrays and reads only the header (~0.1 s). ``GgufFile`` adds the file's bytes,
mapped read-only, that the served model (``gguf_model``) and the fp32 conversion
(``gguf_convert``) read their tensors from.
Invariant: the index says nothing the file does not (GGUF v2/v3, little-endian); an unknown value
type or a tensor type without a known block size fails with a ``ValueError`` that names it.
"""

from __future__ import annotations

import mmap
import os
import struct
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from agentd.kernels import cpu as ggml
from agentd.model.load_errors import ModelLoadError

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


REQUANTIZE_HINT = ("re-quantize to Q4_K_M/Q8_0 with llama-quantize, or pass --weights float32 to "
                   "convert")
_FLOAT_TYPES = {"F32": np.float32, "F16": np.float16}


def lock_memory(address: int, length: int) -> str | None:
    """``mlock(address, length)``; None on success, else the error and what to do about it."""
    import ctypes
    import errno
    import resource

    from agentd.model.libc import libc

    try:
        failed = libc().mlock(ctypes.c_void_p(address), ctypes.c_size_t(length)) != 0
    except (OSError, AttributeError) as exc:  # no C library, or no mlock in it
        return f"mlock is not available here ({exc})"
    if not failed:
        return None
    code = ctypes.get_errno()
    limit = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    shown = "unlimited" if limit == resource.RLIM_INFINITY else f"{limit / 2**20:.0f} MiB"
    return (f"mlock of {length / 2**20:.0f} MiB failed ({errno.errorcode.get(code, code)}: "
            f"{os.strerror(code)}); the locked-memory limit is {shown}: raise it (`ulimit -l "
            "unlimited` in the shell that starts agentd, LimitMEMLOCK=infinity in a systemd "
            "unit) or start without --mlock")


@dataclass(frozen=True)
class GgufFile:
    """A GGUF's index and its bytes, mapped read-only.

    Attributes:
        data: uint8 ``[file bytes]`` over the mapping; weights are views of it.
    """

    path: Path
    index: GgufIndex
    tensors: dict[str, TensorInfo]
    data: torch.Tensor

    @classmethod
    def open(cls, path: Path) -> GgufFile:
        try:
            index = read_index(path)
        except ValueError as exc:  # a tensor type the index does not know (IQ*, TQ*, ...)
            raise ModelLoadError(f"{exc}; {REQUANTIZE_HINT}") from exc
        with path.open("rb") as f:
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        with warnings.catch_warnings():  # read-only on purpose: nothing writes a weight
            warnings.filterwarnings("ignore", message=".*not writable.*")
            data = torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8))
        return cls(path, index, {t.name: t for t in index.tensors}, data)

    def lock(self) -> str | None:
        """Lock the mapping in RAM (``mlock``: every page read in now and never paged out);
        None on success, else why not (the error and what to do)."""
        start, end = self.address_range()
        return lock_memory(start, end - start)

    def address_range(self) -> tuple[int, int]:
        """``[start, end)`` of the mapping in this process's address space."""
        start = self.data.data_ptr()
        return start, start + self.data.numel()

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise ModelLoadError(f"{self.path.name} has no tensor {name}; pass a complete GGUF of "
                                 "a supported architecture")
        return self.tensors[name]

    def rows(self, name: str, out_features: int, in_features: int) -> tuple[torch.Tensor, str]:
        """A weight's blocks as ``uint8 [out_features, row_bytes]`` (a view) and their format."""
        info = self.info(name)
        if info.shape != (in_features, out_features):
            raise ModelLoadError(f"{self.path.name}: tensor {name} has ggml shape {info.shape}, "
                                 f"expected {(in_features, out_features)} from the header")
        kind = ggml.GGML_TYPES.get(info.type_name)
        if kind is None or in_features % kind.block_weights:
            raise ModelLoadError(f"{self.path.name}: tensor {name} is {info.type_name}, which "
                                 f"--weights gguf does not serve; {REQUANTIZE_HINT}")
        raw = self.data[info.offset:info.offset + info.num_bytes]
        return raw.view(out_features, -1), info.type_name

    def floats(self, name: str, numel: int) -> torch.Tensor:
        """A small F32/F16 tensor (a norm weight, a bias) copied out as float32."""
        info = self.info(name)
        count = int(np.prod(info.shape))
        if info.type_name not in _FLOAT_TYPES or count != numel:
            raise ModelLoadError(f"{self.path.name}: tensor {name} is {info.type_name} "
                                 f"{info.shape}, expected F32 of {numel} values")
        dtype = _FLOAT_TYPES[info.type_name]
        raw = self.data[info.offset:info.offset + info.num_bytes].numpy()
        return torch.from_numpy(raw.view(dtype).astype(np.float32))

    def type_counts(self) -> str:
        """``"Q4_K x 169, Q6_K x 25, F32 x 49"``: the file's tensor types, most common first."""
        counts = Counter(t.type_name for t in self.index.tensors)
        return ", ".join(f"{name} x {n}" for name, n in counts.most_common())
