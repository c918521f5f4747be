"""What each CPU speed lever buys, measured side by side in one run on the default model.

Rows: decode over a long shared prefix (the agent case) with the plain reference decode attention
(gathers every row's whole context) vs the grouped path (a shared prefix gathered once); cold
prefill of a ~2,000-token prompt with masked vs plain-causal attention; float32 vs bfloat16; and
linear layers through torch's ``F.linear`` (MKL) vs oneDNN with packed weights (the default).

    python benchmarks/cpu_levers.py [--batch 8] [--prefix-tokens 2000] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from importlib import resources

import torch

from agentd import LLM, SamplingParams
from agentd.kernels import backend as kernel_backend
from agentd.kernels.decode_attention import reference_decode_attention
from agentd.kernels.kv_write import reference_write_kv
from agentd.kernels.prefill_attention import gather_kv


def masked_prefill(query, kv_cache, block_tables, query_start_loc, seq_lens, scale):
    """The first CPU prefill: an explicit causal mask even when there is no cached prefix."""
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        keys, values = gather_kv(kv_cache, block_tables[i].long(), seq_len)
        q_pos = torch.arange(seq_len - (end - start), seq_len)
        mask = torch.arange(seq_len)[None, :] <= q_pos[:, None]
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(
            query[start:end].transpose(0, 1)[None], keys.transpose(0, 1)[None].to(query.dtype),
            values.transpose(0, 1)[None].to(query.dtype), attn_mask=mask[None, None],
            scale=scale, enable_gqa=True)[0].transpose(0, 1)
    return out


REFERENCE = kernel_backend.AttentionBackend(
    "reference", reference_write_kv, reference_decode_attention, masked_prefill)


def prompts(tokenizer, prefix_tokens: int, batch: int) -> tuple[list[int], list[list[int]]]:
    workload = json.loads(resources.files("agentd.workloads").joinpath("coding_agent.json")
                          .read_text())
    prefix = tokenizer(workload["system"]).input_ids[:prefix_tokens]
    turns = [tokenizer(t).input_ids[:30] for t in workload["turns"][:batch]]
    return prefix, [prefix + t for t in turns]


def decode_tok_s(llm: LLM, batch_prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(batch_prompts, SamplingParams(temperature=0, max_tokens=1))  # warm the prefix
    start = time.perf_counter()
    llm.generate(batch_prompts, params)
    return len(batch_prompts) * max_tokens / (time.perf_counter() - start)


_FIRST_TOKENS = itertools.count(1000)


def cold_ttft_s(llm: LLM, prefix: list[int], repeats: int = 3) -> float:
    """Median time to prefill ``prefix`` behind a first token never used before (no cache hit)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate([[next(_FIRST_TOKENS)] + prefix], SamplingParams(temperature=0, max_tokens=1))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    rows = []
    linear_rows = []
    for cpu_linear in ("torch", "onednn"):
        llm = LLM(cpu_linear=cpu_linear, kv_cache_memory="1GiB")
        prefix, batch = prompts(llm.tokenizer, args.prefix_tokens, args.batch)
        linear_rows.append((cpu_linear, decode_tok_s(llm, batch[:1], args.max_tokens),
                            decode_tok_s(llm, batch, args.max_tokens), cold_ttft_s(llm, prefix)))
        del llm
    for dtype in ("float32", "bfloat16"):
        llm = LLM(dtype=dtype, kv_cache_memory="1GiB")
        prefix, batch = prompts(llm.tokenizer, args.prefix_tokens, args.batch)
        runner = llm.engine.runner
        grouped = runner.backend
        runner.backend = REFERENCE
        ref_decode = decode_tok_s(llm, batch, args.max_tokens)
        ref_cold = cold_ttft_s(llm, prefix)
        runner.backend = grouped
        new_decode = decode_tok_s(llm, batch, args.max_tokens)
        new_cold = cold_ttft_s(llm, prefix)
        rows.append((dtype, ref_decode, new_decode, ref_cold, new_cold))
        del llm
    print(f"\nSmolLM2-135M, {torch.get_num_threads()} threads, batch {args.batch}, "
          f"{args.prefix_tokens}-token shared prefix, {args.max_tokens} output tokens")
    print(f"{'dtype':9} {'decode ref':>11} {'decode grp':>11} {'ratio':>6} "
          f"{'cold ref s':>11} {'cold new s':>11} {'ratio':>6}")
    for dtype, ref_decode, new_decode, ref_cold, new_cold in rows:
        print(f"{dtype:9} {ref_decode:11.1f} {new_decode:11.1f} {new_decode / ref_decode:6.2f} "
              f"{ref_cold:11.2f} {new_cold:11.2f} {ref_cold / new_cold:6.2f}")
    print(f"bfloat16 / float32 decode tok/s: {rows[1][2] / rows[0][2]:.2f}x; "
          f"cold TTFT: {rows[0][4] / rows[1][4]:.2f}x faster")
    print(f"\n{'linear':9} {'decode b=1':>11} {'decode b=' + str(args.batch):>11} "
          f"{'cold s':>8}   (float32)")
    for name, one, many, cold in linear_rows:
        print(f"{name:9} {one:11.1f} {many:11.1f} {cold:8.2f}")
    (_, one0, many0, cold0), (_, one1, many1, cold1) = linear_rows
    print(f"onednn / torch: decode b=1 {one1 / one0:.2f}x, b={args.batch} {many1 / many0:.2f}x, "
          f"cold TTFT {cold0 / cold1:.2f}x faster")


if __name__ == "__main__":
    main()
