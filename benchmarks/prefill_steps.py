"""How a prefill step's time grows with its depth in the prompt: the scheduler's attention cost.

Runs one long prompt through the engine in fixed chunks (``--chunk`` rows a step, the
scheduler's attention weighting off), times every step, and fits ``t = a + b * p`` (p: the
chunk's start position). ``a / b`` is the context length at which a row's attention costs what
its linear layers do, measured; the engine's estimate from the model's shape
(``agentd.engine.llm_engine.attention_context``) is printed beside it, and their ratio is
``ATTENTION_SLOWDOWN`` for this machine. Then the same prompt with the weighting on: the steps'
times should stay flat.

    .venv/bin/python benchmarks/prefill_steps.py [--tokens 16384] [--chunk 256]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

from agentd.bench.machine import cpu_line
from agentd.config import EngineConfig
from agentd.engine.llm_engine import LLMEngine, attention_context
from agentd.engine.request import EngineRequest
from agentd.engine.sampling_params import SamplingParams
from agentd.model.build import load_model


def steps(engine: LLMEngine, tokens: list[int]) -> list[tuple[int, int, float]]:
    """(start position, rows, seconds) of every step of ``tokens``'s prefill."""
    engine.add_request(EngineRequest(tokens, SamplingParams(max_tokens=1)))
    timed = []
    while engine.scheduler.has_unfinished():
        scheduled = engine.scheduler.running[0].num_computed_tokens \
            if engine.scheduler.running else 0
        started = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - started
        done = engine.scheduler.running[0].num_computed_tokens \
            if engine.scheduler.running else len(tokens)
        timed.append((scheduled, done - scheduled, elapsed))
    return timed


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``y = a + b x``."""
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF or HF folder (default model)")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--chunk", type=int, default=256)
    args = parser.parse_args()
    config = EngineConfig(model=args.model, device="cpu", long_prefill_chunk=args.chunk,
                          max_num_batched_tokens=max(2048, args.chunk),
                          max_model_len=args.tokens + 64, enable_prefix_caching=False,
                          max_num_seqs=1)
    loaded = load_model(config)
    print(cpu_line(), flush=True)
    rng = random.Random(0)
    tokens = [rng.randrange(100, loaded.tokenizer.vocab_size - 100) for _ in range(args.tokens)]
    engine = LLMEngine(config, loaded)
    estimate = engine.scheduler.attention_context
    engine.scheduler.attention_context = None
    steps(engine, tokens[:args.chunk * 2])  # warm up
    fixed = steps(engine, tokens)
    full = [(p, t) for p, n, t in fixed if n == args.chunk]
    a, b = fit(full)
    measured = a / b
    total = sum(t for _, _, t in fixed)
    print(f"fixed chunks of {args.chunk}: {len(fixed)} steps, {total:.1f} s; step at 0: "
          f"{a:.3f} s, +{b * 1000:.3f} s per 1,000 tokens of depth")
    print(f"attention_context measured {measured:,.0f} tokens; from the shape "
          f"{attention_context(loaded.model.dims):,.0f} (with ATTENTION_SLOWDOWN "
          f"{estimate:,.0f}); slowdown here {attention_context(loaded.model.dims) / measured:.2f}")
    for depth in (0, args.tokens // 4, args.tokens // 2, args.tokens - args.chunk):
        near = [t for p, n, t in fixed if abs(p - depth) <= args.chunk and n == args.chunk]
        if near:
            print(f"  chunk at {depth:>6}: {statistics.median(near):.3f} s")
    engine = LLMEngine(dataclasses.replace(config), loaded)
    weighted = steps(engine, tokens)
    total_w = sum(t for _, _, t in weighted)
    times = [t for _, _, t in weighted[:-1]]
    print(f"weighted (attention_context {engine.scheduler.attention_context:,.0f}): "
          f"{len(weighted)} steps, {total_w:.1f} s ({total_w / total:.2f}x the fixed chunks); "
          f"step median {statistics.median(times):.3f} s, max {max(times):.3f} s, last rows "
          f"{weighted[-2][1]}")


if __name__ == "__main__":
    main()
