"""Agent-length prompts on one GGUF file, agentd against llama-server side by side in one run.

For each prompt length it sends, to each server alone and one after the other: a cold prompt of
that many tokens (random ids of the file's vocabulary, the same for both servers) answered with
``--max-tokens`` greedy tokens (cold TTFT, then decode tok/s at that context), then a warm turn:
the same prompt plus ``--turn`` new tokens, one output token (its TTFT is the new tokens' prefill
over the cached prefix). Each prompt length starts from other random ids, so nothing of a shorter
one is reused. Peak RSS is the server's VmHWM at the end.

    .venv/bin/python benchmarks/long_context.py --gguf synth-1.7b-Q4_K_M.gguf \\
        [--llama-server PATH] [--tokens 4096,16384] [--turn 300] [--threads 2] [--tier]

``--tier`` then measures the disk tier at the longest length: two sessions that the pool cannot
hold together, a turn of the evicted one (read back from disk), ``kill -9``, a start and its next
turn, against its cold prefill and a warm turn.

llama-server runs ``-fa on -np 1 -c CONTEXT -t THREADS -ctk KV -ctv KV``; agentd ``agentd start
--model GGUF --max-model-len CONTEXT --num-threads THREADS --no-kv-disk --kv-cache-dtype KV``
plus ``--agentd-args``; ``--kv f16,q8_0`` runs both dtypes.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx

from agentd.bench.llama_server import LlamaServer
from agentd.bench.machine import cpu_line
from agentd.bench.rss import read_status_bytes
from agentd.bench.spawn import SpawnedDaemon


def stream(url: str, prompt: list[int], max_tokens: int) -> tuple[float, float | None]:
    """(TTFT, decode tok/s after the first token) of one greedy streamed completion. Tokens are
    counted from the final usage (``stream_options.include_usage``) where the server sends it:
    an event may carry several tokens (agentd's speculative steps), so counting events would
    undercount; where no usage comes back, events are counted."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "model": "m", "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = last = None
    events = 0
    usage = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=3600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                continue
            now = time.perf_counter()
            first = first or now
            last = now
            events += 1
    if first is None:
        raise RuntimeError("no token came back")
    tokens = (usage or {}).get("completion_tokens") or events
    rate = (tokens - 1) / (last - first) if tokens > 1 and last > first else None
    return first - started, rate


def llama_server(binary: str, gguf: str, context: int, threads: int, kv: str) -> LlamaServer:
    server = LlamaServer(binary, gguf, "-c", str(context), "-np", "1", "-fa", "on", "-t",
                         str(threads), "-ctk", kv, "-ctv", kv)
    server.start()
    return server


class Agentd:
    def __init__(self, gguf: str, context: int, threads: int, extra: list[str],
                 disk: bool = False, env: dict[str, str] | None = None) -> None:
        self.daemon = SpawnedDaemon(Path(tempfile.mkdtemp(prefix="agentd-long-")) / "state",
                                    "--model", gguf, "--max-model-len", str(context),
                                    "--num-threads", str(threads),
                                    *([] if disk else ["--no-kv-disk"]), *extra,
                                    env=env, ready_timeout_s=900)
        self.daemon.start()
        self.url = self.daemon.url

    def peak_rss_mib(self) -> float:
        assert self.daemon.process is not None
        return (read_status_bytes(self.daemon.process.pid, "VmHWM") or 0) / 2**20

    def stop(self) -> None:
        self.daemon.stop()


def tier_run(args: argparse.Namespace, length: int, context: int) -> None:
    """The disk tier at this length: session A cold, B cold (the pool, ``--tier-pool``, holds
    one of them: A's blocks leave it), A's next turn (read back from disk), ``kill -9`` and a
    start, A's next turn (from disk again), then one more (from the pool: a warm turn)."""
    rng = random.Random(1)
    a = [rng.randrange(1000, args.vocab - 1000) for _ in range(length)]
    b = [rng.randrange(1000, args.vocab - 1000) for _ in range(length)]
    turns = [[rng.randrange(1000, args.vocab - 1000) for _ in range(args.turn)]
             for _ in range(3)]
    server = Agentd(args.gguf, context, args.threads,
                    ["--kv-cache-memory", args.tier_pool, *shlex.split(args.agentd_args)],
                    disk=True)
    url = server.url
    try:
        cold_a, _ = stream(url, a, 1)
        cold_b, _ = stream(url, b, 1)
        wait_written(url)
        evicted, _ = stream(url, a + turns[0], 1)
        stats = httpx.get(f"{url}/v1/stats").json()
        server.daemon.kill()
        started = time.perf_counter()
        server.daemon.start()
        ready = time.perf_counter() - started
        restarted, _ = stream(url, a + turns[0] + turns[1], 1)
        warm, _ = stream(url, a + turns[0] + turns[1] + turns[2], 1)
        after = httpx.get(f"{url}/v1/stats").json()
    finally:
        server.stop()
    disk = stats["kv_disk"]
    print(f"\ndisk tier, {length:,}-token sessions, pool {args.tier_pool}:")
    print(f"  A cold {cold_a:.1f} s, B cold {cold_b:.1f} s; disk {disk['num_blocks']} blocks, "
          f"{disk['num_bytes'] / 2**30:.2f} GiB")
    print(f"  A's turn after its blocks left the pool: {evicted:.2f} s ({cold_a / evicted:.1f}x "
          f"faster than its cold prefill; {stats['prefix_cache_disk_hits']:,} tokens from disk)")
    print(f"  kill -9, start ({ready:.1f} s to ready), A's next turn: {restarted:.2f} s "
          f"({restarted / warm:.2f}x a warm turn); then a warm turn {warm:.2f} s "
          f"({after['prefix_cache_disk_hits']:,} tokens from disk since the start)")


def wait_written(url: str, timeout_s: float = 600) -> None:
    """Until the disk tier's write queue is empty."""
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{url}/v1/stats").json()["kv_disk"]["write_queue_blocks"]:
        if time.monotonic() > deadline:
            raise RuntimeError("the disk tier's writes did not drain")
        time.sleep(0.2)


def serve(args: argparse.Namespace, name: str, kv: str, context: int, lengths: list[int],
          prompts: dict[int, list[int]], turns: dict[int, list[int]]) -> list[tuple]:
    """One server at one KV dtype over every prompt length: its rows of the table."""
    started = time.perf_counter()
    env = {"AGENTD_PREFILL_BF16": "0"} if args.fp32_products else {}
    if args.avx2:  # agentd's kernels, torch's and oneDNN's capped at AVX2 (+FMA)
        env.update(AGENTD_CPU_ISA="avx2", ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    dtype = {"f16": "float16"}.get(kv, kv)
    server = (Agentd(args.gguf, context, args.threads,
                     ["--kv-cache-dtype", dtype, *shlex.split(args.agentd_args)], env=env)
              if name == "agentd" else
              llama_server(args.llama_server, args.gguf, context, args.threads, kv))
    print(f"{name} ({kv} KV): ready in {time.perf_counter() - started:.1f} s", flush=True)
    rows = []
    try:
        for n in lengths:
            cold, rate = stream(server.url, prompts[n], args.max_tokens)
            warm, _ = stream(server.url, prompts[n] + turns[n], 1)
            rows.append((name, kv, n, cold, rate, warm, server.peak_rss_mib()))
            print(f"  {n} tokens: cold TTFT {cold:.2f} s ({n / cold:.0f} tok/s), decode "
                  f"{rate or 0:.2f} tok/s, warm turn (+{args.turn}) TTFT {warm:.2f} s, "
                  f"peak RSS {rows[-1][6]:.0f} MiB", flush=True)
    finally:
        server.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--llama-server", default=None, help="a llama-server binary")
    parser.add_argument("--tokens", default="4096,16384", help="prompt lengths, comma-separated")
    parser.add_argument("--turn", type=int, default=300, help="a warm turn's new tokens")
    parser.add_argument("--max-tokens", type=int, default=16, help="cold request's output")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=49152, help="ids drawn below this")
    parser.add_argument("--agentd-args", default="", help="more `agentd start` options")
    parser.add_argument("--servers", default="agentd,llama")
    parser.add_argument("--kv", default="f16", help="KV cache dtypes, comma-separated: f16, "
                        "q8_0 (agentd --kv-cache-dtype float16/q8_0, llama-server -ctk/-ctv)")
    parser.add_argument("--fp32-products", action="store_true", help="agentd's prefill "
                        "attention with fp32 products (AGENTD_PREFILL_BF16=0; bfloat16 is the "
                        "default on AVX512-BF16 CPUs)")
    parser.add_argument("--avx2", action="store_true", help="agentd on its AVX2 paths "
                        "(AGENTD_CPU_ISA=avx2, ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2); "
                        "pass a llama-server built for AVX2 (-DGGML_NATIVE=OFF -DGGML_AVX2=ON)")
    parser.add_argument("--tier", action="store_true",
                        help="then the disk tier at the longest length (agentd only)")
    parser.add_argument("--tier-pool", default="4GiB", help="the pool for --tier: room for "
                        "one session, not two (1.7B fp16 KV: 192 KiB a token)")
    args = parser.parse_args()
    lengths = [int(n) for n in args.tokens.split(",")]
    context = max(lengths) + 3 * args.turn + args.max_tokens + 64
    print(cpu_line())
    if args.avx2:
        print("agentd on its AVX2 paths (AGENTD_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 "
              f"ONEDNN_MAX_CPU_ISA=AVX2); llama-server: {args.llama_server}")
    print(f"{args.gguf}: prompts {lengths}, warm turn +{args.turn}, context {context}, "
          f"{args.threads} threads", flush=True)
    rng = random.Random(0)
    prompts = {n: [rng.randrange(1000, args.vocab - 1000) for _ in range(n)] for n in lengths}
    turns = {n: [rng.randrange(1000, args.vocab - 1000) for _ in range(args.turn)]
             for n in lengths}
    rows = []
    for kv in args.kv.split(","):
        for name in args.servers.split(","):
            if name == "llama" and not args.llama_server:
                print("llama-server: skipped (no --llama-server)")
                continue
            rows += serve(args, name, kv, context, lengths, prompts, turns)
    print("\n| server | KV | prompt | cold TTFT | prefill tok/s | decode tok/s | warm TTFT "
          f"(+{args.turn}) | peak RSS |")
    print("|---|---|---|---|---|---|---|---|")
    for name, kv, n, cold, rate, warm, rss in rows:
        print(f"| {name} | {kv} | {n:,} | {cold:.1f} s | {n / cold:.0f} | {rate or 0:.2f} | "
              f"{warm:.2f} s | {rss:,.0f} MiB |")
    by = {r[:3]: r for r in rows}
    for kv in args.kv.split(","):
        for n in lengths:
            a, b = by.get(("agentd", kv, n)), by.get(("llama", kv, n))
            if a and b:
                print(f"{n:,} tokens, {kv} KV, agentd / llama-server: cold TTFT "
                      f"{a[3] / b[3]:.2f}x, decode {(a[4] or 0) / (b[4] or 1):.2f}x, warm TTFT "
                      f"{a[5] / b[5]:.2f}x, RSS {a[6] / b[6]:.2f}x")
    if "f16" in args.kv and "q8_0" in args.kv:
        for n in lengths:
            a, b = by.get(("agentd", "q8_0", n)), by.get(("agentd", "f16", n))
            if a and b:
                print(f"{n:,} tokens, agentd q8_0 / f16 KV: decode "
                      f"{(a[4] or 0) / (b[4] or 1):.2f}x, cold TTFT {a[3] / b[3]:.2f}x, RSS "
                      f"{a[6] / b[6]:.2f}x")
    if args.tier:
        tier_run(args, max(lengths), context)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
