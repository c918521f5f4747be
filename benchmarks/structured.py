"""What constrained decoding costs and what jump-forward buys, on the default model, in-process.

Prints, from one run:
- first-request compile time of each packaged workload's tool-call grammar (``required`` and
  ``auto``) and the time of a cached hit;
- the constraint work per decoding step (masks filled and applied, matchers advanced, the
  closing estimate, jump-forward planned) at batch
  1, 8 and 32, beside the whole step's time, while every request of the batch writes a
  ``required`` tool call;
- tool-call output tokens/s with and without jump-forward, and the share of output tokens
  jump-forward appended without a decoding step.

    python benchmarks/structured.py [--requests 8] [--max-tokens 160]

A measurement, not a test. Runs alternate (with, without) so drift hits both alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

import torch

from agentd.chat import render_chat
from agentd.engine.request import EngineRequest
from agentd.engine.sampling_params import SamplingParams
from agentd.llm import LLM
from agentd.structured.compiler import GrammarCompiler
from agentd.structured.params import FunctionSpec, StructuredOutputsParams, ToolCallsSpec

WORKLOADS = ("coding_agent", "support_agent", "research_agent")


def load(name: str) -> dict[str, Any]:
    return json.loads(resources.files("agentd.workloads").joinpath(f"{name}.json").read_text())


def tool_params(tools: list[dict[str, Any]], mode: str) -> StructuredOutputsParams:
    functions = tuple(FunctionSpec.build(t["function"]["name"], t["function"]["parameters"])
                      for t in tools)
    return StructuredOutputsParams(tool_calls=ToolCallsSpec(functions, mode))  # type: ignore


def compile_times(llm: LLM) -> None:
    print("\ncompile time of the tools' grammar (s): first request / cached hit")
    engine = llm.engine
    for name in WORKLOADS:
        tools = load(name)["tools"]
        cells = []
        for mode in ("required", "auto"):
            compiler = GrammarCompiler(engine.tokenizer, engine.loaded.model.dims.vocab_size,
                                       engine.loaded.eos_token_ids)
            compiler.compile(StructuredOutputsParams(json_object=True))  # tokenizer info, once
            start = time.perf_counter()
            compiler.compile(tool_params(tools, mode))
            first = time.perf_counter() - start
            start = time.perf_counter()
            compiler.compile(tool_params(tools, mode))
            cells.append(f"{mode} {first:.3f} / {(time.perf_counter() - start) * 1e6:.0f} us")
        print(f"  {name:<15} {len(tools):>2} tools: " + ";  ".join(cells))


class StepClock:
    """Times the engine's steps and the constraint work inside them."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.steps: list[tuple[int, float, float]] = []  # (rows, step s, constraint s)
        self._constraint_s = 0.0
        # an upper bound: accept is also called inside apply for draft rows
        for name in ("apply", "accept", "needs_closing"):
            self._wrap(self.engine.structured, name)
        self._wrap(self.engine, "_jump_forward")

    def _wrap(self, owner: Any, name: str) -> None:
        original: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._constraint_s += time.perf_counter() - start

        setattr(owner, name, timed)

    def run(self, requests: list[tuple[list[int], SamplingParams]]) -> tuple[int, float]:
        """Run ``requests`` together; returns (output tokens, seconds)."""
        engine = self.engine
        for prompt, params in requests:
            engine.add_request(EngineRequest(prompt, params))
        num_tokens, start = 0, time.perf_counter()
        while engine.has_unfinished_requests():
            rows = engine.scheduler.num_running
            self._constraint_s = 0.0
            step_start = time.perf_counter()
            deltas = engine.step()
            self.steps.append((rows, time.perf_counter() - step_start, self._constraint_s))
            num_tokens += sum(len(d.token_ids) for d in deltas)
        return num_tokens, time.perf_counter() - start


def prompts(llm: LLM, name: str, count: int) -> list[list[int]]:
    data = load(name)
    return [render_chat(llm.tokenizer, [{"role": "system", "content": data["system"]},
                                        {"role": "user", "content": turn}],
                        data["tools"], "required").prompt_token_ids
            for turn in (data["turns"] * 4)[:count]]


def overhead(llm: LLM, max_tokens: int) -> None:
    print("\nconstraint work per decoding step (masks + matchers) vs the step, ms (median)")
    params = SamplingParams(temperature=0, max_tokens=max_tokens,
                            structured_outputs=tool_params(load("coding_agent")["tools"],
                                                           "required"))
    for batch in (1, 8, 32):
        clock = StepClock(llm.engine)
        clock.run([(p, params) for p in prompts(llm, "coding_agent", batch)])
        decode = [(s, c) for rows, s, c in clock.steps if rows == batch and c > 0]
        decode = decode[len(decode) // 4:] or decode  # skip the steps with prefill in them
        step = statistics.median(s for s, _ in decode) * 1e3
        work = statistics.median(c for _, c in decode) * 1e3
        print(f"  batch {batch:>2}: step {step:7.2f}  constraints {work:6.3f}  "
              f"({100 * work / step:4.1f}% of the step, {len(decode)} steps)")


def jump_forward(model: str | None, count: int, max_tokens: int, rounds: int) -> None:
    print(f"\ntool-call output tokens/s, {count} required calls at once per workload "
          f"(fresh engine each; {rounds} alternating rounds, best)")
    for name in WORKLOADS:
        best: dict[bool, tuple[float, float]] = {}
        for _ in range(rounds):
            for jump in (True, False):
                llm = LLM(model, jump_forward=jump)
                params = SamplingParams(temperature=0, max_tokens=max_tokens,
                                        structured_outputs=tool_params(load(name)["tools"],
                                                                       "required"))
                batch = prompts(llm, name, count)
                llm.generate(batch[:1], params)  # compile + cache the prefix
                clock = StepClock(llm.engine)
                tokens, seconds = clock.run([(p, params) for p in batch])
                skipped = llm.engine.stats().num_jump_forward_tokens
                rate = tokens / seconds
                if jump not in best or rate > best[jump][0]:
                    best[jump] = (rate, skipped / max(tokens, 1))
        (on, share), (off, _) = best[True], best[False]
        print(f"  {name:<15} with {on:6.1f}  without {off:6.1f}  ({on / off:.2f}x); "
              f"{100 * share:.0f}% of output tokens jumped")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    import subprocess

    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f} " in flags]
    print(f"CPU flags: {', '.join(isa)}; capability {torch.backends.cpu.get_cpu_capability()}; "
          f"{torch.get_num_threads()} threads")
    llm = LLM(args.model)
    compile_times(llm)
    overhead(llm, args.max_tokens)
    jump_forward(args.model, args.requests, args.max_tokens, args.rounds)


if __name__ == "__main__":
    main()
