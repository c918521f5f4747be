"""What retention buys under cache pressure: TTFT of a conversation whose prefix was retained
(``prompt_cache_retention: "24h"``) vs one of the same size that was not, both continued after
other traffic has pushed the pool's unheld blocks out.

Starts ``agentd start`` on a free port with a small pool (``--daemon-args``), opens two
conversations on equally long system prompts (agent Alpha retained, agent Bravo not), then for
each round sends two long unrelated prompts (the pressure) and continues both conversations,
alternating which goes first. Prints each continuation's TTFT and cached prompt tokens, the
medians and their ratio, with the CPU's flags and torch's capability (the machine may be
shared: the two are measured side by side in one run).

    python benchmarks/retention.py
    python benchmarks/retention.py --rounds 5 --daemon-args "--kv-cache-memory 96MiB"
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

import httpx

from agentd.bench.spawn import SpawnedDaemon


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--daemon-args", default="--kv-cache-memory 96MiB",
                        help="`agentd start` options [default: a pool of 2,176 tokens of the "
                             "default model, so two long prompts evict what is not held]")
    return parser.parse_args()


def cpu_line() -> str:
    import torch

    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    line = next((x for x in flags.splitlines() if x.startswith("Flags:")), "Flags: ?")
    wanted = [f for f in line.split()[1:] if f.startswith(("avx", "amx", "fma", "f16c"))]
    return (f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
            f"lscpu flags: {' '.join(wanted)}")


def messages(agent: str, turns: list[str]) -> list[dict[str, str]]:
    system = json.loads(resources.files("agentd.workloads").joinpath(
        "research_agent.json").read_text())["system"]
    out = [{"role": "system", "content": f"You are agent {agent}. {system}"}]
    out += [{"role": "user" if i % 2 == 0 else "assistant", "content": text}
            for i, text in enumerate(turns)]
    return out


def send(url: str, body: dict[str, Any]) -> tuple[float, int, int]:
    """One streamed greedy request: (TTFT s, cached prompt tokens, prompt tokens)."""
    body = {**body, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    ttft, usage = None, {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - started
            usage = chunk.get("usage") or usage
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return ttft if ttft is not None else time.perf_counter() - started, cached, \
        usage["prompt_tokens"]


def main() -> None:
    args = parse_args()
    print(cpu_line())
    turns = ["Which sources cover the 1918 flu?"]
    with tempfile.TemporaryDirectory(prefix="agentd-retention-") as tmp:
        # --no-kv-disk: the pool's retention alone, not the disk tier under it
        daemon = SpawnedDaemon(Path(tmp) / "state", "--log-level", "warning", "--no-kv-disk",
                               *shlex.split(args.daemon_args), ready_timeout_s=900)
        try:
            daemon.start()
            send(daemon.url, {"messages": messages("Alpha", turns),
                              "prompt_cache_retention": "24h"})
            send(daemon.url, {"messages": messages("Bravo", turns)})
            filler = " ".join(f"item{i}" for i in range(320))  # ~1,200 tokens
            ttfts: dict[str, list[float]] = {"retained": [], "unmarked": []}
            print(f"{'round':>5} {'conversation':>13} {'TTFT ms':>8} {'cached':>7} {'prompt':>7}")
            for r in range(args.rounds):
                for i in range(2):
                    send(daemon.url, {"messages": [{"role": "user",
                                                    "content": f"{r} {i} {filler}"}]})
                later = [*turns, "Three of them.", f"Name them ({r})."]
                order = [("retained", "Alpha"), ("unmarked", "Bravo")]
                for label, agent in order if r % 2 == 0 else order[::-1]:
                    extra = {"prompt_cache_retention": "24h"} if label == "retained" else {}
                    ttft, cached, num_prompt = send(daemon.url, {
                        "messages": messages(agent, later), **extra})
                    ttfts[label].append(ttft)
                    print(f"{r:>5} {label:>13} {1000 * ttft:8.0f} {cached:7d} {num_prompt:7d}")
            held, lost = (statistics.median(ttfts[k]) for k in ("retained", "unmarked"))
            print(f"median TTFT after pressure: retained {1000 * held:.0f} ms, unmarked "
                  f"{1000 * lost:.0f} ms ({lost / held:.1f}x)")
        finally:
            daemon.stop()


if __name__ == "__main__":
    main()
