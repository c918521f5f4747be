"""Speed of ``agentd.kernels.cpu`` products against this machine's memory bandwidth and torch.

A decode step (n = 1) reads every weight once, so a GEMV is good when it streams weight bytes
about as fast as the machine reads memory at all: the ceiling is measured as torch.sum and
torch.mv (BLAS sgemv) over 512 MB at the same thread count. Prefill (n = 2048) is
compute-bound: the tile path (dequantize tile_rows(K) rows into a reused fp32 buffer, then a
GEMM) is compared with torch's fp32 F.linear and oneDNN's packed fp32 linear
(agentd.model.llama.PackedLinear) of the same shape. The crossover sweep times both paths of
one layer at growing n to place TILE_MIN_BATCH.

    python benchmarks/cpu_kernels.py [--threads 2] [--part gemv,prefill,crossover] [--repeats 9]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

import agentd.kernels.cpu as cpu
from agentd.kernels.cpu import reference
from agentd.model.isa import detect_isa

GEMV_SHAPES = [(2048, 2048), (8192, 2048), (4096, 4096), (14336, 4096)]
PREFILL_SHAPES = [(2048, 2048), (8192, 2048)]


def best_s(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def weight(type_name: str, rows: int, K: int) -> torch.Tensor:
    return torch.from_numpy(reference.random_blocks(np.random.default_rng(0), type_name, rows, K))


def int8_path(x: torch.Tensor, w: torch.Tensor, type_name: str) -> Callable[[], object]:
    out = torch.empty(x.shape[0], w.shape[0])
    ext, isa = cpu._native().module, cpu.ISAS.index(cpu.active_isa())
    return lambda: ext.linear(x, w, cpu.GGML_TYPES[type_name].type_id, isa, out)


def tile_path(x: torch.Tensor, w: torch.Tensor, type_name: str) -> Callable[[], object]:
    out = torch.empty(x.shape[0], w.shape[0])
    return lambda: cpu._tiled(x, w, type_name, cpu.active_isa(), out)


def ceiling(repeats: int) -> None:
    big = torch.ones(128 * 2**20)  # 512 MB
    s = best_s(lambda: big.sum(), repeats)
    dst = torch.empty_like(big)
    c = best_s(lambda: dst.copy_(big), repeats)
    matrix, ones = big.view(-1, 4096), torch.ones(4096)
    m = best_s(lambda: torch.mv(matrix, ones), repeats)  # BLAS sgemv: prefetching, unrolled
    print(f"read ceiling over 512 MB: torch.sum {big.nbytes / s / 1e9:.1f} GB/s, torch.mv "
          f"{big.nbytes / m / 1e9:.1f} GB/s; copy {2 * big.nbytes / c / 1e9:.1f} GB/s "
          "(read + write)")


def gemv(types: list[str], repeats: int) -> None:
    print("\ndecode GEMV, n = 1: ms (GB/s of weight bytes)")
    print(f"{'shape':>12} " + " ".join(f"{t:>16}" for t in types) + f" {'fp32 F.linear':>16}")
    for rows, K in GEMV_SHAPES:
        x = torch.randn(1, K)
        cells = []
        for t in types:
            w = weight(t, rows, K)
            s = best_s(partial(cpu.linear, x, w, t), repeats)
            cells.append(f"{s * 1e3:7.3f} ({w.nbytes / s / 1e9:5.1f})")
        dense = torch.randn(rows, K)
        s = best_s(partial(F.linear, x, dense), repeats)
        cells.append(f"{s * 1e3:7.3f} ({dense.nbytes / s / 1e9:5.1f})")
        print(f"{rows:>6}x{K:<5} " + " ".join(f"{c:>16}" for c in cells))


def prefill(types: list[str], repeats: int, n: int = 2048) -> None:
    print(f"\nprefill, n = {n}: GFLOP/s (tile path, TILE_BYTES = {cpu.TILE_BYTES >> 20} MiB)")
    for rows, K in PREFILL_SHAPES:
        x = torch.randn(n, K)
        flop = 2 * n * rows * K
        dense = torch.randn(rows, K)
        packed = torch.ops.mkldnn._reorder_linear_weight(dense)
        ref = {
            "F.linear": best_s(partial(F.linear, x, dense), repeats),
            "oneDNN packed": best_s(partial(torch.ops.mkldnn._linear_pointwise, x, packed, None,
                                            "none", [], ""), repeats),
        }
        line = "  ".join(f"{k} {flop / s / 1e9:6.1f}" for k, s in ref.items())
        for t in types:
            s = best_s(tile_path(x, weight(t, rows, K), t), repeats)
            line += (f"  {t} {flop / s / 1e9:6.1f} ({ref['F.linear'] / s:.2f}x F.linear, "
                     f"{ref['oneDNN packed'] / s:.2f}x packed)")
        print(f"{rows:>6}x{K:<5} {line}")


def crossover(types: list[str], repeats: int, rows: int = 2048, K: int = 2048) -> None:
    print(f"\ncrossover on {rows}x{K}: ms int8 kernels / dequantized tiles + GEMM")
    for t in types:
        w = weight(t, rows, K)
        cells = []
        for n in (8, 16, 32, 48, 64, 96, 128):
            x = torch.randn(n, K)
            a, b = best_s(int8_path(x, w, t), repeats), best_s(tile_path(x, w, t), repeats)
            cells.append(f"n={n} {a * 1e3:.1f}/{b * 1e3:.1f}")
        print(f"{t:>5} " + "  ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--types", default="Q4_K,Q8_0,Q4_0")
    parser.add_argument("--part", default="gemv,prefill,crossover")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    types, parts = args.types.split(","), args.part.split(",")
    print(f"CPU: {detect_isa().describe()}")
    print(f"torch.backends.cpu.get_cpu_capability(): {torch.backends.cpu.get_cpu_capability()}; "
          f"agentd.kernels.cpu: {cpu.active_isa()}; threads {torch.get_num_threads()}")
    ceiling(args.repeats)
    if "gemv" in parts:
        gemv(types, args.repeats)
    if "prefill" in parts:
        prefill(types, max(3, args.repeats // 3))
    if "crossover" in parts:
        crossover(types, args.repeats)


if __name__ == "__main__":
    main()
