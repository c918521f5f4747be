"""Decode tokens/s at batch 1, 8 and 32, cold and warm TTFT, load time and RSS per weight format.

Each format runs in its own process (so RSS is its own), one after the other in one run; the
agent case: a shared ~2,000-token prefix (the coding agent's system prompt) and a short turn per
request. Prints the CPU flags, torch's capability and the kernels each format chose. Measure the
AVX2 path on a newer CPU with ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``.

    python -m benchmarks.weight_formats [--formats float32,int4,int4:dequantize,...] [--json F]

``gguf``: the file as it ships (the default model's default). A format may carry
``:dequantize`` (``--prefill-weights dequantize``: no dense fp32 twin).
``--ab`` loads every format in one process and alternates their decode runs, round after round
(medians): on a shared machine whose speed drifts between runs, only that gives fair ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

FORMATS = ("gguf", "float32", "bfloat16", "float16", "int8", "int4", "int4:dequantize", "auto")
BATCHES = (1, 8, 32)


def one_format(spec: str, prefix_tokens: int, max_tokens: int,
               num_threads: int | None) -> dict[str, object]:
    """Runs in the child: load, cold and warm TTFT, then decode at each batch size."""
    import psutil

    from agentd import LLM, SamplingParams
    from benchmarks.cpu_levers import cold_ttft_s, decode_tok_s, prompts

    weights, _, prefill = spec.partition(":")
    start = time.perf_counter()
    llm = LLM(weights=weights, dtype="float32", kv_cache_memory="384MiB",
              prefill_weights=prefill or "keep", num_threads=num_threads)
    load_s = time.perf_counter() - start
    prefix, batch = prompts(llm.tokenizer, prefix_tokens, max(BATCHES))
    cold = cold_ttft_s(llm, prefix, repeats=2)
    llm.generate(batch[:1], SamplingParams(temperature=0, max_tokens=1))
    warm = []
    for turn in batch[1:6]:  # the prefix is cached: only the turn runs
        t = time.perf_counter()
        llm.generate([turn], SamplingParams(temperature=0, max_tokens=1))
        warm.append(time.perf_counter() - t)
    tok_s = {n: decode_tok_s(llm, batch[:n], max_tokens) for n in BATCHES}
    return {"weights": llm.engine.loaded.weights, "load_s": load_s, "cold_ttft_s": cold,
            "warm_ttft_s": sorted(warm)[len(warm) // 2], "decode_tok_s": tok_s,
            "rss_mib": psutil.Process().memory_info().rss / 2**20,
            "peak_rss_mib": _peak_rss_mib(),
            "compute": llm.engine.loaded.compute_report()}


def alternate(specs: list[str], prefix_tokens: int, max_tokens: int, rounds: int,
              num_threads: int | None) -> dict[str, dict[int, float]]:
    """Decode tokens/s per format and batch size, formats alternating within each round."""
    from agentd import LLM, SamplingParams
    from benchmarks.cpu_levers import decode_tok_s, prompts

    llms = {}
    for spec in specs:
        weights, _, prefill = spec.partition(":")
        llms[spec] = LLM(weights=weights, dtype="float32", kv_cache_memory="256MiB",
                         prefill_weights=prefill or "keep", num_threads=num_threads)
    _, batch = prompts(next(iter(llms.values())).tokenizer, prefix_tokens, max(BATCHES))
    for llm in llms.values():  # every prefix cached before any timing
        llm.generate(batch, SamplingParams(temperature=0, max_tokens=1))
    runs: dict[str, dict[int, list[float]]] = {s: {n: [] for n in BATCHES} for s in specs}
    for _ in range(rounds):
        for n in BATCHES:
            for spec, llm in llms.items():
                runs[spec][n].append(decode_tok_s(llm, batch[:n], max_tokens))
    return {s: {n: sorted(v)[len(v) // 2] for n, v in by_n.items()} for s, by_n in runs.items()}


def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def header(num_threads: int | None = None) -> list[str]:
    import torch

    from agentd.model.isa import detect_isa

    load = os.getloadavg()
    return [f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
            f"{num_threads or torch.get_num_threads()} threads; ISA {detect_isa().describe()}",
            f"ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '-')} "
            f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '-')}; "
            f"load avg {load[0]:.1f} on {os.cpu_count()} CPUs (the machine is shared)"]


def table(rows: list[dict[str, object]]) -> list[str]:
    out = ["| weights | load s | cold TTFT s | warm TTFT ms | decode tok/s b=1 | b=8 | b=32 | "
           "RSS MiB (peak) | kernels |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tok = r["decode_tok_s"]
        kernels = "; ".join(f"{k}: {v}" for k, v in r["compute"]["kernels"].items()) or \
            "oneDNN fp32 (exact mode)"
        out.append(f"| {r['label']} | {r['load_s']:.1f} | {r['cold_ttft_s']:.2f} | "
                   f"{1e3 * r['warm_ttft_s']:.0f} | {tok['1']:.1f} | {tok['8']:.1f} | "
                   f"{tok['32']:.1f} | {r['rss_mib']:.0f} ({r['peak_rss_mib']:.0f}) | {kernels} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", default=None)
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch threads per run (on a busy machine, 1 avoids OpenMP stalls)")
    parser.add_argument("--ab", action="store_true",
                        help="decode only, all formats in one process, alternating")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ab:
        print("\n".join(header(args.num_threads)), flush=True)
        medians = alternate(args.formats.split(","), args.prefix_tokens, args.max_tokens,
                            args.rounds, args.num_threads)
        print(f"| weights | decode tok/s b=1 | b=8 | b=32 | (medians of {args.rounds} "
              "alternating rounds) |\n|---|---|---|---|---|")
        for spec, by_n in medians.items():
            print(f"| {spec} | " + " | ".join(f"{by_n[n]:.1f}" for n in BATCHES) + " | |")
        print("\n".join(header(args.num_threads)[-1:]))
        return
    if args.child:
        print(json.dumps(one_format(args.child, args.prefix_tokens, args.max_tokens,
                                    args.num_threads)))
        return
    lines = header(args.num_threads)
    print("\n".join(lines), flush=True)
    rows = []
    for weights in args.formats.split(","):
        proc = subprocess.run([sys.executable, "-m", "benchmarks.weight_formats", "--child",
                               weights, "--prefix-tokens", str(args.prefix_tokens),
                               "--max-tokens", str(args.max_tokens),
                               *(["--num-threads", str(args.num_threads)]
                                 if args.num_threads else [])],
                              capture_output=True, text=True, check=False)
        if proc.returncode:
            print(f"{weights}: failed\n{proc.stderr[-2000:]}", flush=True)
            continue
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        row["label"] = weights if weights.startswith(row["weights"]) else \
            f"{weights} ({row['weights']})"
        rows.append(row)
        print(table([row])[-1], flush=True)
    lines += table(rows)
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header(args.num_threads), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
