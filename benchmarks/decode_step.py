"""One decode step of a GGUF model at a given context, against the machine's memory bandwidth.

The engine's runner alone (no server, no prefill): the KV pool is filled with random keys and
values (in its dtype) for the longest context, then one sequence decodes ``--steps`` tokens at each
``--tokens`` length; the median step time gives tok/s, and the bytes a step must read (the
weights' tensors, the token embedding's one row unless it is also the output matrix, plus the
context's KV in the pool's dtype) over the step time give its GB/s, printed beside a plain
streaming read (``torch.sum`` of 1 GiB, the best of 10) on the same threads, measured right
before and right after each row's steps (a VM's bandwidth moves with its neighbours: 51-86 GB/s
on one afternoon here), the row's share taken against their mean. ``--seqs N``:
N sequences at that context decode together, each over blocks of its own (does the pool hold
them, and what is the process's peak RSS once they are all resident).

    .venv/bin/python benchmarks/decode_step.py --gguf synth-1.7b-Q4_K_M-32k.gguf \\
        [--tokens 64,4096,16384] [--kv f16,q8_0] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from agentd.bench.machine import cpu_line
from agentd.bench.rss import read_status_bytes
from agentd.engine.llm_engine import LLMEngine
from agentd.engine.scheduler import ScheduledRequest
from agentd.kernels import kv_quant
from agentd.llm import engine_config
from agentd.model.gguf_header import read_index

KV_NAMES = {"f16": "float16", "q8_0": "q8_0", "f32": "float32"}


def streaming_gbs(threads: int) -> float:
    torch.set_num_threads(threads)
    x = torch.ones(2**28)  # 1 GiB of fp32, far past the caches; the best of 10 (a VM's
    x.sum()               # neighbours make single reads of 2 GiB vary 33-77 GB/s)
    times = []
    for _ in range(10):
        started = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - started)
    return x.numel() * 4 / min(times) / 1e9


def weight_bytes(gguf: Path) -> int:
    """The tensors a step reads: all of them, but the token embedding's one row when a separate
    output matrix exists (tied embeddings are read whole, as the output)."""
    index = read_index(gguf)
    names = {t.name for t in index.tensors}
    total = 0
    for t in index.tensors:
        if t.name == "token_embd.weight" and "output.weight" in names:
            total += t.num_bytes // t.shape[-1]
        else:
            total += t.num_bytes
    return total


def fill_pool(engine: LLMEngine, num_blocks: int) -> None:
    gen = torch.Generator().manual_seed(0)
    for layer in engine.runner.kv_caches:
        head_dim = kv_quant.head_dim_of(layer)
        for b0 in range(0, num_blocks, 256):
            n = min(256, num_blocks - b0)
            x = torch.randn(n, 2, layer.shape[2], layer.shape[3], head_dim, generator=gen)
            layer[b0:b0 + n] = kv_quant.store(x, layer.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True, type=Path)
    parser.add_argument("--tokens", default="64,4096,16384")
    parser.add_argument("--kv", default="f16,q8_0")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seqs", type=int, default=1, help="sequences decoding together, "
                        "each at the context length with blocks of its own")
    args = parser.parse_args()
    lengths = [int(n) for n in args.tokens.split(",")]
    print(cpu_line())
    weights = weight_bytes(args.gguf)
    print(f"{args.gguf.name}: {weights / 1e9:.2f} GB of weights a step; {args.threads} threads")
    print(f"{args.seqs} sequence(s) a step; tok/s counts all of them")
    print("| KV | context | step (median) | tok/s | KV bytes | GB/s | streaming before / after "
          "| of streaming |")
    print("|---|---|---|---|---|---|---|---|")
    for kv in args.kv.split(","):
        engine = LLMEngine(engine_config(str(args.gguf), kv_cache_dtype=KV_NAMES[kv],
                                         max_model_len=max(lengths) + args.steps + 16,
                                         max_num_seqs=args.seqs, kv_disk_dir=None,
                                         num_threads=args.threads, speculative="off"))
        block = engine.config.block_size
        num_blocks = -(-(max(lengths) + args.steps + 1) // block)
        if num_blocks * args.seqs > engine.num_blocks:
            raise SystemExit(f"{kv}: the pool holds {engine.num_blocks} blocks, "
                             f"{num_blocks * args.seqs} needed")
        fill_pool(engine, num_blocks * args.seqs)
        tables = [list(range(i * num_blocks, (i + 1) * num_blocks)) for i in range(args.seqs)]
        per_token = engine.kv_plan.num_bytes / engine.kv_plan.num_tokens
        for length in lengths:
            before = streaming_gbs(args.threads)
            times = []
            for i in range(args.steps + 3):
                started = time.perf_counter()
                engine.runner.execute([ScheduledRequest(f"r{j}", [1000 + i], length + i, table,
                                                        True) for j, table in enumerate(tables)])
                times.append(time.perf_counter() - started)
            step = statistics.median(times[3:])
            after = streaming_gbs(args.threads)
            kv_bytes = per_token * length * args.seqs
            rate = (weights + kv_bytes) / step / 1e9
            print(f"| {kv} | {length:,} | {step * 1e3:.1f} ms | {args.seqs / step:.2f} | "
                  f"{kv_bytes / 1e9:.2f} GB | {rate:.1f} | {before:.1f} / {after:.1f} | "
                  f"{rate / ((before + after) / 2):.0%} |", flush=True)
        del engine
    peak = read_status_bytes(os.getpid(), "VmHWM") or 0
    print(f"peak RSS {peak / 2**30:.2f} GiB ({args.seqs} sequence(s), the pool filled for them)")


if __name__ == "__main__":
    main()
