"""Agent sessions whose prefixes outgrow the pool: TTFT and tokens computed per turn with the KV
disk tier (agentd's default) and without it (``--no-kv-disk``), then after a ``kill -9``; with
``--llama-server PATH``, the same sessions on llama-server with its prompt cache in RAM
(``--cache-ram`` the size of agentd's pool, one slot of ``--llama-context`` tokens, ``-fa on``)
on the same GGUF, the tools sent as system text (the default model's template in the GGUF
renders none).

    python benchmarks/tiers.py [--model PATH] [--sessions 4] [--turns 3] [--pool 160MiB]
                               [--max-tokens 8] [--daemon-args "..."] [--json out.json]
                               [--llama-server PATH]

Sessions are the packaged agent workloads (research, support, code-editing, then the same again),
each with its own prefix (a session line first in its system text): the system prompt and tools,
the session's own user turns, the replies fed back. Turns are interleaved (turn 1 of every
session, then turn 2, ...), so with a pool that holds about two sessions each session's blocks
have been evicted by the others' before its next turn. Then ``kill -9``, a start on the same
state dir and one more turn of each session. Each configuration runs on a fresh state dir, one
request at a time. Per request: TTFT, prompt tokens, tokens from the pool, from the disk (the
daemon's ``prefix_cache_disk_hits`` after it) and computed. llama-server reports the tokens
its prompt cache served (``prompt_tokens_details.cached_tokens``) as a whole: they count as
"pool" tokens here; it renders the chat with the GGUF's own template, so its prompts' lengths
differ a little from agentd's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agentd.bench.client import BenchClient
from agentd.bench.llama_server import LlamaServer
from agentd.bench.spawn import SpawnedDaemon
from agentd.bench.workload import Namespace, Workload, load_workload, packaged_path
from agentd.config import parse_size

WORKLOADS = ("research_agent", "support_agent", "code_edit_agent")


@dataclass
class Turn:
    config: str
    phase: str  # "turn N" or "after restart"
    session: int
    ttft_s: float
    prompt_tokens: int
    pool_tokens: int
    disk_tokens: int
    computed_tokens: int


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="what `agentd start --model` serves "
                                                      "[default: the default model]")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3, help="turns before the restart")
    parser.add_argument("--pool", default="160MiB",
                        help="--kv-cache-memory: about two sessions' prefixes of the model")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--daemon-args", default="", help="more `agentd start` options")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--llama-server", default=None, help="a llama-server binary: the same "
                        "sessions on it, its prompt cache (--cache-ram) the size of --pool")
    parser.add_argument("--llama-context", type=int, default=8192, help="llama-server's -c")
    parser.add_argument("--threads", type=int, default=2, help="llama-server's -t")
    return parser.parse_args()


class Session:
    def __init__(self, index: int, workload: Workload) -> None:
        self.index = index
        self.workload = workload
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": f"Session {index}.\n{workload.system}"}]
        self.num_turns = 0

    def next_user(self) -> dict[str, Any]:
        turn = self.workload.turns[(self.index + 7 * self.num_turns) % len(self.workload.turns)]
        self.num_turns += 1
        return {"role": "user", "content": turn}


async def disk_hits(client: BenchClient, agentd: bool) -> int:
    return (await client.stats() or {}).get("prefix_cache_disk_hits", 0) if agentd else 0


async def one_turn(client: BenchClient, model: str, session: Session, config: str, phase: str,
                   max_tokens: int, agentd: bool = True) -> Turn:
    before = await disk_hits(client, agentd)
    session.messages.append(session.next_user())
    result = await client.chat(phase, model, session.messages, session.workload.tools,
                               Namespace(), max_tokens)
    disk = await disk_hits(client, agentd) - before
    session.messages.append({"role": "assistant", "content": f"Noted ({session.num_turns})."})
    cached = result.cached_tokens or 0
    return Turn(config, phase, session.index, result.ttft_s or result.e2e_s,
                result.prompt_tokens, cached - disk, disk, result.prompt_tokens - cached)


async def run_config(config: str, daemon_args: list[str], args: argparse.Namespace,
                     workloads: list[Workload]) -> list[Turn]:
    turns: list[Turn] = []
    with tempfile.TemporaryDirectory(prefix="agentd-tiers-") as tmp:
        daemon = SpawnedDaemon(Path(tmp) / "state", *daemon_args)
        ready_s = daemon.start()
        print(f"[{config}] ready in {ready_s:.1f} s: {' '.join(daemon_args)}", flush=True)
        client = BenchClient(daemon.url, None)
        try:
            info = await client.detect(None, False)
            sessions = [Session(i, workloads[i % len(workloads)]) for i in range(args.sessions)]
            for number in range(1, args.turns + 1):
                for session in sessions:
                    turns.append(await one_turn(client, info.model, session, config,
                                                f"turn {number}", args.max_tokens))
                    print(row(turns[-1]), flush=True)
            daemon.kill()
            started = time.monotonic()
            daemon.start()
            print(f"[{config}] kill -9, ready again in {time.monotonic() - started:.1f} s",
                  flush=True)
            for session in sessions:
                turns.append(await one_turn(client, info.model, session, config,
                                            "after restart", args.max_tokens))
                print(row(turns[-1]), flush=True)
        finally:
            await client.aclose()
            daemon.stop()
    return turns


async def run_llama(args: argparse.Namespace, workloads: list[Workload]) -> list[Turn]:
    """The sessions on llama-server, then a ``kill -9``, a start and one more turn each."""
    from agentd.model.default_model import default_gguf_path

    server = LlamaServer(args.llama_server, args.model or str(default_gguf_path()),
                         "-c", str(args.llama_context), "-np", "1", "-fa", "on",
                         "-t", str(args.threads), "--jinja",
                         "--cache-ram", str(max(1, parse_size(args.pool) // 2**20)))
    ready_s = server.start()
    print(f"[llama] ready in {ready_s:.1f} s: {' '.join(server.command[1:])}", flush=True)
    # the tools as system text: the default model's template in the GGUF renders no tools
    client = BenchClient(server.url, None, tools_in_system=True)
    turns: list[Turn] = []
    try:
        info = await client.detect(None, True)
        sessions = [Session(i, workloads[i % len(workloads)]) for i in range(args.sessions)]
        for number in range(1, args.turns + 1):
            for session in sessions:
                turns.append(await one_turn(client, info.model, session, "llama",
                                            f"turn {number}", args.max_tokens, False))
                print(row(turns[-1]), flush=True)
        server.kill()
        print(f"[llama] kill -9, ready again in {server.start():.1f} s", flush=True)
        for session in sessions:
            turns.append(await one_turn(client, info.model, session, "llama", "after restart",
                                        args.max_tokens, False))
            print(row(turns[-1]), flush=True)
    finally:
        await client.aclose()
        server.stop()
    return turns


def row(turn: Turn) -> str:
    return (f"  {turn.config:<8} {turn.phase:<14} session {turn.session}  TTFT "
            f"{turn.ttft_s:7.2f} s  prompt {turn.prompt_tokens:5d}  pool {turn.pool_tokens:5d}  "
            f"disk {turn.disk_tokens:5d}  computed {turn.computed_tokens:5d}")


def summary(turns: list[Turn]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for config in dict.fromkeys(t.config for t in turns):
        mine = [t for t in turns if t.config == config]
        warm = [t for t in mine if t.phase not in ("turn 1", "after restart")]
        restart = [t for t in mine if t.phase == "after restart"]
        out[config] = {
            "turn_1_ttft_s": statistics.mean(t.ttft_s for t in mine if t.phase == "turn 1"),
            "later_turns_ttft_s": statistics.mean(t.ttft_s for t in warm) if warm else 0.0,
            "after_restart_ttft_s": statistics.mean(t.ttft_s for t in restart),
            "computed_tokens": sum(t.computed_tokens for t in mine),
            "disk_tokens": sum(t.disk_tokens for t in mine),
            "pool_tokens": sum(t.pool_tokens for t in mine)}
    return out


def main() -> None:
    args = parse_args()
    from agentd.bench.machine import cpu_line

    print(cpu_line(), flush=True)
    workloads = [load_workload(packaged_path(name)) for name in WORKLOADS]
    base = [*(["--model", args.model] if args.model else []), "--kv-cache-memory", args.pool,
            "--log-level", "warning", *shlex.split(args.daemon_args)]
    turns = []
    for config, extra in (("disk", []), ("no-disk", ["--no-kv-disk"])):
        turns += asyncio.run(run_config(config, [*base, *extra], args, workloads))
    if args.llama_server:
        turns += asyncio.run(run_llama(args, workloads))
    figures = summary(turns)
    print()
    print(f"{'':10}{'turn 1 TTFT':>14}{'later turns':>14}{'after restart':>16}"
          f"{'computed':>11}{'from disk':>11}{'from pool':>11}")
    for config, f in figures.items():
        print(f"{config:10}{f['turn_1_ttft_s']:13.2f}s{f['later_turns_ttft_s']:13.2f}s"
              f"{f['after_restart_ttft_s']:15.2f}s{f['computed_tokens']:11.0f}"
              f"{f['disk_tokens']:11.0f}{f['pool_tokens']:11.0f}")
    disk, plain = figures["disk"], figures["no-disk"]
    if disk["later_turns_ttft_s"] and disk["after_restart_ttft_s"]:
        print(f"later turns: {plain['later_turns_ttft_s'] / disk['later_turns_ttft_s']:.1f}x "
              f"faster with the disk tier; after the restart "
              f"{plain['after_restart_ttft_s'] / disk['after_restart_ttft_s']:.1f}x; after the "
              f"restart over later turns (disk): "
              f"{disk['after_restart_ttft_s'] / disk['later_turns_ttft_s']:.2f}x")
    if (llama := figures.get("llama")) and disk["later_turns_ttft_s"]:
        print(f"agentd (disk) / llama-server (--cache-ram): later turns "
              f"{disk['later_turns_ttft_s'] / llama['later_turns_ttft_s']:.2f}x, after the "
              f"restart {disk['after_restart_ttft_s'] / llama['after_restart_ttft_s']:.2f}x")
    if args.json is not None:
        args.json.write_text(json.dumps({"turns": [asdict(t) for t in turns],
                                         "summary": figures}, indent=2))


if __name__ == "__main__":
    main()
