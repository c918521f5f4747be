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

    python benchmarks/serve.py --base-url http://127.0.0.1:8000/v1 --requests 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid
from dataclasses import dataclass
from importlib import resources
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
                        help="workload JSON [default: the packaged coding_agent.json]")
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
    return parser.parse_args()


def load_workload(path: str | None) -> dict[str, Any]:
    if path is not None:
        with open(path) as f:
            return json.load(f)
    return json.loads(resources.files("agentd.workloads").joinpath("coding_agent.json")
                      .read_text())


class Bench:
    def __init__(self, args: argparse.Namespace, workload: dict[str, Any]) -> None:
        self.args = args
        self.workload = workload
        self.model: str | None = args.model
        self._next_turn = 0
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.http = httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers,
                                      timeout=args.timeout, trust_env=False,
                                      limits=httpx.Limits(max_connections=256))

    def body(self, salt: str) -> dict[str, Any]:
        turns = self.workload["turns"]
        turn = turns[self._next_turn % len(turns)]
        self._next_turn += 1
        body: dict[str, Any] = {
            "model": self.model, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": self.args.max_tokens, "temperature": 0,
            "messages": [{"role": "system", "content": self.workload["system"]},
                         {"role": "user", "content": turn}],
            "tools": self.workload.get("tools") or None,
        }
        if not self.args.openai_strict:
            body.update(cache_salt=salt, ignore_eos=True)
        return {k: v for k, v in body.items() if v is not None}

    async def one(self, salt: str) -> Result:
        start = time.perf_counter()
        ttft: float | None = None
        usage: dict[str, Any] = {}
        num_chunks = 0
        async with self.http.stream("POST", "/chat/completions", json=self.body(salt)) as reply:
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
                    if ttft is None:
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
        for concurrency in [int(c) for c in self.args.concurrency.split(",")]:
            count = max(self.args.requests, concurrency)
            rows.append(await self.run("warm", concurrency, count, warm_salt))
        await self.http.aclose()
        return rows


def percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def format_table(rows: list[Row], title: str) -> str:
    header = ("phase", "concurrency", "requests", "TTFT p50 s", "TTFT p90 s", "output tok/s",
              "cached/prompt")
    lines = [header]
    for row in rows:
        ttfts = [r.ttft_s for r in row.results if r.ttft_s is not None]
        output = sum(r.output_tokens for r in row.results)
        prompt = sum(r.prompt_tokens for r in row.results)
        cached = sum(r.cached_tokens for r in row.results)
        lines.append((
            row.phase, str(row.concurrency), str(len(row.results)),
            f"{percentile(ttfts, 50):.3f}" if ttfts else "-",
            f"{percentile(ttfts, 90):.3f}" if ttfts else "-",
            f"{output / row.wall_s:.1f}",
            f"{100 * cached / prompt:.1f}%" if prompt else "-",
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = [title]
    for n, line in enumerate(lines):
        out.append("  ".join(cell.rjust(w) if i else cell.ljust(w)
                             for i, (cell, w) in enumerate(zip(line, widths, strict=True))))
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def main() -> None:
    args = parse_args()
    workload = load_workload(args.workload)
    bench = Bench(args, workload)
    rows = asyncio.run(bench.main())
    prompt_tokens = rows[0].results[0].prompt_tokens if rows[0].results else 0
    title = (f"agentd serve benchmark: workload {workload.get('name', '?')} "
             f"({len(workload.get('tools') or [])} tools, ~{prompt_tokens} prompt tokens), "
             f"model {bench.model}, max_tokens {args.max_tokens}, {args.base_url}")
    print(format_table(rows, title))


if __name__ == "__main__":
    main()
