"""Prompt-lookup speculative decoding on the default model: tokens/s at c=1 with it and without.

    python benchmarks/spec_decode.py [--requests 6] [--max-tokens 128] [--threads N]
        [--workloads code_edit_agent coding_agent ...]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/spec_decode.py

One process, one copy of the weights: two engines share the loaded model, one with the default
``--speculative ngram`` settings and one with ``--speculative off``. For each packaged workload
(trimmed to 2,100 prompt tokens like ``agentd bench``), each request (system + tools + a distinct
user turn, greedy, up to ``--max-tokens``, stopping at EOS) runs on both engines one after the
other, alternating which goes first, one request at a time (c=1), after a warm-up request that
puts the workload's prefix in each engine's cache. Per workload it prints decode tokens/s (the
output tokens after the first over the time from the first to the last), end-to-end tokens/s
(prefill included), their ratio on/off, the share of draft tokens accepted, output tokens per
step, and whether the two engines produced the same tokens (they must: greedy). Targets: >= 2x
on code_edit_agent, >= 0.95x on the others. Prints the CPU's ISA flags and torch's capability.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from dataclasses import dataclass

import torch

from agentd.bench.machine import cpu_line
from agentd.bench.workload import (
    PACKAGED,
    Namespace,
    Prompts,
    load_workload,
    packaged_path,
    trim_to_budget,
)
from agentd.chat import render_chat
from agentd.config import EngineConfig, SpeculativeConfig
from agentd.engine.llm_engine import LLMEngine
from agentd.engine.request import EngineRequest
from agentd.engine.sampling_params import SamplingParams
from agentd.model.build import load_model


@dataclass
class Timing:
    num_tokens: int = 0
    decode_s: float = 0.0  # first token to last, summed over requests
    total_s: float = 0.0  # arrival to last token
    num_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def add(self, other: Timing) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def default_threads() -> int:
    """Cores not already busy: an OpenMP thread that shares a core with another process
    spin-waits, and a step can take many times longer than on one thread."""
    busy = round(os.getloadavg()[0])
    return max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) - busy))


def run_one(engine: LLMEngine, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], Timing]:
    before = engine.stats()
    start = time.perf_counter()
    engine.add_request(EngineRequest(prompt_ids,
                                     SamplingParams(temperature=0.0, max_tokens=max_tokens)))
    tokens: list[int] = []
    first = last = start
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.token_ids and not tokens:
                first = time.perf_counter()
            tokens.extend(delta.token_ids)
        last = time.perf_counter()
    after = engine.stats()
    return tokens, Timing(
        num_tokens=len(tokens), decode_s=last - first, total_s=last - start,
        num_steps=after.totals.num_steps - before.totals.num_steps,
        num_draft_tokens=after.spec.num_draft_tokens - before.spec.num_draft_tokens,
        num_accepted_tokens=after.spec.num_accepted_tokens - before.spec.num_accepted_tokens)


def workload_prompts(name: str, tokenizer, num_requests: int) -> list[list[int]]:
    workload = trim_to_budget(load_workload(packaged_path(name)), tokenizer, 2100)
    prompts = Prompts(workload)
    rendered = []
    for _ in range(num_requests + 1):  # the first is the warm-up
        messages, tools = prompts.single_turn(Namespace())
        rendered.append(render_chat(tokenizer, messages, tools or None).prompt_token_ids)
    return rendered


def bench_workload(engines: dict[str, LLMEngine], prompts: list[list[int]],
                   max_tokens: int) -> tuple[dict[str, Timing], int]:
    for engine in engines.values():
        run_one(engine, prompts[0], 4)
    totals = {name: Timing() for name in engines}
    num_same = 0
    for index, prompt in enumerate(prompts[1:]):
        order = list(engines) if index % 2 == 0 else list(reversed(engines))
        outputs = {}
        for name in order:
            outputs[name], timing = run_one(engines[name], prompt, max_tokens)
            totals[name].add(timing)
        num_same += outputs["ngram"] == outputs["off"]
    return totals, num_same


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=6, help="requests per workload")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: the cores not already busy)")
    parser.add_argument("--workloads", nargs="*", default=list(PACKAGED))
    args = parser.parse_args(argv)
    config = EngineConfig(device="cpu", dtype="float32",
                          num_threads=args.threads or default_threads())
    loaded = load_model(config)
    engines = {"ngram": LLMEngine(config, loaded),
               "off": LLMEngine(dataclasses.replace(
                   config, speculative=SpeculativeConfig(method="off")), loaded)}
    print(cpu_line(), flush=True)
    print(f"default settings: {config.speculative}", flush=True)
    header = (f"{'workload':<16} {'decode tok/s on':>15} {'off':>7} {'ratio':>6} "
              f"{'e2e on':>7} {'off':>7} {'ratio':>6} {'accepted':>8} {'tok/step':>8} "
              f"{'same':>5}")
    lines = [header]
    for name in args.workloads:
        prompts = workload_prompts(name, loaded.tokenizer, args.requests)
        totals, num_same = bench_workload(engines, prompts, args.max_tokens)
        on, off = totals["ngram"], totals["off"]
        decode_on, decode_off = (on.num_tokens - args.requests) / on.decode_s, \
            (off.num_tokens - args.requests) / off.decode_s
        e2e_on, e2e_off = on.num_tokens / on.total_s, off.num_tokens / off.total_s
        accepted = on.num_accepted_tokens / max(on.num_draft_tokens, 1)
        lines.append(f"{name:<16} {decode_on:>15.1f} {decode_off:>7.1f} "
                     f"{decode_on / decode_off:>5.2f}x {e2e_on:>7.1f} {e2e_off:>7.1f} "
                     f"{e2e_on / e2e_off:>5.2f}x {accepted:>8.0%} "
                     f"{on.num_tokens / on.num_steps:>8.2f} {num_same:>2}/{args.requests}")
        print(lines[-1], f"({on.num_tokens} tokens on, {off.num_tokens} off)", flush=True)
    print("\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
