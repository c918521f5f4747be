"""Prefill attention on the CPU, one layer at a model's shape: torch's path against agentd's own
kernel (``kernels/cpu/ops_prefill.h``), fp32 products and bfloat16 ones, side by side in one run.

For each context (cached tokens) and chunk (new rows) it times one layer's attention of the
chunk over the paged pool (blocks shuffled, as a pool that has served for a while holds them),
prints GFLOP/s (4 * rows * heads * head_dim * keys, the causal half of the chunk's own keys
counted), and the same CPU's GEMM rates (a 2,048-cube matmul in fp32 and bfloat16) for scale;
then each path's error against the fp32 reference on one case.

    .venv/bin/python benchmarks/prefill_attention.py [--shape 1.7b|8b|135m] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from agentd.bench.machine import cpu_line
from agentd.kernels.cpu import fused
from agentd.kernels.prefill_attention import reference_prefill_attention, torch_prefill_attention

SHAPES = {  # (query heads, KV heads, head_dim, layers)
    "135m": (9, 3, 64, 30), "1.7b": (32, 32, 64, 24), "8b": (32, 8, 128, 32)}
CASES = [(0, 512), (4096, 512), (16384, 32), (16384, 300), (16384, 512), (32768, 300)]


def timed(fn, reps: int) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - started) / reps


def gemm_rate(dtype: torch.dtype) -> float:
    a, b = torch.randn(2048, 2048).to(dtype), torch.randn(2048, 2048).to(dtype)
    return 2 * 2048 ** 3 / timed(lambda: a @ b, 5) / 1e9


def batch(shape: tuple[int, int, int, int], cached: int, rows: int, dtype: torch.dtype,
          block_size: int = 16, seed: int = 0):
    heads, kv_heads, head_dim, _ = shape
    gen = torch.Generator().manual_seed(seed)
    length = cached + rows
    num_blocks = -(-length // block_size)
    pool = (torch.randn(num_blocks + 4, 2, block_size, kv_heads, head_dim, generator=gen)
            * 0.5).to(dtype)
    table = torch.randperm(num_blocks + 4, generator=gen)[:num_blocks].to(torch.int32)
    query = torch.randn(rows, heads, head_dim, generator=gen)
    return (query, pool, table.view(1, -1), torch.tensor([0, rows], dtype=torch.int32),
            torch.tensor([length], dtype=torch.int32), head_dim ** -0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="1.7b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"],
                        default="float16", help="the pool's (a GGUF's is float16)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape, dtype = SHAPES[args.shape], getattr(torch, args.dtype)
    print(cpu_line())
    print(f"shape {args.shape}: {shape[0]} heads, {shape[1]} KV heads, head_dim {shape[2]}, "
          f"{shape[3]} layers; pool {args.dtype}")
    fp32, bf16 = gemm_rate(torch.float32), gemm_rate(torch.bfloat16)
    print(f"GEMM 2048^3: fp32 {fp32:.0f} GFLOP/s, bf16 {bf16:.0f} GFLOP/s\n")
    print("| cached | rows | torch ms | C++ fp32 ms | C++ bf16 ms | GFLOP/s torch / fp32 / bf16 "
          "| bf16 / GEMM bf16 | a forward's attention, C++ bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    for cached, rows in CASES:
        args_ = batch(shape, cached, rows, dtype)
        reps = 3 if cached >= 16384 else 5
        t_torch = timed(lambda a=args_: torch_prefill_attention(*a), reps)
        t_fp32 = timed(lambda a=args_: fused.prefill_attention(*a, bf16=False), reps)
        t_bf16 = timed(lambda a=args_: fused.prefill_attention(*a, bf16=True), reps)
        flops = 4 * rows * shape[0] * shape[2] * (cached + rows / 2)
        rates = [flops / t / 1e9 for t in (t_torch, t_fp32, t_bf16)]
        print(f"| {cached:,} | {rows} | {t_torch * 1e3:.1f} | {t_fp32 * 1e3:.1f} | "
              f"{t_bf16 * 1e3:.1f} | {rates[0]:.0f} / {rates[1]:.0f} / {rates[2]:.0f} | "
              f"{rates[2] / bf16:.0%} | {t_bf16 * shape[3]:.2f} s |")
    query, pool, tables, starts, lens, scale = batch(shape, 2000, 300, dtype, seed=1)
    expected = reference_prefill_attention(query, pool.float(), tables, starts, lens, scale)
    print(f"\nerror against the fp32 reference (2,000 cached + 300 rows, outputs of scale "
          f"{expected.abs().mean():.3f}):")
    for name, fn in (("torch", lambda: torch_prefill_attention(query, pool, tables, starts,
                                                                lens, scale)),
                     ("C++ fp32", lambda: fused.prefill_attention(
                         query, pool, tables, starts, lens, scale, bf16=False)),
                     ("C++ bf16", lambda: fused.prefill_attention(
                         query, pool, tables, starts, lens, scale, bf16=True))):
        error = (fn() - expected).abs()
        print(f"  {name}: max {error.max():.2e}, mean {error.mean():.2e}")


if __name__ == "__main__":
    main()
