"""Soak test (not in CI): mixed agent traffic against a real daemon for ``--minutes``, with pins,
client aborts and restarts, printing the daemon's RSS and pool state over time and a final
integrity check.

What runs:

- ``agentd start`` on a free port with a fresh state dir (default model unless ``--model``);
- one pin per workload (system prompt + tools, ``POST /v1/pins``) — the prefixes agents share;
- ``--concurrency`` clients, each looping over: a single agent turn (workload system + tools + a
  user turn), or a multi-turn conversation replayed up to one of its assistant turns (tool calls
  and tool results included), streamed or not, and with ``--abort-fraction`` of them abandoned
  mid-way (a stream closed after a few chunks, or a non-streamed request that times out);
- a restart every ``--restart-every`` seconds, alternating a graceful stop and ``kill -9``;
  after each, the pins must be back (``GET /v1/pins``) before traffic resumes;
- every ``--report-every`` seconds a line: daemon RSS, blocks used/cached/pinned/free,
  requests running/waiting, completed/aborted/refused/failed counts.

Then traffic stops and, with ``--corruption-rounds`` (default: one per kind of damage), the
daemon is stopped, something on disk is damaged — a pin's segment in the block store with bits
flipped, truncated, replaced with random bytes or deleted, ``pins.json`` truncated or garbled, a
bad entry added to it, an older version's stray snapshots and another model's store left behind
— and started again: every pin must be listed, hit in full and give the greedy reply it gave
before any damage.

At the end the pool must go idle (only pins hold blocks), ``/admin/integrity``
must be ok and every reply must have been 200 or 503 (busy, or loading during a restart);
the exit status says whether all of that held. A stream the daemon ends during a graceful stop
(an error event with code ``service_unavailable``, then ``[DONE]``) counts like a 503.

    python benchmarks/soak.py --minutes 10
    python benchmarks/soak.py --minutes 1 --restart-every 30 --workloads support_agent
    python benchmarks/soak.py --minutes 2 --model /path/to/model --restart-every 45
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import httpx

from agentd.bench.spawn import SpawnedDaemon
from agentd.pins.snapshots import file_stem

WORKLOADS = ("coding_agent", "support_agent", "research_agent")
READY_TIMEOUT_S = 900.0


def workload(name: str) -> dict[str, Any]:
    return json.loads(resources.files("agentd.workloads").joinpath(f"{name}.json").read_text())


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    cached_tokens: int = 0
    prompt_tokens: int = 0


def spawn(args: argparse.Namespace, state_dir: Path) -> SpawnedDaemon:
    """The daemon under test: ``agentd start`` on a free port with the soak's options, its
    state in ``state_dir/state`` and its output in ``state_dir/soak-daemon.log``."""
    options = ["--kv-cache-memory", args.kv_cache, "--log-level", "warning",
               "--max-queue", str(args.max_queue)]
    if args.model:
        options += ["--model", args.model]
    return SpawnedDaemon(state_dir / "state", *options, ready_timeout_s=READY_TIMEOUT_S,
                         log_path=state_dir / "soak-daemon.log")


def restart(daemon: SpawnedDaemon, hard: bool) -> float:
    """``kill -9`` (hard) or a graceful stop, then start again; the seconds to ready."""
    if hard:
        daemon.kill()
    else:
        daemon.stop()
    return daemon.start()


class Traffic:
    """Requests shaped like an agent's: the workload prefix (system + tools) and a tail."""

    def __init__(self, seed: int, abort_fraction: float, max_tokens: int,
                 workloads: list[str]) -> None:
        self.rng = random.Random(seed)
        self.abort_fraction = abort_fraction
        self.max_tokens = max_tokens
        self.specs = {name: workload(name) for name in workloads}

    def next_request(self) -> tuple[dict[str, Any], str]:
        """A chat body and how to treat it: "stream", "plain", "abort-stream", "abort-plain"."""
        rng = self.rng
        spec = self.specs[rng.choice(sorted(self.specs))]
        system = [{"role": "system", "content": spec["system"]}]
        if rng.random() < 0.5:
            messages = system + [{"role": "user", "content": rng.choice(spec["turns"])}]
        else:
            conversation = rng.choice(spec["conversations"])
            ends = [i for i, m in enumerate(conversation) if m["role"] == "assistant"] or \
                [len(conversation)]
            messages = system + conversation[:rng.choice(ends)]
        body = {"messages": messages, "tools": spec["tools"], "temperature": rng.choice([0, 0.7]),
                "max_tokens": rng.randint(4, self.max_tokens), "seed": rng.randrange(2**31)}
        stream = rng.random() < 0.5
        abort = rng.random() < self.abort_fraction
        return body, ("abort-" if abort else "") + ("stream" if stream else "plain")


async def one_request(http: httpx.AsyncClient, body: dict[str, Any], how: str,
                      tally: Tally, rng: random.Random) -> None:
    try:
        if how.endswith("stream"):
            await _streamed(http, body, how.startswith("abort"), tally, rng)
        else:
            timeout = rng.uniform(0.05, 1.0) if how.startswith("abort") else 600.0
            response = await http.post("/v1/chat/completions", json=body, timeout=timeout)
            _record(response.status_code, response.text, tally)
            if response.status_code == 200:
                usage = response.json()["usage"]
                tally.prompt_tokens += usage["prompt_tokens"]
                tally.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
    except httpx.TimeoutException:
        tally.outcomes["aborted"] += 1
    except httpx.TransportError:
        tally.outcomes["refused (restarting)"] += 1


async def _streamed(http: httpx.AsyncClient, body: dict[str, Any], abort: bool, tally: Tally,
                    rng: random.Random) -> None:
    cut = rng.randint(1, 6) if abort else None
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with http.stream("POST", "/v1/chat/completions", json=body, timeout=600) as response:
        if response.status_code != 200:
            _record(response.status_code, (await response.aread()).decode(), tally)
            return
        num_chunks = 0
        last = ""
        outcome = "completed"
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                num_chunks += 1
                last = line
                if '"error"' in line and '"code":"service_unavailable"' in line:
                    outcome = "ended by a shutdown (503 event)"
                elif '"error"' in line:
                    tally.unexpected.append(f"stream error event: {line[:300]}")
                elif '"usage":{' in line:
                    usage = json.loads(line[len("data: "):])["usage"]
                    tally.prompt_tokens += usage["prompt_tokens"]
                    tally.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
            if cut is not None and num_chunks >= cut:
                tally.outcomes["aborted"] += 1
                return  # leaving the block hangs up
        if last != "data: [DONE]":
            tally.unexpected.append(f"stream ended without [DONE]: {last[:200]}")
        tally.statuses[200] += 1
        tally.outcomes[outcome] += 1


def _record(status: int, text: str, tally: Tally) -> None:
    tally.statuses[status] += 1
    if status == 200:
        tally.outcomes["completed"] += 1
    elif status == 503:
        tally.outcomes["refused 503"] += 1
    else:
        tally.outcomes["failed"] += 1
        tally.unexpected.append(f"{status}: {text[:300]}")


async def client_loop(daemon: SpawnedDaemon, traffic: Traffic, tally: Tally,
                      running: asyncio.Event, stop_at: float, seed: int) -> None:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=4)
    while time.monotonic() < stop_at:
        await running.wait()
        async with httpx.AsyncClient(base_url=daemon.url, limits=limits) as http:
            while running.is_set() and time.monotonic() < stop_at:
                body, how = traffic.next_request()
                await one_request(http, body, how, tally, rng)


def register_pins(daemon: SpawnedDaemon, traffic: Traffic) -> dict[str, int]:
    pinned = {}
    for name, spec in traffic.specs.items():
        response = httpx.post(f"{daemon.url}/v1/pins", timeout=900, json={
            "name": name, "system": spec["system"], "tools": spec["tools"]})
        if response.status_code != 201:
            raise SystemExit(f"could not pin {name}: {response.status_code} {response.text}")
        pinned[name] = response.json()["num_tokens"]
    return pinned


def pins_listed(daemon: SpawnedDaemon) -> dict[str, int]:
    data = httpx.get(f"{daemon.url}/v1/pins", timeout=60).json()["data"]
    return {p["name"]: p["num_tokens"] for p in data}


async def reporter(daemon: SpawnedDaemon, tally: Tally, started: float, every_s: float,
                   rss: list[float], stop_at: float) -> None:
    print(f"{'t':>6} {'rss MiB':>8} {'used':>5} {'cached':>6} {'pinned':>6} {'free':>5} "
          f"{'run':>4} {'wait':>4}  outcomes", flush=True)
    while time.monotonic() < stop_at:
        await asyncio.sleep(every_s)
        line = f"{time.monotonic() - started:6.0f} "
        try:
            async with httpx.AsyncClient(base_url=daemon.url, timeout=10) as http:
                stats = (await http.get("/v1/stats")).json()
            mib = daemon.rss_mib()
            if mib is not None:
                rss.append(mib)
            line += (f"{mib or 0:8.0f} {stats['num_blocks_used']:5d} "
                     f"{stats['num_blocks_cached']:6d} {stats['num_blocks_pinned']:6d} "
                     f"{stats['num_blocks_free']:5d} {stats['num_requests_running']:4d} "
                     f"{stats['num_requests_waiting']:4d}")
        except (httpx.HTTPError, ValueError, KeyError):
            line += f"{'(restarting)':>47}"
        print(f"{line}  {dict(tally.outcomes)}", flush=True)


async def restarter(daemon: SpawnedDaemon, running: asyncio.Event, every_s: float,
                    stop_at: float, pinned: dict[str, int], log: list[str]) -> None:
    hard = False
    while time.monotonic() + every_s < stop_at:
        await asyncio.sleep(every_s)
        hard = not hard
        running.clear()
        await asyncio.sleep(0.5)  # let clients see the gate; in-flight requests may still run
        ready_s = await asyncio.to_thread(restart, daemon, hard)
        listed = await asyncio.to_thread(pins_listed, daemon)
        kind = "kill -9" if hard else "graceful stop"
        ok = listed == pinned
        log.append(f"restart after {kind}: ready in {ready_s:.1f} s, pins "
                   f"{'restored' if ok else f'WRONG: {listed}'}")
        print(f"--- {log[-1]}", flush=True)
        running.set()


# --- damage on disk between restarts -----------------------------------------------------------
def _pinned(state: Path, rng: random.Random) -> Path:
    """One of the store's pinned segments (each holds one pin write's records)."""
    return rng.choice(sorted(state.glob("kv-store/*/*.pin.seg")))


def _flip_bits(path: Path, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    for index in rng.sample(range(len(data) // 3, len(data)), 64):
        data[index] ^= 0x80
    path.write_bytes(bytes(data))


def _bad_entry(path: Path) -> None:
    doc = json.loads(path.read_text())
    doc["pins"].insert(1, {"name": "broken", "system": 42})
    path.write_text(json.dumps(doc))


def _strays(state: Path, name: str) -> None:
    old = state / "kv" / "0123456789abcdef-b16"  # an older version's snapshots no pin names
    old.mkdir(parents=True, exist_ok=True)
    (old / f"{file_stem(name)}.pt").write_bytes(b"an older snapshot")
    other = state / "kv-store" / "0123456789abcdef-b16"  # another model's store
    other.mkdir(parents=True, exist_ok=True)
    (other / "00000001.pin.seg").write_bytes(b"another model's pinned blocks")


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:4096])


DAMAGE = {  # (what, how): how(state dir, a pin's name, rng)
    "pinned segment bits flipped": lambda state, name, rng: _flip_bits(_pinned(state, rng), rng),
    "pinned segment truncated": lambda state, name, rng: _truncate(_pinned(state, rng)),
    "pinned segment replaced by random bytes": lambda state, name, rng: (
        lambda path: path.write_bytes(rng.randbytes(path.stat().st_size)))(_pinned(state, rng)),
    "pinned segment deleted": lambda state, name, rng: _pinned(state, rng).unlink(),
    "pins.json truncated": lambda state, name, rng: (state / "pins.json").write_bytes(
        (state / "pins.json").read_bytes()[:100]),
    "pins.json random bytes": lambda state, name, rng: (state / "pins.json").write_bytes(
        rng.randbytes(500)),
    "pins.json with a bad entry": lambda state, name, rng: _bad_entry(state / "pins.json"),
    "stray snapshots, another model's store": lambda state, name, rng: _strays(state, name),
}


def greedy_replies(daemon: SpawnedDaemon, traffic: Traffic) -> dict[str, tuple[int, str]]:
    """Per pinned workload: (cached tokens, 12 greedy tokens' text) of one fixed turn."""
    replies = {}
    for name, spec in traffic.specs.items():
        response = httpx.post(f"{daemon.url}/v1/chat/completions", timeout=600, json={
            "messages": [{"role": "system", "content": spec["system"]},
                         {"role": "user", "content": spec["turns"][0]}],
            "tools": spec["tools"], "temperature": 0, "max_tokens": 12})
        body = response.json()
        replies[name] = (body["usage"]["prompt_tokens_details"]["cached_tokens"],
                         json.dumps(body["choices"][0]["message"]))
    return replies


def corruption_phase(daemon: SpawnedDaemon, traffic: Traffic, pinned: dict[str, int],
                     rounds: int, seed: int) -> list[str]:
    """Damage the state dir between restarts; returns the problems found (none: a pass)."""
    rng = random.Random(seed)
    reference = greedy_replies(daemon, traffic)
    problems = []
    names = sorted(pinned)
    for index in range(rounds):
        what = list(DAMAGE)[index % len(DAMAGE)]
        name = names[index % len(names)]
        daemon.stop()
        DAMAGE[what](daemon.state_dir, name, rng)
        ready_s = daemon.start()
        listed = pins_listed(daemon)
        report = httpx.get(f"{daemon.url}/v1/stats", timeout=60).json()["pin_restore"]
        replies = greedy_replies(daemon, traffic)
        wrong = [n for n in names if replies[n][1] != reference[n][1]
                 or replies[n][0] < pinned[n]]
        sources = ", ".join(f"{e['name']}: {e.get('source') or 'error: ' + e['error'][:60]}"
                            for e in report)
        line = (f"{what} ({name}): ready in {ready_s:.1f} s; {sources}; pins "
                f"{'intact' if listed == pinned and not wrong else 'WRONG'}")
        print(f"--- {line}", flush=True)
        if listed != pinned or wrong:
            problems.append(f"{line}: listed {listed}, wrong replies {wrong}")
    return problems


async def soak(args: argparse.Namespace, state_dir: Path) -> int:
    daemon = spawn(args, state_dir)
    traffic = Traffic(args.seed, args.abort_fraction, args.max_tokens, args.workloads.split(","))
    tally = Tally()
    rss: list[float] = []
    restarts: list[str] = []
    print(f"starting agentd (state dir {state_dir}) ...", flush=True)
    try:
        ready_s = await asyncio.to_thread(daemon.start)
        pinned = await asyncio.to_thread(register_pins, daemon, traffic)
        print(f"ready in {ready_s:.1f} s; pinned {pinned}", flush=True)
        started = time.monotonic()
        stop_at = started + args.minutes * 60
        running = asyncio.Event()
        running.set()
        await asyncio.gather(
            reporter(daemon, tally, started, args.report_every, rss, stop_at),
            restarter(daemon, running, args.restart_every, stop_at, pinned, restarts),
            *(client_loop(daemon, traffic, tally, running, stop_at, args.seed + i)
              for i in range(args.concurrency)))
        elapsed_s = time.monotonic() - started
        damaged = await asyncio.to_thread(corruption_phase, daemon, traffic, pinned,
                                          args.corruption_rounds, args.seed)
        tally.unexpected += damaged
        return await asyncio.to_thread(final_check, daemon, tally, rss, restarts, pinned,
                                       elapsed_s)
    finally:  # whatever happened, never leave a daemon behind
        daemon.stop()


def final_check(daemon: SpawnedDaemon, tally: Tally, rss: list[float], restarts: list[str],
                pinned: dict[str, int], elapsed_s: float) -> int:
    deadline = time.monotonic() + 120
    while True:
        report = httpx.get(f"{daemon.url}/admin/integrity", timeout=60).json()
        idle = not (report["num_requests"] or report["num_streams"]) and \
            report["num_blocks_used"] == report["num_blocks_pinned"]
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    listed = pins_listed(daemon)
    stats = httpx.get(f"{daemon.url}/v1/stats", timeout=60).json()
    bad_statuses = {s: n for s, n in tally.statuses.items() if s not in (200, 503)}
    hit_rate = tally.cached_tokens / tally.prompt_tokens if tally.prompt_tokens else 0.0
    print("\n=== soak summary ===")
    print(f"duration            {elapsed_s / 60:.1f} min, {daemon.num_starts} daemon starts")
    for line in restarts:
        print(f"  {line}")
    print(f"outcomes            {dict(tally.outcomes)}")
    print(f"HTTP statuses       {dict(sorted(tally.statuses.items()))}")
    print(f"prompt tokens       {tally.prompt_tokens}, {hit_rate:.1%} served from cache")
    if rss:
        print(f"daemon RSS MiB      min {min(rss):.0f}, max {max(rss):.0f}, last {rss[-1]:.0f}")
    print(f"pool at the end     used {stats['num_blocks_used']}, pinned "
          f"{stats['num_blocks_pinned']}, cached {stats['num_blocks_cached']}, free "
          f"{stats['num_blocks_free']} of {stats['num_blocks_total']}")
    print(f"integrity           {'ok' if report['ok'] else report['error']}; "
          f"{'idle' if idle else f'NOT idle: {report}'}")
    pins_state = f"all {len(listed)} intact" if listed == pinned else f"WRONG: {listed}"
    print(f"pins                {pins_state}")
    for problem in tally.unexpected[:10]:
        print(f"  unexpected: {problem}")
    ok = report["ok"] and idle and listed == pinned and not bad_statuses and not tally.unexpected
    print(f"result              {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--model", default=None, help="model dir [default: the default model]")
    parser.add_argument("--kv-cache", default="2GiB",
                        help="--kv-cache-memory of the daemon (the three pins need ~12.5K tokens)")
    parser.add_argument("--concurrency", type=int, default=6, help="concurrent clients")
    parser.add_argument("--max-tokens", type=int, default=24, help="largest max_tokens drawn")
    parser.add_argument("--abort-fraction", type=float, default=0.2)
    parser.add_argument("--max-queue", type=int, default=4)
    parser.add_argument("--restart-every", type=float, default=180.0, help="seconds")
    parser.add_argument("--report-every", type=float, default=15.0, help="seconds")
    parser.add_argument("--corruption-rounds", type=int, default=len(DAMAGE),
                        help="restarts with damage on disk after the traffic [default: one per "
                             "kind of damage; 0 skips the phase]")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help="comma-separated workloads to draw from (and pin)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="where the daemon keeps its state (in state/) and its log "
                             "[default: a fresh temporary directory]")
    args = parser.parse_args()
    if args.state_dir is not None:
        args.state_dir.mkdir(parents=True, exist_ok=True)
        sys.exit(asyncio.run(soak(args, args.state_dir)))
    with tempfile.TemporaryDirectory(prefix="agentd-soak-") as tmp:
        sys.exit(asyncio.run(soak(args, Path(tmp))))


if __name__ == "__main__":
    main()
