"""Products of float32 activations with GGUF weights kept in their block formats, on the CPU.

A call quantizes its activation rows once into the type's int8 blocks (absmax per block; fp32
rows for F16/BF16), then threads over output rows with integer dot products and one multiply by
the two scales per block (``kernels/cpu/*.cpp``, AVX2+FMA or AVX-512-VNNI by cpuid, scalar
otherwise). Large batches (prefill) instead dequantize tiles of rows into one reused buffer and
multiply them with oneDNN's GEMM, in bfloat16 where the CPU has bfloat16 GEMMs (AVX512-BF16,
AMX: ~2.3x the fp32 rate) and in fp32 elsewhere, except the K-quants on CPUs without them,
whose int8 kernels beat the fp32 GEMM (see ``prefill_on_tiles``). Without a compiler, or for a
type whose kernels did not compile, the same API runs on torch ops (dequantize tiles, then a
dense product), slower but equal up to the activations' int8 rounding.

Invariant: no fp32 copy of a whole quantized weight is ever made by a product (at most one
tile of rows at a time); ``AGENTD_CPU_ISA=avx2|scalar|torch`` and ``set_isa`` only ever
lower the path.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from dataclasses import dataclass
from types import ModuleType

import torch

from agentd.kernels._common import matmul_dtype
from agentd.kernels.cpu import _build, _fallback
from agentd.kernels.cpu.block_formats import GGML_TYPES, GgmlType, row_bytes

__all__ = ["GGML_TYPES", "GgmlType", "active_isa", "available_isas", "build", "dequantize",
           "get_rows", "linear", "linear_multi", "native_available", "native_unavailable_reason",
           "prefill_on_tiles", "set_isa"]

logger = logging.getLogger(__name__)

ISAS = ("scalar", "avx2", "avx512_vnni")  # the order of dispatch.h's Isa enum
ISA_ENV = "AGENTD_CPU_ISA"
# The prefill path dequantizes at most TILE_BYTES of fp32 rows at a time (1,024 rows of
# K = 2,048; 128 of K = 14,336) into one buffer reused across the tiles of a call; dequantizing
# costs ~1% of the GEMM (a whole 8192 x 2048 Q4_K weight: 11 ms against 2.3-2.8 s of GEMM at
# n = 2,048), so tiles only need to be wide enough for the GEMM to run at full rate.
TILE_BYTES = 8 << 20
# From this many activation rows on, dequantized tiles + a dense GEMM beat the int8 kernels,
# whose cost grows with every row. Measured on the 2-core AVX2 host (shared with other jobs, so
# the GEMM ran at ~half its quiet rate), 2048 x 2048, best of 25, ms int8 / tiles: Q4_K n=48
# 20.5/29.9, n=64 25.5/43.2, n=96 32.0/24.1; Q6_K n=64 28.2/21.5; Q8_0 n=64 30.3/45.2, n=96
# 38.5/44.6; Q4_0 (column kernels) n=96 26.6/32.2. Quiet, the GEMM runs ~60 GFLOP/s (2x), which
# moves the crossover down: 64.
TILE_MIN_BATCH = 64


K_QUANTS = frozenset({"Q4_K", "Q5_K", "Q6_K"})


@functools.cache
def bf16_tiles() -> bool:
    """Whether prefill tiles multiply in bfloat16: where oneDNN has bfloat16 GEMMs (it reports
    none under ``ONEDNN_MAX_CPU_ISA=AVX2``). Measured on a 2-core AMD EPYC (Zen 4), one thread,
    [512, 2048] x [2048, 8192]: 193 GFLOP/s in bfloat16 against 85 in fp32."""
    return matmul_dtype(torch.bfloat16, torch.device("cpu")) == torch.bfloat16


def prefill_on_tiles(type_name: str, num_rows: int) -> bool:
    """Whether ``num_rows`` activation rows go through dequantized tiles and a GEMM rather than
    the int8 kernels. From TILE_MIN_BATCH rows on: always with bfloat16 GEMMs; with fp32 ones,
    not for the K-quants, whose int8 kernels ran faster at every size measured (Zen 4, one
    thread, 8192 x 2048, GFLOP/s int8 / fp32 tiles at n = 64 and 256: AVX2 Q4_K 79/50, 77/68,
    Q6_K 74/50, 71/65; AVX-512 Q4_K 76/54, 93/77), while Q8_0's were slower (AVX2 33/46, 35/70).
    """
    if num_rows < TILE_MIN_BATCH:
        return False
    return bf16_tiles() or type_name not in K_QUANTS


def tile_rows(K: int, elem_bytes: int = 4) -> int:
    """Rows per tile of the prefill path: a multiple of 64 in [64, 1024] within TILE_BYTES."""
    return max(64, min(1024, TILE_BYTES // (elem_bytes * K)) // 64 * 64)


@dataclass(frozen=True)
class _Native:
    module: ModuleType | None
    best_isa: int  # index into ISAS, after the AVX-512 self-check
    types: frozenset[str]  # types with native kernels
    reason: str | None  # why module is None
    left_out: str | None = None  # why some types (the K-quants) have no native kernels


_state: _Native | None = None
_state_lock = threading.Lock()
_override: str | None = None  # set_isa's choice, above $AGENTD_CPU_ISA
_env_choice: tuple[str | None, str] | None = None  # ($AGENTD_CPU_ISA, the path it gives)
_TYPE_IDS = {name: t.type_id for name, t in GGML_TYPES.items()}


def _torch_fallback_warning(reason: str) -> str:
    fix = "install g++" if reason.startswith("no C++ compiler") else (
        'see the error with `python -c "from agentd.kernels.cpu import build; '
        'build(verbose=True)"`')
    # Measured on the 2-core AVX2 host, one thread, 4096 x 4096 GEMV on torch ops / native: Q4_0
    # 68.6 / 1.22 ms, Q4_K 68.4 / 1.32, Q6_K 110.5 / 1.62, Q8_0 33.9 / 1.67; prefill is
    # GEMM-bound either way.
    return (f"{reason}: GGUF products run on torch's kernels, dequantizing every weight per "
            f"call, ~50x slower to decode; {fix}")


def _resolve(loaded: _build.Loaded) -> _Native:
    module = loaded.module
    if module is None:
        reason = loaded.reason or "the CPU kernels are unavailable"
        logger.warning(_torch_fallback_warning(reason))
        return _Native(None, 0, frozenset(), reason)
    if loaded.left_out is not None:
        logger.warning("%s: Q4_K/Q5_K/Q6_K products run on torch's kernels, ~50x slower to decode",
                       loaded.left_out)
    best = module.best_isa()
    if best == ISAS.index("avx512_vnni") and (failures := module.self_check(best)):
        logger.warning("the AVX-512 kernels disagree with the scalar ones on this CPU (%s); "
                       "using the AVX2 kernels", failures.strip())
        best = ISAS.index("avx2")
    types = frozenset(n for n, t in GGML_TYPES.items() if n != "F32" and module.has_type(t.type_id))
    return _Native(module, best, types, None, loaded.left_out)


def _native() -> _Native:
    global _state
    if _state is None:
        with _state_lock:
            if _state is None:
                _state = _resolve(_build.load())
    return _state


def build(verbose: bool = False) -> None:
    """Build (or load) the extension now, retrying a cached failure; never raises. For setup
    scripts: ``python -c "from agentd.kernels.cpu import build; build(verbose=True)"``."""
    global _state, _env_choice
    with _state_lock:
        _state = _resolve(_build.load(verbose=verbose, retry=True))
        _env_choice = None
    if verbose:
        print(f"agentd CPU kernels: {active_isa()}"
              + (f" ({_state.reason})" if _state.reason else f", types {sorted(_state.types)}"))


def native_available() -> bool:
    return _native().module is not None


def native_unavailable_reason() -> str | None:
    return _native().reason


def available_isas() -> list[str]:
    """Every path this machine can run, weakest first (``torch`` always)."""
    native = _native()
    return ["torch"] + (list(ISAS[: native.best_isa + 1]) if native.module is not None else [])


def active_isa() -> str:
    """``avx512_vnni``, ``avx2``, ``scalar`` (the C++ kernels) or ``torch``: the best this
    machine runs, lowered by ``set_isa`` or else ``$AGENTD_CPU_ISA``."""
    if _override is not None:
        return _override
    forced = os.environ.get(ISA_ENV) or None
    choice = _env_choice
    if choice is not None and choice[0] == forced:
        return choice[1]
    return _choose_isa(forced)


def _choose_isa(forced: str | None) -> str:
    global _env_choice
    if forced is not None and forced not in (*ISAS, "torch"):
        raise ValueError(f"{ISA_ENV}={forced!r}: expected one of {', '.join(ISAS)}, torch")
    native = _native()
    if native.module is None or forced == "torch":
        isa = "torch"
    else:
        isa = ISAS[native.best_isa if forced is None else min(native.best_isa, ISAS.index(forced))]
    _env_choice = (forced, isa)
    return isa


def set_isa(name: str | None) -> None:
    """Run later products on ``name`` (one of ``available_isas()``), or with None go back to
    ``$AGENTD_CPU_ISA`` and the CPU: for tests and benchmarks that compare paths."""
    global _override
    if name is not None and name not in available_isas():
        raise ValueError(f"this machine runs {', '.join(available_isas())}, not {name!r}")
    _override = name


def _check(x: torch.Tensor, weight: torch.Tensor, type_name: str) -> None:
    if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous float32 [n, K] tensor, got {x.dtype} "
                         f"{tuple(x.shape)}")
    if weight.dtype != torch.uint8 or weight.dim() != 2 or weight.stride(-1) != 1:
        raise ValueError(f"weight must be uint8 [rows, row_bytes] with contiguous rows, got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    expected = row_bytes(type_name, x.shape[1])
    if weight.shape[1] != expected:
        raise ValueError(f"{type_name} weight rows hold {weight.shape[1]} bytes; K = "
                         f"{x.shape[1]} needs {expected}")


def _dequantize_into(weight: torch.Tensor, type_name: str, K: int, isa: str,
                     out: torch.Tensor) -> None:
    """dequant(weight) into ``out``: float32, or bfloat16 (rounded to nearest even)."""
    native = _native()
    if isa != "torch" and type_name in native.types | {"F32"}:
        native.module.dequantize(weight, GGML_TYPES[type_name].type_id, K, ISAS.index(isa), out)
    elif out.dtype == torch.float32:
        _fallback.dequantize_into(weight, type_name, K, out)
    else:
        wide = torch.empty(out.shape, dtype=torch.float32)
        _fallback.dequantize_into(weight, type_name, K, wide)
        out.copy_(wide)


def _gemm(x: torch.Tensor, tile: torch.Tensor) -> torch.Tensor:
    """x @ tile.T by oneDNN (torch's MKL sgemm ran 2-3.5x slower on this project's AMD host;
    see agentd.model.llama.PackedLinear), on the plain tile: packing it would cost more than it
    saves for one use."""
    if torch.backends.mkldnn.is_available():
        return torch.ops.mkldnn._linear_pointwise(x, tile, None, "none", [], "")
    return torch.mm(x, tile.t())


def _gemm_into(x: torch.Tensor, tile: torch.Tensor, out: torch.Tensor) -> None:
    if torch.backends.mkldnn.is_available():
        out.copy_(_gemm(x, tile))
    else:
        torch.mm(x, tile.t(), out=out)


def _tiled(x: torch.Tensor, weight: torch.Tensor, type_name: str, isa: str,
           out: torch.Tensor) -> None:
    """out = x @ dequant(weight).T, one tile of dequantized rows at a time: bfloat16 tiles and
    GEMM for TILE_MIN_BATCH rows or more where :func:`bf16_tiles` (inputs and output rounded to
    bfloat16; the torch path's decode keeps fp32 products), fp32 otherwise."""
    rows, K = weight.shape[0], x.shape[1]
    low = bf16_tiles() and x.shape[0] >= TILE_MIN_BATCH
    step = tile_rows(K, 2 if low else 4)
    buf = torch.empty(min(step, rows), K, dtype=torch.bfloat16 if low else torch.float32)
    x_gemm = x.to(torch.bfloat16) if low else x
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        tile = buf[: r1 - r0]
        _dequantize_into(weight[r0:r1], type_name, K, isa, tile)
        if low:
            out[:, r0:r1] = _gemm(x_gemm, tile)
        else:
            _gemm_into(x, tile, out[:, r0:r1])


def _into(x: torch.Tensor, weight: torch.Tensor, type_name: str, isa: str,
          out: torch.Tensor) -> None:
    """The product into ``out`` (a [n, rows] view with contiguous rows), by any path."""
    if type_name == "F32":
        torch.mm(x, _fallback.aligned(weight, 4).view(torch.float32).t(), out=out)
    elif (isa == "torch" or type_name not in _native().types
          or prefill_on_tiles(type_name, x.shape[0])):
        _tiled(x, weight, type_name, isa, out)
    else:
        _native().module.linear(x, weight, GGML_TYPES[type_name].type_id, ISAS.index(isa), out)


def linear(x: torch.Tensor, weight: torch.Tensor, type_name: str,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant(weight).T``: x float32 ``[n, K]``, weight uint8 ``[rows, row_bytes]`` (may
    be a view of an mmap); returns float32 ``[n, rows]`` (``out`` if given)."""
    isa = active_isa()
    native = _state
    if isa != "torch" and type_name in native.types and not prefill_on_tiles(type_name,
                                                                             x.size(0)):
        # The decode path, one call: C++ checks the tensors; Python explains a failure.
        try:
            return native.module.linear(x, weight, _TYPE_IDS[type_name], ISAS.index(isa), out)
        except RuntimeError:
            _check(x, weight, type_name)
            raise
    _check(x, weight, type_name)
    if out is None:
        out = torch.empty(x.shape[0], weight.shape[0])
    if x.shape[0] and weight.shape[0]:
        _into(x, weight, type_name, isa, out)
    return out


def linear_multi(x: torch.Tensor, parts: list[tuple[torch.Tensor, str]]) -> torch.Tensor:
    """Several products of one input side by side (fused q/k/v, gate/up): float32
    ``[n, sum(rows)]``, the activations quantized once per activation format."""
    isa = active_isa()
    native = _state
    if (isa != "torch" and all(t in native.types and not prefill_on_tiles(t, x.size(0))
                               for _, t in parts)):
        try:
            return native.module.linear_multi(x, [w for w, _ in parts],
                                              [_TYPE_IDS[t] for _, t in parts], ISAS.index(isa))
        except RuntimeError:
            for weight, type_name in parts:
                _check(x, weight, type_name)
            raise
    for weight, type_name in parts:
        _check(x, weight, type_name)
    out = torch.empty(x.shape[0], sum(weight.shape[0] for weight, _ in parts))
    col = 0
    for weight, type_name in parts:
        if x.shape[0] and weight.shape[0]:
            _into(x, weight, type_name, isa, out[:, col:col + weight.shape[0]])
        col += weight.shape[0]
    return out


def dequantize(weight: torch.Tensor, type_name: str, K: int) -> torch.Tensor:
    """uint8 rows ``[rows, row_bytes]`` -> float32 ``[rows, K]`` (a new tensor)."""
    if weight.dtype != torch.uint8 or weight.dim() != 2 or weight.shape[1] != row_bytes(
            type_name, K):
        raise ValueError(f"weight must be uint8 [rows, {row_bytes(type_name, K)}] for "
                         f"{type_name} with K = {K}, got {weight.dtype} {tuple(weight.shape)}")
    out = torch.empty(weight.shape[0], K)
    if weight.shape[0]:
        _dequantize_into(weight, type_name, K, active_isa(), out)
    return out


def get_rows(weight: torch.Tensor, type_name: str, ids: torch.Tensor, K: int) -> torch.Tensor:
    """The listed rows dequantized (an embedding lookup): float32 ``[len(ids), K]``."""
    return dequantize(weight.index_select(0, ids.reshape(-1).long()), type_name, K)
