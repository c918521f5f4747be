"""Serving benchmark: an agent workload against any OpenAI-compatible base URL.

Every request carries the workload's long shared prefix (system prompt + tool schemas) and one
distinct user turn, as an agent framework would send it. Measured over streaming:

- TTFT (time to the first content or tool-call chunk) of cold requests — the first request of a
  fresh cache namespace, which must prefill the whole prefix — and of warm requests, which find
  the prefix cached (p50/p90);
- output tokens/s (output tokens of all requests / wall time) at each concurrency (1, 8, 32);
- the share of prompt tokens served from the prefix cache (``usage.prompt_tokens_details``).

Cold vs warm is made reliable with vLLM's ``cache_salt`` extension (agentd supports it): each
cold request uses a new salt, so nothing it needs is cached; the warm runs share one salt, warmed
once. ``--openai-strict`` drops the extensions (``cache_salt``, ``ignore_eos``) for servers that
reject them; "cold" then only means "first in this run".

Two more phases, for agentd:

- ``--pressure``: pins the workload prefix (``POST /v1/pins``) and warms an *equally old unpinned*
  copy of it (the same prompt under a ``cache_salt``, so it has blocks of its own). Each round,
  unique prompts worth ``--pressure-factor`` times the whole pool (size from ``/v1/stats``) churn
  the cache, then one pinned and one unpinned request are timed: warm TTFT with the pin vs
  without it, under the same pressure. The pool must hold the pin and the unpinned copy at
  once: about 2x the prefix (``--kv-cache-memory 256MiB`` for the research workload).
- ``--restore`` (needs ``--spawn``, which runs ``agentd start`` itself on a free port with a fresh
  state dir and ``--daemon-args``): pins the prefix, then ``kill -9``s the daemon and starts it
  again twice — with the pin's KV snapshot on disk, then with the snapshot deleted — and reports
  each start's time to ready, the daemon's own ``pin_restore`` report (restore from the snapshot
  vs recompute) and the TTFT of the first request after the restart.

    python benchmarks/serve.py --base-url http://127.0.0.1:8000/v1 --requests 16
    python benchmarks/serve.py --spawn --daemon-args "--kv-cache-memory 256MiB" \\
        --workload research --concurrency 1 --pressure --restore
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import httpx


@dataclass
class Result:
    ttft_s: float | None
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int


@dataclass
class Row:
    phase: str
    concurrency: int
    results: list[Result]
    wall_s: float


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    default_url = os.environ.get("AGENTD_URL", "http://127.0.0.1:8000").rstrip("/")
    default_url = default_url if default_url.endswith("/v1") else default_url + "/v1"
    parser.add_argument("--base-url", default=default_url, help="OpenAI base URL (…/v1)")
    parser.add_argument("--model", default=None, help="model name [default: the first served]")
    parser.add_argument("--workload", default=None,
                        help="coding, research, support, or a workload JSON file "
                             "[default: coding]")
    parser.add_argument("--requests", type=int, default=16,
                        help="requests per concurrency level (at least the concurrency)")
    parser.add_argument("--cold-requests", type=int, default=2,
                        help="cold requests, each with an empty cache namespace")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", default="1,8,32",
                        help="comma-separated concurrency levels")
    parser.add_argument("--api-key", default=os.environ.get("AGENTD_API_KEY")
                        or os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--openai-strict", action="store_true",
                        help="send only standard OpenAI fields (no cache_salt / ignore_eos)")
    parser.add_argument("--timeout", type=float, default=900.0, help="per-request timeout (s)")
    parser.add_argument("--pressure", action="store_true",
                        help="agentd: warm TTFT of a pinned vs an equally old unpinned prefix "
                             "under cache pressure")
    parser.add_argument("--pressure-factor", type=float, default=2.0,
                        help="unique prompt tokens per pressure round, in pool sizes")
    parser.add_argument("--pressure-rounds", type=int, default=3)
    parser.add_argument("--spawn", action="store_true",
                        help="run `agentd start` on a free port (fresh state dir) and use it")
    parser.add_argument("--daemon-args", default="", help="more `agentd start` options")
    parser.add_argument("--restore", action="store_true",
                        help="with --spawn: pin restore from its KV snapshot vs recompute, "
                             "after kill -9")
    args = parser.parse_args()
    if args.restore and not args.spawn:
        parser.error("--restore restarts the daemon, so it needs --spawn")
    return args


def load_workload(path: str | None) -> dict[str, Any]:
    if path is not None and os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    stem = (path or "coding").removesuffix("_agent") + "_agent"
    return json.loads(resources.files("agentd.workloads").joinpath(f"{stem}.json").read_text())


class Bench:
    def __init__(self, args: argparse.Namespace, workload: dict[str, Any]) -> None:
        self.args = args
        self.workload = workload
        self.model: str | None = args.model
        self.pressure_info: dict[str, int] = {}
        self._next_turn = 0
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.http = httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers,
                                      timeout=args.timeout, trust_env=False,
                                      limits=httpx.Limits(max_connections=256))

    def body(self, salt: str | None, turn: str | None = None,
             max_tokens: int | None = None) -> dict[str, Any]:
        if turn is None:
            turns = self.workload["turns"]
            turn = turns[self._next_turn % len(turns)]
            self._next_turn += 1
        body: dict[str, Any] = {
            "model": self.model, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": max_tokens or self.args.max_tokens, "temperature": 0,
            "messages": [{"role": "system", "content": self.workload["system"]},
                         {"role": "user", "content": turn}],
            "tools": self.workload.get("tools") or None,
        }
        if not self.args.openai_strict:
            body.update(cache_salt=salt, ignore_eos=True)  # salt None: the pins' namespace
        return {k: v for k, v in body.items() if v is not None}

    async def one(self, salt: str | None, turn: str | None = None,
                  max_tokens: int | None = None) -> Result:
        """One streamed request. TTFT is the first content or tool-call chunk — or, for a reply
        held back whole (a tool call being parsed), the finish chunk."""
        start = time.perf_counter()
        ttft: float | None = None
        usage: dict[str, Any] = {}
        num_chunks = 0
        body = self.body(salt, turn, max_tokens)
        async with self.http.stream("POST", "/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                raise SystemExit(f"HTTP {reply.status_code}: {(await reply.aread())[:500]!r}")
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    raise SystemExit(f"stream error: {chunk['error']}")
                usage = chunk.get("usage") or usage
                delta = chunk["choices"][0]["delta"] if chunk.get("choices") else {}
                if delta.get("content") or delta.get("tool_calls"):
                    num_chunks += 1
                if ttft is None and (num_chunks or chunk.get("choices") and
                                     chunk["choices"][0].get("finish_reason")):
                    ttft = time.perf_counter() - start
        details = usage.get("prompt_tokens_details") or {}
        return Result(ttft, usage.get("completion_tokens", num_chunks),
                      usage.get("prompt_tokens", 0), details.get("cached_tokens") or 0)

    async def run(self, phase: str, concurrency: int, count: int, salt: str | None) -> Row:
        """``count`` requests, at most ``concurrency`` at a time (``salt`` None: one each)."""
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(count):
            queue.put_nowait(i)
        results: list[Result] = []

        async def worker() -> None:
            while not queue.empty():
                queue.get_nowait()
                results.append(await self.one(salt or uuid.uuid4().hex))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, count))))
        return Row(phase, concurrency, results, time.perf_counter() - start)

    async def main(self) -> list[Row]:
        if self.model is None:
            models = (await self.http.get("/models")).raise_for_status().json()
            self.model = models["data"][0]["id"]
        rows = [await self.run("cold", 1, self.args.cold_requests, salt=None)]
        warm_salt = uuid.uuid4().hex
        await self.one(warm_salt)  # warm the shared prefix once
        for concurrency in [int(c) for c in self.args.concurrency.split(",") if c]:
            count = max(self.args.requests, concurrency)
            rows.append(await self.run("warm", concurrency, count, warm_salt))
        if self.args.pressure:
            rows += await self.pressure()
        await self.http.aclose()
        return rows

    # --- agentd: a pin vs an equally old unpinned prefix, under pressure ----------------------
    async def pin(self, name: str) -> dict[str, Any]:
        body = {"name": name, "system": self.workload["system"],
                "tools": self.workload.get("tools") or None}
        reply = await self.http.post("/pins", json={k: v for k, v in body.items() if v})
        if reply.is_error:
            raise SystemExit(f"POST /v1/pins: HTTP {reply.status_code}: {reply.text[:300]}")
        return reply.json()

    async def churn(self, num_tokens: int, prompt_len: int) -> None:
        """Unique prompts (random token ids, each its own salt) worth ``num_tokens``."""
        rng = random.Random(uuid.uuid4().int)
        prompts = [[rng.randrange(1000, 30000) for _ in range(prompt_len)]
                   for _ in range(max(num_tokens // prompt_len, 1))]

        async def send(ids: list[int]) -> None:
            reply = await self.http.post("/completions", json={
                "model": self.model, "prompt": ids, "max_tokens": 1,
                "cache_salt": uuid.uuid4().hex})
            if reply.is_error:
                raise SystemExit(f"pressure prompt: HTTP {reply.status_code}: {reply.text[:300]}")

        for i in range(0, len(prompts), 4):
            await asyncio.gather(*(send(ids) for ids in prompts[i:i + 4]))

    async def pressure(self) -> list[Row]:
        stats = (await self.http.get("/stats")).raise_for_status().json()
        pool_tokens = stats["num_blocks_total"] * stats.get("block_size", 16)
        churn_tokens = int(self.args.pressure_factor * pool_tokens)
        name = f"bench-{uuid.uuid4().hex[:8]}"
        info = await self.pin(name)
        unpinned_salt = uuid.uuid4().hex
        await self.one(None)
        await self.one(unpinned_salt)  # the unpinned copy: cached now, as recent as the pin
        pinned: list[Result] = []
        unpinned: list[Result] = []
        for round_ in range(self.args.pressure_rounds):
            await self.churn(churn_tokens, min(1024, stats["max_model_len"] // 2))
            turn = self.workload["turns"][round_ % len(self.workload["turns"])]
            pair = [(pinned, None), (unpinned, unpinned_salt)]
            for results, salt in pair if round_ % 2 == 0 else pair[::-1]:
                # one token: TTFT is then the prefill, whatever the model starts to write
                results.append(await self.one(salt, turn, max_tokens=1))
        await self.http.delete(f"/pins/{name}")
        self.pressure_info = {"pin_tokens": info["num_tokens"], "pool_tokens": pool_tokens,
                              "churn_tokens": churn_tokens}
        return [Row("pressure: pinned", 1, pinned, 0.0),
                Row("pressure: unpinned", 1, unpinned, 0.0)]


# --- agentd: restart with a KV snapshot vs recompute ------------------------------------------
class Daemon:
    """``agentd start`` on a free loopback port with its own state dir (``--spawn``)."""

    def __init__(self, extra_args: str) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.root = Path(tempfile.mkdtemp(prefix="agentd-bench-"))
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = shlex.split(extra_args)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Start and wait for ``/health`` 200; returns the seconds that took."""
        started = time.perf_counter()
        with open(self.root / "daemon.log", "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "agentd.cli", "start", "--port", str(self.port),
                 "--state-dir", str(self.root / "state"), "--log-level", "warning", *self.args],
                stdout=log, stderr=subprocess.STDOUT)
        while True:
            if self.process.poll() is not None:
                raise SystemExit(f"agentd exited; see {self.root / 'daemon.log'}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.perf_counter() - started
            except httpx.TransportError:
                pass
            time.sleep(0.05)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.root, ignore_errors=True)


def restore_phase(daemon: Daemon, workload: dict[str, Any], args: argparse.Namespace
                  ) -> list[tuple[str, ...]]:
    """kill -9 and restart twice: with the pin's KV snapshot, and with it deleted (the daemon
    then recomputes the pin: a cold prefill of the prefix, what a restart without snapshots
    costs)."""
    asyncio.run(_pin_and_close(Bench(args, workload), "bench-restore"))
    rows = []
    for label, drop_snapshot in (("restart, KV snapshot on disk", False),
                                 ("restart, snapshot deleted", True)):
        daemon.kill()
        if drop_snapshot:
            shutil.rmtree(daemon.root / "state" / "kv", ignore_errors=True)
        ready_s = daemon.start()
        report = httpx.get(f"{daemon.url}/v1/stats", timeout=30).json()["pin_restore"]
        entry = next(e for e in report if e["name"] == "bench-restore")
        first = asyncio.run(_one_and_close(Bench(args, workload)))
        rows.append((label, f"{ready_s:.2f}", entry.get("source", entry.get("error", "?")),
                     f"{entry['elapsed_s']:.3f}",
                     f"{first.ttft_s:.3f} ({first.cached_tokens} cached)"
                     if first.ttft_s is not None else "-"))
    return rows


async def _pin_and_close(bench: Bench, name: str) -> dict[str, Any]:
    try:
        return await bench.pin(name)
    finally:
        await bench.http.aclose()


async def _one_and_close(bench: Bench) -> Result:
    if bench.model is None:
        bench.model = (await bench.http.get("/models")).json()["data"][0]["id"]
    try:
        return await bench.one(None, "First question after the restart.", max_tokens=1)
    finally:
        await bench.http.aclose()


def percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def format_table(rows: list[Row], title: str) -> str:
    header = ("phase", "concurrency", "requests", "TTFT p50 s", "TTFT p90 s", "output tok/s",
              "cached/prompt")
    lines: list[tuple[str, ...]] = []
    for row in rows:
        ttfts = [r.ttft_s for r in row.results if r.ttft_s is not None]
        output = sum(r.output_tokens for r in row.results)
        prompt = sum(r.prompt_tokens for r in row.results)
        cached = sum(r.cached_tokens for r in row.results)
        lines.append((
            row.phase, str(row.concurrency), str(len(row.results)),
            f"{percentile(ttfts, 50):.3f}" if ttfts else "-",
            f"{percentile(ttfts, 90):.3f}" if ttfts else "-",
            f"{output / row.wall_s:.1f}" if row.wall_s else "-",
            f"{100 * cached / prompt:.1f}%" if prompt else "-",
        ))
    return format_plain(header, lines, title)


def format_plain(header: tuple[str, ...], lines: list[tuple[str, ...]], title: str) -> str:
    rows = [header, *lines]
    widths = [max(len(line[i]) for line in rows) for i in range(len(header))]
    out = [title]
    for n, line in enumerate(rows):
        out.append("  ".join(cell.rjust(w) if i else cell.ljust(w)
                             for i, (cell, w) in enumerate(zip(line, widths, strict=True))))
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def main() -> None:
    args = parse_args()
    workload = load_workload(args.workload)
    daemon = Daemon(args.daemon_args) if args.spawn else None
    try:
        if daemon is not None:
            daemon.start()
            args.base_url = f"{daemon.url}/v1"
        bench = Bench(args, workload)
        rows = asyncio.run(bench.main())
        prompt_tokens = rows[0].results[0].prompt_tokens if rows[0].results else 0
        title = (f"agentd serve benchmark: workload {workload.get('name', '?')} "
                 f"({len(workload.get('tools') or [])} tools, ~{prompt_tokens} prompt tokens), "
                 f"model {bench.model}, max_tokens {args.max_tokens}, {args.base_url}")
        print(format_table(rows, title))
        if bench.pressure_info:
            info = bench.pressure_info
            pinned, unpinned = ([r.ttft_s for r in row.results if r.ttft_s is not None]
                                for row in rows[-2:])
            print(f"pressure: pin {info['pin_tokens']} tokens, pool {info['pool_tokens']} "
                  f"tokens, {info['churn_tokens']} unique prompt tokens before each timed pair; "
                  f"warm TTFT p50 without the pin / with it: "
                  f"{percentile(unpinned, 50) / percentile(pinned, 50):.1f}x")
        if daemon is not None and args.restore:
            print()
            print(format_plain(("restart after kill -9", "ready after s", "pin from", "restore s",
                                "first request TTFT s"), restore_phase(daemon, workload, args),
                               "pin restore after kill -9 (KV snapshot vs recompute)"))
    finally:
        if daemon is not None:
            daemon.close()


if __name__ == "__main__":
    main()
