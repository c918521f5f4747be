"""Single-thread speed of the K-quant CPU kernels against this machine's memory-read ceiling.

A decode step reads every weight once, so a vec_dot kernel is good when one core streams weight
bytes about as fast as it can read memory at all. This script compiles kernels/cpu/kquants_*.cpp
with a small C loop over rows (ctypes per row would cost more than the row), times one product
of a 14336 x 4096 matrix (a Llama-8B FFN weight: 33 MB as Q4_K, 48 MB as Q6_K; past any L3)
with one activation row, and reports GB/s of weight bytes beside two ceilings: an AVX2 read loop
over 512 MB and numpy's sum over the same bytes; with the extension built, also the same product
through ``agentd.kernels.cpu.linear`` on one thread. It also times the dequantizers (prefill
tiles, embedding rows), scalar vs AVX2, into a 16 x 4096 fp32 buffer that stays in L2.

    python benchmarks/cpu_kquants.py [--rows 14336] [--cols 4096] [--repeats 7]
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import NamedTuple

import numpy as np

import agentd.kernels

CPU_DIR = Path(agentd.kernels.__file__).parent / "cpu"
QK_K = 256
BLOCK_BYTES = {"q4_K": 144, "q5_K": 176, "q6_K": 210}
FP16_OFFSETS = {"q4_K": (0, 2), "q5_K": (0, 2), "q6_K": (208,)}
ACT_BYTES = 4 + QK_K + 2 * QK_K // 16

SHIM = """
#include <immintrin.h>
#include <cstddef>
#include "ggml_blocks.h"
using namespace agentd_cpu;
#define ROWS(name, fn)                                                                  \\
  extern "C" void name(int rows, size_t row_bytes, int K, const uint8_t* w,            \\
                       const void* act, float* out) {                                   \\
    for (int r = 0; r < rows; ++r) out[r] = fn(K, w + r * row_bytes, act);            \\
  }
#define DEQ(name, fn)                                                                   \\
  extern "C" void name(int rows, size_t row_bytes, int K, const uint8_t* w, float* out) { \\
    for (int r = 0; r < rows; ++r) fn(K, w + r * row_bytes, out + (size_t)r * K);      \\
  }
%s
// The read ceiling: 32-byte loads, four independent accumulators, nothing else.
extern "C" __attribute__((target("avx2"))) long long read_bytes(const uint8_t* p, size_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i + 128 <= n; i += 128) {
    a0 = _mm256_add_epi64(a0, _mm256_loadu_si256((const __m256i*)(p + i)));
    a1 = _mm256_add_epi64(a1, _mm256_loadu_si256((const __m256i*)(p + i + 32)));
    a2 = _mm256_add_epi64(a2, _mm256_loadu_si256((const __m256i*)(p + i + 64)));
    a3 = _mm256_add_epi64(a3, _mm256_loadu_si256((const __m256i*)(p + i + 96)));
  }
  __m256i s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
  return _mm256_extract_epi64(s, 0) + _mm256_extract_epi64(s, 3);
}
"""


def build(out_dir: Path) -> ctypes.CDLL:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise SystemExit("no C++ compiler (g++/c++) on PATH")
    lines = []
    for t in BLOCK_BYTES:
        for isa in ("scalar", "avx2"):
            lines.append(f"ROWS(rows_{t}_{isa}, vec_dot_{t}_{isa})")
        lines.append(f"DEQ(deq_{t}_scalar, dequant_row_{t})")
        lines.append(f"DEQ(deq_{t}_avx2, dequant_row_{t}_avx2)")
    (out_dir / "shim.cpp").write_text(SHIM % "\n".join(lines))
    sources = [*(str(CPU_DIR / f"kquants_{s}.cpp") for s in ("scalar", "avx2", "avx512")),
               str(out_dir / "shim.cpp")]
    so = out_dir / "kquants_bench.so"
    subprocess.run([cxx, "-O3", "-std=c++17", "-fPIC", "-shared", f"-I{CPU_DIR}", *sources,
                    "-o", str(so)], check=True)
    lib = ctypes.CDLL(str(so))
    vp, i32, size = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    for t in BLOCK_BYTES:
        for isa in ("scalar", "avx2"):
            getattr(lib, f"rows_{t}_{isa}").argtypes = [i32, size, i32, vp, vp, vp]
            getattr(lib, f"deq_{t}_{isa}").argtypes = [i32, size, i32, vp, vp]
    lib.read_bytes.argtypes, lib.read_bytes.restype = [vp, size], ctypes.c_longlong
    return lib


def random_matrix(t: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    nb = cols // QK_K
    data = rng.integers(0, 256, size=(rows, nb, BLOCK_BYTES[t]), dtype=np.uint8)
    for off in FP16_OFFSETS[t]:
        d = (rng.standard_normal((rows, nb)) * 1e-2).astype(np.float16)
        data[:, :, off:off + 2] = d.view(np.uint8).reshape(rows, nb, 2)
    return data.reshape(rows, nb * BLOCK_BYTES[t])


def random_act(cols: int, rng: np.random.Generator) -> np.ndarray:
    nb = cols // QK_K
    act = np.zeros((nb, ACT_BYTES), dtype=np.uint8)
    act[:, 0:4] = np.full(nb, 0.01, dtype=np.float32).view(np.uint8).reshape(nb, 4)
    qs = rng.integers(-127, 128, size=(nb, QK_K), dtype=np.int8)
    act[:, 4:4 + QK_K] = qs.view(np.uint8)
    bsums = qs.reshape(nb, 16, 16).sum(axis=2, dtype=np.int16)
    act[:, 4 + QK_K:] = bsums.view(np.uint8).reshape(nb, 32)
    return act


class Case(NamedTuple):
    label: str
    num_bytes: int  # weight bytes read (or, for dequantizers, weights written)
    run: Callable[[], object]
    buffers: tuple[object, ...] = ()  # what run's raw addresses point into, kept alive here


def best_times(cases: list[Case], repeats: int) -> list[float]:
    """Each case's fastest run, in this thread's CPU time, the cases interleaved round by round:
    the host's other processes take the core away for whole time slices (which CPU time leaves
    out) and share the memory bus (which interleaving spreads evenly over the cases)."""
    for case in cases:
        case.run()  # warm: page faults, caches
    best = [float("inf")] * len(cases)
    for _ in range(repeats):
        for i, case in enumerate(cases):
            start = time.thread_time()
            case.run()
            best[i] = min(best[i], time.thread_time() - start)
    return best


def rows_case(lib: ctypes.CDLL, name: str, w: np.ndarray, n: int, act: np.ndarray,
              out: np.ndarray) -> Case:
    fn = getattr(lib, name)
    cols = act.shape[0] * QK_K
    return Case(f"{name} {n} x {cols}", n * w.shape[1],
                partial(fn, n, w.shape[1], cols, w.ctypes.data, act.ctypes.data, out.ctypes.data),
                (w, act, out))


def product_cases(lib: ctypes.CDLL, rows: int, cols: int) -> list[Case]:
    rng = np.random.default_rng(0)
    act = random_act(cols, rng)
    out = np.empty(rows, dtype=np.float32)
    big = np.ones(512 << 20, dtype=np.uint8)
    cases = [Case("ceiling: AVX2 read loop, 512 MB", big.nbytes,
                  partial(lib.read_bytes, big.ctypes.data, big.nbytes), (big,)),
             Case("ceiling: numpy float64 sum, 512 MB", big.nbytes, big.view(np.float64).sum)]
    for t in BLOCK_BYTES:
        w = random_matrix(t, rows, cols, rng)
        cases.append(rows_case(lib, f"rows_{t}_avx2", w, rows, act, out))
        cases.append(rows_case(lib, f"rows_{t}_scalar", w, rows // 16, act, out))  # slow: fewer
        cases.extend(api_cases(t, w, cols))
    return cases


def api_cases(t: str, w: np.ndarray, cols: int) -> list[Case]:
    """The same product through agentd.kernels.cpu.linear (its quantizer and dispatch; one
    thread), when the extension is built."""
    import torch

    import agentd.kernels.cpu as cpu

    if not cpu.native_available():
        return []
    torch.set_num_threads(1)
    x, weight, type_name = torch.randn(1, cols), torch.from_numpy(w), t.upper()
    out = torch.empty(1, w.shape[0])
    return [Case(f"linear {type_name} ({cpu.active_isa()}, 1 thread)", w.nbytes,
                 partial(cpu.linear, x, weight, type_name, out))]


def dequant_cases(lib: ctypes.CDLL, cols: int) -> list[Case]:
    rows = 16  # 256 KB of floats: the output stays in L2, as a reused prefill tile mostly does
    rng = np.random.default_rng(1)
    out = np.empty((rows, cols), dtype=np.float32)
    cases = []
    for t in BLOCK_BYTES:
        w = random_matrix(t, rows, cols, rng)
        for isa in ("scalar", "avx2"):
            fn = getattr(lib, f"deq_{t}_{isa}")
            cases.append(Case(f"deq_{t}_{isa} {rows} x {cols}", rows * cols,
                              partial(fn, rows, w.shape[1], cols, w.ctypes.data, out.ctypes.data),
                              (w, out)))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=14336)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(Path(tmp))
        cases = product_cases(lib, args.rows, args.cols)
        for case, s in zip(cases, best_times(cases, args.repeats), strict=True):
            print(f"{case.label:44s} {case.num_bytes / s / 1e9:6.2f} GB/s  {s * 1e3:8.2f} ms")
        cases = dequant_cases(lib, args.cols)
        for case, s in zip(cases, best_times(cases, 20 * args.repeats), strict=True):
            print(f"{case.label:44s} {case.num_bytes / s / 1e9:6.2f} Gweights/s")


if __name__ == "__main__":
    main()
