"""A GGUF's bytes, memory-mapped read-only, with its checked index.

``GgufFile`` maps the file once; the served model (``gguf_model``) and the fp32 conversion
(``gguf_convert``) read their tensors from that mapping. The header is read by
:mod:`agentd.model.gguf_header` and held to the file by :mod:`agentd.model.gguf_check` before the
file is mapped.
Invariant: every view handed out lies inside the mapping: the tensor table was checked against
the file's size, and a view of the wrong shape or type for its caller is a one-line
``ModelLoadError`` that names the tensor.
"""

from __future__ import annotations

import mmap
import os
import warnings
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from agentd.kernels import cpu as ggml
from agentd.model.gguf_check import REQUANTIZE_HINT, read_checked
from agentd.model.gguf_header import GgufIndex, TensorInfo
from agentd.model.load_errors import ModelLoadError

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
    def open(cls, path: Path, kernel_types: Collection[str] | None = None) -> GgufFile:
        """Read and check the header (``gguf_check.check_header``, with ``kernel_types``: the
        block types the caller multiplies), then map the file."""
        index = read_checked(path, kernel_types)
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
