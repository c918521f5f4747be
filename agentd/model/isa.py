"""What this CPU's kernels can use: the instruction sets torch and oneDNN will run with.

Invariant: the report describes the kernels' effective ISA, not only the silicon: a capability
capped by ``ATEN_CPU_CAPABILITY`` (torch's own kernels) or ``ONEDNN_MAX_CPU_ISA`` (oneDNN's) is
reported capped, so an AVX-512 machine measuring the AVX2 path says AVX2.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

import torch

# oneDNN's ISA names, weakest first, for reading ONEDNN_MAX_CPU_ISA.
_ONEDNN_ORDER = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                 "AVX512_CORE_VNNI", "AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16",
                 "AVX10_1_512_AMX", "AVX512_CORE_AMX", "AVX10_1_512_AMX_FP16",
                 "AVX512_CORE_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2", "DEFAULT")


@dataclass(frozen=True)
class CpuIsa:
    """Attributes:
        cpu_flags: the silicon's relevant flags (``/proc/cpuinfo``), e.g. ``avx2 avx512_bf16``.
        torch_capability: torch's kernel level (``AVX2``, ``AVX512``, ...).
        bf16_gemm: oneDNN runs bf16 GEMMs natively (AVX512-BF16 or AMX) under its ISA cap.
        amx: AMX tiles present and not capped away.
        name: one word for logs and tables: ``AVX2``, ``AVX512``, ``AVX512-BF16`` or ``AMX``.
    """

    cpu_flags: tuple[str, ...]
    torch_capability: str
    bf16_gemm: bool
    amx: bool
    name: str

    def describe(self) -> str:
        flags = " ".join(self.cpu_flags) or "none"
        return (f"{self.name} (torch kernels {self.torch_capability}, oneDNN bf16 GEMM "
                f"{'yes' if self.bf16_gemm else 'no'}; CPU flags: {flags})")


_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
          "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def _cpu_flags() -> tuple[str, ...]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    present = set(line.split(":", 1)[1].split())
                    return tuple(flag for flag in _FLAGS if flag in present)
    except OSError:
        pass
    return ()


def _onednn_cap_allows(level: str) -> bool:
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "DEFAULT"))
    cap = cap.upper()
    if cap not in _ONEDNN_ORDER:
        return True
    return _ONEDNN_ORDER.index(cap) >= _ONEDNN_ORDER.index(level)


@functools.cache
def detect_isa() -> CpuIsa:
    """The effective ISA of this process (cached: the caps are read once, at oneDNN's start)."""
    flags = _cpu_flags() if platform.system() == "Linux" else ()
    capability = torch.backends.cpu.get_cpu_capability()
    try:
        bf16_gemm = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        bf16_gemm = False
    amx = "amx_bf16" in flags and _onednn_cap_allows("AVX512_CORE_AMX")
    if capability.startswith("AVX512"):
        name = "AMX" if amx else "AVX512-BF16" if bf16_gemm else "AVX512"
    else:
        name = capability
    return CpuIsa(flags, capability, bf16_gemm, amx, name)
