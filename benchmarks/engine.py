"""Engine benchmark on the default model (SmolLM2-135M-Instruct), one run, one table.

    python benchmarks/engine.py [--decode-tokens 48] [--threads N] [--device auto] [--strict]

Measures, side by side in one process:
- prefill tokens/s: a cold 2,000-token prompt (the coding agent's system prompt) in one forward;
- TTFT of that prompt cold, and of a prompt that shares all but its last 30 tokens with it
  (whole blocks hit, so 32 tokens run);
- decode tokens/s at batch 1, 8 and 32 (distinct short chat prompts, greedy, ``ignore_eos``);
- transformers ``generate(do_sample=False)`` on the batch-1 prompts, one at a time.

Targets (the issue's): cached TTFT <= 1/10 of cold; batch-8 decode >= 4x batch-1 decode; our
batch-1 decode >= transformers'. The table is printed last; ``--strict`` exits 1 when a target is
missed. Speed depends on what else runs on the machine: the load average is printed with it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from importlib import resources

import torch

PREFIX_LEN = 2000
TAIL_LEN = 30
BATCHES = (1, 8, 32)
NUM_BATCH1_PROMPTS = 4  # batch 1 runs these one after another (and so does transformers)


@dataclass
class DecodeResult:
    batch: int
    decode_tokens_per_s: float  # median over decode steps (see ``decode_rate``)
    e2e_tokens_per_s: float  # all output tokens over the whole run, prefill included


@dataclass
class TtftResult:
    ttft_s: float
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclass
class RunTimes:
    """One generation run: the decode steps' (seconds, tokens), and the run's totals."""

    decode_steps: list[tuple[float, int]]
    total_s: float
    num_tokens: int


def decode_rate(runs: list[RunTimes]) -> float:
    """Decode tokens/s: the median over decode steps of (tokens in the step / step seconds).

    A decode step is one after every request of the run got its first token, so prefill never
    counts. The median, not the mean, so that a burst from another process on a shared machine
    does not decide the result; the e2e column (total tokens / total seconds) shows the mean.
    """
    return statistics.median(n / dt for run in runs for dt, n in run.decode_steps)


def e2e_rate(runs: list[RunTimes]) -> float:
    return sum(r.num_tokens for r in runs) / sum(r.total_s for r in runs)


def load_workload() -> dict:
    return json.loads(resources.files("agentd.workloads").joinpath("coding_agent.json").read_text())


def chat_prompts(tokenizer, turns: list[str]) -> list[list[int]]:
    """Short prompts: each user turn alone through the chat template."""
    return [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": turn}],
                                                    tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False).input_ids for turn in turns]


def run_ttft(engine, prompt_ids: list[int]) -> TtftResult:
    from agentd.engine.request import EngineRequest
    from agentd.engine.sampling_params import SamplingParams

    start = time.perf_counter()
    request_id = engine.add_request(
        EngineRequest(prompt_ids, SamplingParams(temperature=0.0, max_tokens=1)))
    num_cached = None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.request_id == request_id and delta.finished:
                num_cached = delta.num_cached_tokens
    return TtftResult(time.perf_counter() - start, len(prompt_ids), num_cached or 0)


def run_engine(engine, prompts: list[list[int]], num_tokens: int) -> RunTimes:
    """Run ``prompts`` as one batch, greedy, ``num_tokens`` each; time every step."""
    from agentd.engine.request import EngineRequest
    from agentd.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    start = last = time.perf_counter()
    for prompt in prompts:
        engine.add_request(EngineRequest(prompt, params))
    started: set[str] = set()
    decode_steps = []
    num_output = 0
    while engine.has_unfinished_requests():
        all_started = len(started) == len(prompts)
        deltas = engine.step()
        now = time.perf_counter()
        num_step = sum(len(d.token_ids) for d in deltas)
        if all_started:
            decode_steps.append((now - last, num_step))
        started.update(d.request_id for d in deltas if d.token_ids)
        num_output += num_step
        last = now
    assert num_output == num_tokens * len(prompts), "a request stopped early"
    return RunTimes(decode_steps, last - start, num_output)


class _TokenTimer:
    """A transformers streamer that notes when each new token arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())  # the first put is the prompt itself

    def end(self) -> None:
        pass


def run_transformers(model, prompt: list[int], num_tokens: int) -> RunTimes:
    timer = _TokenTimer()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=model.device), do_sample=False,
                             max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                             streamer=timer)
    end = time.perf_counter()
    assert out.shape[1] - len(prompt) == num_tokens == len(timer.times) - 1
    token_times = timer.times[1:]
    steps = [(b - a, 1) for a, b in zip(token_times, token_times[1:], strict=False)]
    return RunTimes(steps, end - start, num_tokens)


def default_threads() -> int:
    """Cores not already busy: OpenMP threads that share a core with another process spin-wait
    and can make a step many times slower than one thread would."""
    busy = round(os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0
    return max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) - busy))


def print_table(rows: list[tuple[str, str, str]], checks: list[tuple[str, str, str, bool]],
                header: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"agentd engine benchmark - {header}", title_justify="left")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    table.add_column("", justify="center")
    for name, value, note in rows:
        table.add_row(name, value, note, "")
    table.add_section()
    for name, value, target, ok in checks:
        table.add_row(name, value, target, "[green]PASS[/]" if ok else "[red]FAIL[/]")
    Console(width=110).print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads on CPU (default: the cores not already busy)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    torch.set_num_threads(args.threads or default_threads())

    import transformers

    from agentd.llm import LLM

    llm = LLM(device=args.device, kv_cache_memory="1GiB")
    engine, tokenizer = llm.engine, llm.tokenizer
    device = engine.loaded.device
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        engine.loaded.files.path, dtype=engine.loaded.dtype).to(device).eval()
    workload = load_workload()
    short = chat_prompts(tokenizer, workload["turns"][:max(BATCHES)])
    long_ids = tokenizer(workload["system"] + "\n\n" + "\n".join(workload["turns"])).input_ids
    cold_prompt = long_ids[:PREFIX_LEN]
    other_tail = tokenizer("\n\n" + workload["turns"][-1]).input_ids[:TAIL_LEN]
    warm_prompt = cold_prompt[:PREFIX_LEN - TAIL_LEN] + other_tail
    assert len(cold_prompt) == len(warm_prompt) == PREFIX_LEN

    print("warming up ...", file=sys.stderr)
    run_engine(engine, short[-1:], 4)
    run_transformers(hf_model, short[-1], 4)
    print("TTFT cold / cached ...", file=sys.stderr)
    cold = run_ttft(engine, cold_prompt)
    warm = run_ttft(engine, warm_prompt)
    print("batch 1, ours and transformers in turn ...", file=sys.stderr)
    ours_b1, hf_b1 = [], []
    for prompt in short[:NUM_BATCH1_PROMPTS]:  # interleaved, so both see the same machine
        ours_b1.append(run_engine(engine, [prompt], args.decode_tokens))
        hf_b1.append(run_transformers(hf_model, prompt, args.decode_tokens))
    decode = {1: DecodeResult(1, decode_rate(ours_b1), e2e_rate(ours_b1))}
    baseline = DecodeResult(1, decode_rate(hf_b1), e2e_rate(hf_b1))
    for batch in BATCHES[1:]:
        print(f"decode at batch {batch} ...", file=sys.stderr)
        runs = [run_engine(engine, short[:batch], args.decode_tokens)]
        decode[batch] = DecodeResult(batch, decode_rate(runs), e2e_rate(runs))

    prefill_tps = cold.num_prompt_tokens / cold.ttft_s
    ttft_ratio = warm.ttft_s / cold.ttft_s
    batch_ratio = decode[8].decode_tokens_per_s / decode[1].decode_tokens_per_s
    hf_ratio = decode[1].decode_tokens_per_s / baseline.decode_tokens_per_s
    rows = [
        (f"prefill, cold {PREFIX_LEN}-token prompt", f"{prefill_tps:,.0f} tok/s", ""),
        (f"TTFT cold ({cold.num_prompt_tokens} tokens, 0 cached)", f"{cold.ttft_s:.3f} s", ""),
        (f"TTFT cached ({warm.num_prompt_tokens} tokens, {warm.num_cached_tokens} cached)",
         f"{warm.ttft_s:.3f} s", ""),
        *[(f"decode, batch {b}", f"{decode[b].decode_tokens_per_s:,.1f} tok/s",
           f"e2e {decode[b].e2e_tokens_per_s:,.1f} tok/s") for b in BATCHES],
        ("transformers generate, batch 1, decode", f"{baseline.decode_tokens_per_s:,.1f} tok/s",
         f"e2e {baseline.e2e_tokens_per_s:,.1f} tok/s"),
        ("decode batch 32 / batch 1",
         f"{decode[32].decode_tokens_per_s / decode[1].decode_tokens_per_s:.2f}x", ""),
    ]
    checks = [
        ("TTFT cached / cold", f"{ttft_ratio:.3f}", "<= 0.100", ttft_ratio <= 0.1),
        ("decode batch 8 / batch 1", f"{batch_ratio:.2f}x", ">= 4.00x", batch_ratio >= 4.0),
        ("decode batch 1: ours / transformers", f"{hf_ratio:.2f}x", ">= 1.00x", hf_ratio >= 1.0),
    ]
    dtype = str(engine.loaded.dtype).removeprefix("torch.")
    header = (f"{engine.model_name}, {device.type}, {dtype}, {torch.get_num_threads()} threads, "
              f"{args.decode_tokens} tokens/request, load avg before the run {load_before:.1f}")
    print_table(rows, checks, header)
    return 1 if args.strict and not all(ok for *_, ok in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
