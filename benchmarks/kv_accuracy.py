"""What a narrower KV cache costs in accuracy, on a model's real next-token distributions.

One model loaded once, three pools over it (float32, float16, q8_0): each prefills the same
prompt, then the last ``--eval`` positions run teacher-forced (chunks of 64 rows, every row's
logits kept), and the distributions are compared position by position: KL divergence
(mean, 99th percentile, max, in nats) and top-1 agreement, of float16 and q8_0 against float32
and of q8_0 against float16. The prompt is agent text (the workloads' system prompts and tool
schemas, then the repository's docs), cut to each ``--tokens`` length.

Every pool's prefill attention takes its products in fp32 here (``AGENTD_PREFILL_BF16=0``);
``--bf16`` adds the float16 and q8_0 pools again with them in bfloat16 (the default on CPUs with
AVX512-BF16), each against float32 and against its own pool's fp32 products.

    .venv/bin/python benchmarks/kv_accuracy.py [--model GGUF] [--tokens 2048,8192] [--eval 256]
        [--bf16]

Without ``--model``: the default model (SmolLM2-135M-Instruct, as served: its GGUF's weights).
A random-weight GGUF (agentd.model.synth) gives the arithmetic, not a language model's
distributions: its figures are not an accuracy claim.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import torch

from agentd.bench.machine import cpu_line
from agentd.engine.llm_engine import LLMEngine
from agentd.engine.scheduler import ScheduledRequest
from agentd.kernels.cpu.fused import BF16_ENV
from agentd.llm import engine_config

ROOT = Path(__file__).resolve().parent.parent
POOLS = ("float32", "float16", "q8_0")
EVAL_CHUNK = 64


def agent_text() -> str:
    parts = [p.read_text() for p in sorted((ROOT / "agentd" / "workloads").glob("*.json"))]
    parts += [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))]
    parts.append((ROOT / "README.md").read_text())
    return "\n\n".join(parts)


def teacher_forced_logits(engine: LLMEngine, tokens: list[int], num_eval: int) -> torch.Tensor:
    """Logits [num_eval, vocab] after each of the last num_eval tokens' predecessors."""
    runner, block = engine.runner, engine.config.block_size
    table = list(range(math.ceil(len(tokens) / block)))
    if len(table) > engine.num_blocks:
        raise SystemExit(f"the pool holds {engine.num_blocks} blocks, {len(table)} needed")
    pos, first_eval = 0, len(tokens) - num_eval
    while pos < first_eval:
        n = min(engine.config.max_num_batched_tokens, first_eval - pos)
        runner.execute([ScheduledRequest("r", tokens[pos:pos + n], pos, table, False)])
        pos += n
    out = []
    while pos < len(tokens):  # each row's logits: the chunk's tokens as "drafts"
        n = min(EVAL_CHUNK, len(tokens) - pos)
        result = runner.execute([ScheduledRequest("r", tokens[pos - 1:pos - 1 + n], pos - 1,
                                                  table, True, num_draft_tokens=n - 1)])
        out.append(result.logits.float())
        pos += n
    return torch.cat(out)


def compare(ref: torch.Tensor, other: torch.Tensor) -> dict[str, float]:
    log_p, log_q = torch.log_softmax(ref, -1), torch.log_softmax(other, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return {"kl_mean": kl.mean().item(), "kl_p99": kl.quantile(0.99).item(),
            "kl_max": kl.max().item(),
            "top1": (ref.argmax(-1) == other.argmax(-1)).float().mean().item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF or model dir [default model]")
    parser.add_argument("--tokens", default="2048,8192", help="prompt lengths, comma-separated")
    parser.add_argument("--eval", type=int, default=256, help="positions compared per length")
    parser.add_argument("--bf16", action="store_true",
                        help="also the float16 and q8_0 pools with bfloat16 prefill products")
    args = parser.parse_args()
    lengths = [int(x) for x in args.tokens.split(",")]
    longest = max(lengths)
    print(cpu_line())
    engines: dict[str, LLMEngine] = {}
    for name in POOLS:
        config = engine_config(args.model, kv_cache_dtype=name, max_model_len=longest,
                               kv_cache_memory_bytes=None, max_num_seqs=1,
                               kv_disk_dir=None, enable_prefix_caching=False)
        loaded = next(iter(engines.values())).loaded if engines else None
        engines[name] = LLMEngine(config, loaded=loaded)
    tokenizer = engines["float32"].tokenizer
    text_ids = tokenizer.encode(agent_text())
    while len(text_ids) < longest:
        text_ids = text_ids + text_ids
    print(f"model {engines['float32'].model_name}; {len(text_ids):,} tokens of agent text; "
          f"pools: " + ", ".join(f"{n} {e.kv_plan.num_tokens:,} tokens" for n, e in
                                 engines.items()))
    runs = [(name, name, "0") for name in POOLS]  # (label, pool, AGENTD_PREFILL_BF16)
    pairs = [("float32", "float16"), ("float32", "q8_0"), ("float16", "q8_0")]
    if args.bf16:
        runs += [(f"{name}+bf16", name, "1") for name in POOLS[1:]]
        pairs += [(ref, f"{name}+bf16") for name in POOLS[1:] for ref in ("float32", name)]
    print("| tokens | compared | KL mean | KL p99 | KL max | top-1 agreement |")
    print("|---|---|---|---|---|---|")
    for length in lengths:
        tokens = text_ids[:length]
        logits = {}
        for label, pool, bf16 in runs:
            os.environ[BF16_ENV] = bf16
            started = time.perf_counter()
            logits[label] = teacher_forced_logits(engines[pool], tokens, args.eval)
            print(f"<!-- {label}, {length:,} tokens: {time.perf_counter() - started:.1f} s -->")
        for ref, other in pairs:
            c = compare(logits[ref], logits[other])
            print(f"| {length:,} | {other} vs {ref} | {c['kl_mean']:.2e} | {c['kl_p99']:.2e} | "
                  f"{c['kl_max']:.2e} | {c['top1']:.2%} |", flush=True)


if __name__ == "__main__":
    main()
