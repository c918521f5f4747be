"""A conversation continued with ``previous_response_id`` vs the same conversation resent whole.

Starts ``agentd start`` (default model unless ``--daemon-args`` says otherwise) on a free port
and runs one agent conversation (the research_agent workload's system prompt and tools, then
``--turns`` user turns) over the Responses API two ways, alternating, each repetition with a
cache salt of its own so neither arm warms the other's cache:

- *continued*: each turn sends only the new user message and ``previous_response_id``; the
  prompt is the stored token ids plus the new turn;
- *resent*: each turn sends the whole conversation so far (``store: false``, as Codex does),
  its earlier replies as output items, re-rendered by the template.

Prints, per turn, the prompt tokens, the cached tokens and the TTFT (first streamed event with
text or a call) of each arm (medians over ``--reps``), with the machine's CPU flags and torch's
CPU capability. Run on a busy machine, the TTFTs are noisy; the cached tokens are not.

    python benchmarks/responses_continuation.py
    python benchmarks/responses_continuation.py --turns 6 --reps 3
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

import openai
import torch

from agentd.bench.spawn import SpawnedDaemon

QUESTIONS = ["Find recent work on KV cache compression.", "Which of those is the newest?",
             "Summarise its main idea in two sentences.", "What are its limitations?",
             "Is there code for it?", "Write a one-line citation for it.",
             "Any follow-up work?", "Thanks. One more summary, please."]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-output-tokens", type=int, default=48)
    parser.add_argument("--daemon-args", default="", help="more `agentd start` options")
    return parser.parse_args()


def timed_turn(client: openai.OpenAI, body: dict[str, Any]) -> tuple[Any, float | None]:
    started = time.perf_counter()
    ttft = None
    final = None
    for event in client.responses.create(**body, stream=True):
        if ttft is None and event.type in ("response.output_text.delta",
                                           "response.function_call_arguments.delta"):
            ttft = time.perf_counter() - started
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert final is not None, "the stream ended without a response"
    return final, ttft


def conversation(client: openai.OpenAI, model: str, workload: dict[str, Any], salt: str,
                 continued: bool, args: argparse.Namespace) -> list[tuple[int, int, float]]:
    tools = [{"type": "function", **t["function"]} for t in workload["tools"]]
    base = {"model": model, "instructions": workload["system"], "tools": tools,
            "tool_choice": "none", "temperature": 0, "max_output_tokens": args.max_output_tokens,
            "extra_body": {"cache_salt": salt}}
    history: list[Any] = []
    previous = None
    rows = []
    for question in QUESTIONS[:args.turns]:
        turn = {"role": "user", "content": question}
        if continued:
            body = {**base, "input": [turn], "store": True,
                    **({"previous_response_id": previous.id} if previous else {})}
        else:
            history.append(turn)
            body = {**base, "input": list(history), "store": False}
        previous, ttft = timed_turn(client, body)
        history += [item.model_dump(exclude_none=True) for item in previous.output]
        usage = previous.usage
        rows.append((usage.input_tokens, usage.input_tokens_details.cached_tokens, ttft or 0.0))
    return rows


def main() -> None:
    args = parse_args()
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    print(next((line for line in flags.splitlines() if line.startswith("Flags")), "Flags: ?"))
    print(f"torch CPU capability: {torch.backends.cpu.get_cpu_capability()}")
    workload = json.loads(resources.files("agentd.workloads")
                          .joinpath("research_agent.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        daemon = SpawnedDaemon(Path(tmp) / "state", "--log-level", "warning",
                               *shlex.split(args.daemon_args))
        daemon.start()
        try:
            client = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="unused", timeout=900,
                                   max_retries=0)
            model = client.models.list().data[0].id
            client.responses.create(model=model, input="hi", max_output_tokens=2, store=False)
            runs: dict[str, list[list[tuple[int, int, float]]]] = {"continued": [], "resent": []}
            for rep in range(args.reps):
                for arm in ("continued", "resent") if rep % 2 == 0 else ("resent", "continued"):
                    runs[arm].append(conversation(client, model, workload, f"{arm}-{rep}",
                                                  arm == "continued", args))
        finally:
            daemon.stop()
    print(f"{'turn':>4} | {'continued: prompt':>17} {'cached':>7} {'TTFT s':>7} | "
          f"{'resent: prompt':>14} {'cached':>7} {'TTFT s':>7}")
    for turn in range(args.turns):
        cells = []
        for arm in ("continued", "resent"):
            rows = [run[turn] for run in runs[arm]]
            prompt = statistics.median(r[0] for r in rows)
            cached = statistics.median(r[1] for r in rows)
            ttft = statistics.median(r[2] for r in rows)
            cells.append(f"{prompt:>{17 if arm == 'continued' else 14}.0f} {cached:>7.0f} "
                         f"{ttft:>7.3f}")
        print(f"{turn + 1:>4} | {cells[0]} | {cells[1]}")


if __name__ == "__main__":
    main()
