"""Replicas behind SMG: cache_aware against round_robin, and what the router adds to a request.

For each policy it runs ``agentd cluster start`` (``--replicas`` daemons of the default model,
SMG in front) in a fresh directory, then ``--agents`` agents at once, each its own system prompt
(the packaged workloads' prompts, each with an agent number on its first line when there are
more agents than workloads) sending ``--turns`` turns one after another, streamed. It prints,
per policy, the prefix-cache hit rate over both replicas (their own ``/v1/stats``), the TTFT
p50/p90 of the turns after each agent's first (warm, where the routing kept the prefix), the
cold first turns' TTFT and the requests each replica served. Last, the
router's added latency: a tiny warm request's TTFT straight to a replica and through the
router, alternated, medians.

    python benchmarks/cluster.py                      # 8 agents, 6 turns, 2 replicas
    python benchmarks/cluster.py --agents 4 --turns 4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from agentd.bench.workload import load_workload, opening_turns, packaged_path

MODEL = "SmolLM2-135M-Instruct"
WORKLOADS = ("coding_agent", "support_agent", "research_agent", "code_edit_agent")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--port", type=int, default=18700)
    parser.add_argument("--replica-args", default="--kv-cache-memory 512MiB --log-level warning")
    parser.add_argument("--router-args", default="", help="more `smg launch` options")
    parser.add_argument("--policies", default="cache_aware,round_robin")
    return parser.parse_args()


def agents(num_agents: int, num_turns: int) -> list[tuple[str, list[str]]]:
    out = []
    for i in range(num_agents):
        data = load_workload(packaged_path(WORKLOADS[i % len(WORKLOADS)]))
        system = data.system if i < len(WORKLOADS) else f"Agent {i}.\n{data.system}"
        out.append((system, opening_turns(data, num_turns)))
    return out


def ttft(client: openai.OpenAI, system: str, user: str, max_tokens: int = 8) -> float:
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=max_tokens, stream=True,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}])
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
    return first if first is not None else time.perf_counter() - start


def cluster(*args: str, root: Path) -> str:
    command, *rest = args  # the cluster dir before any `--` (what follows goes to replicas)
    done = subprocess.run([sys.executable, "-m", "agentd.cli", "cluster", command,
                           "--cluster-dir", str(root), *rest], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stdout + done.stderr)
    return done.stdout


def run_policy(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"agentd-cluster-{policy}-"))
    cluster("start", "--replicas", str(args.replicas), "--port", str(args.port), "--policy",
            policy, "--router-args", args.router_args, "--", *args.replica_args.split(),
            root=root)
    try:
        state = json.loads((root / "cluster.json").read_text())
        replicas = [r["url"] for r in state["replicas"]]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="x",
                               max_retries=0, timeout=600)
        cold, warm = [], []
        lock = threading.Lock()

        def agent(system: str, turns: list[str]) -> None:
            times = [ttft(client, system, turn) for turn in turns]
            with lock:
                cold.append(times[0])
                warm.extend(times[1:])

        start = time.perf_counter()
        threads = [threading.Thread(target=agent, args=a) for a in agents(args.agents,
                                                                           args.turns)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        stats = [httpx.get(f"{u}/v1/stats").json() for u in replicas]
        hits = sum(s["prefix_cache_hits"] for s in stats)
        queries = sum(s["prefix_cache_queries"] for s in stats)
        warm.sort()
        return {"policy": policy, "hit_rate": hits / queries, "wall_s": wall,
                "warm_p50": statistics.median(warm), "warm_p90": warm[int(0.9 * len(warm))],
                "cold_p50": statistics.median(cold),
                "per_replica": [s["num_requests_finished"] for s in stats],
                "router_latency": router_latency(client, replicas[0]) if policy == "cache_aware"
                else None}
    finally:
        cluster("stop", root=root)


def router_latency(client: openai.OpenAI, replica: str) -> dict[str, float]:
    """A short warm request's TTFT straight to a replica and through the router, alternated."""
    direct = openai.OpenAI(base_url=f"{replica}/v1", api_key="x", max_retries=0)
    system = "You are terse."
    for c in (direct, client):
        ttft(c, system, "hi", 2)
    d, r = [], []
    for _ in range(20):
        d.append(ttft(direct, system, "hi", 2))
        r.append(ttft(client, system, "hi", 2))
    return {"direct_p50_ms": 1000 * statistics.median(d),
            "router_p50_ms": 1000 * statistics.median(r)}


def main() -> None:
    args = parse_args()
    flags = next((line.split(":", 1)[1].split() for line in
                  Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), [])
    import torch

    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__} capability {torch.backends.cpu.get_cpu_capability()}, "
          f"flags: {' '.join(f for f in flags if f.startswith(('avx', 'amx', 'fma')))}")
    print(f"# {args.agents} agents x {args.turns} turns over {args.replicas} replicas")
    print(f"# router args: {args.router_args or '(defaults)'}")
    results = [run_policy(p, args) for p in args.policies.split(",")]
    print("| policy | hit rate | warm TTFT p50 / p90 | cold TTFT p50 | requests per replica "
          "| wall |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['policy']} | {r['hit_rate']:.1%} | {r['warm_p50']:.2f} / "
              f"{r['warm_p90']:.2f} s | {r['cold_p50']:.2f} s | {r['per_replica']} "
              f"| {r['wall_s']:.0f} s |")
    if len(results) < 2:
        return
    ca, rr = results
    print(f"warm p50 round_robin / cache_aware: {rr['warm_p50'] / ca['warm_p50']:.2f}x")
    lat = ca["router_latency"]
    print(f"router: TTFT p50 {lat['direct_p50_ms']:.1f} ms direct, {lat['router_p50_ms']:.1f} ms "
          f"through SMG (+{lat['router_p50_ms'] - lat['direct_p50_ms']:.1f} ms)")


if __name__ == "__main__":
    main()
