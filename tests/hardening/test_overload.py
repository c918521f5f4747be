"""Overload over a real loopback server: past ``max_num_seqs + max_queue`` requests in flight the
daemon answers 503 with ``Retry-After`` at once — streams included, never a 200 that carries an
error — and under a burst of 200 concurrent clients every request either completes or is refused
with 503, nothing else; afterwards no block is held and memory is back near where it started.
"""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest

from agentd.config import EngineConfig
from agentd.engine.async_engine import AsyncEngine
from agentd.engine.llm_engine import LLMEngine
from agentd.server.app import ServerSettings, create_app

USER = [{"role": "user", "content": "Tell me a long story about caches."}]
MAX_QUEUE = 8
NUM_CLIENTS = 200
REQUESTS_PER_CLIENT = 2
RSS_TOLERANCE_BYTES = 48 * 2**20  # a second identical burst may grow RSS by at most this much


# --- the bound, deterministically: one slot --------------------------------------------------
@pytest.fixture(scope="module")
def one_slot_url(tiny, serve) -> Iterator[str]:
    """A server whose engine runs one request at a time and lets none wait (limit: 1)."""
    config, shared = tiny
    small = EngineConfig(model=config.model, kv_cache_memory_bytes=config.kv_cache_memory_bytes,
                         max_num_seqs=1)
    engine = AsyncEngine(LLMEngine(small, loaded=shared.engine.loaded))
    engine.start()
    try:
        with serve(create_app(small, engine=engine, settings=ServerSettings(max_queue=0))) as url:
            yield url
    finally:
        engine.shutdown()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_past_the_bound_is_503_with_retry_after(one_slot_url: str, path: str, openai_error,
                                               idle) -> None:
    body = {"messages": USER, "prompt": "Tell me a story", "max_tokens": 3000,
            "ignore_eos": True, "temperature": 0}
    with httpx.Client(base_url=one_slot_url, timeout=60) as http:
        with http.stream("POST", path, json={**body, "stream": True}) as running:
            assert running.status_code == 200
            lines = running.iter_lines()  # keep it: a dropped iterator closes the response
            next(lines)  # the request holds the only slot now
            for stream in (False, True):
                refused = http.post(path, json={**body, "max_tokens": 2, "stream": stream})
                error = openai_error(refused, 503)
                assert error["code"] == "server_busy" and error["type"] == "server_error"
                assert int(refused.headers["retry-after"]) >= 1
            next(lines)  # still streaming
        idle(http.get, num_pinned_ok=False)  # hanging up freed the slot ...
        served = http.post(path, json={**body, "max_tokens": 2})
        assert served.status_code == 200, served.text  # ... and the next request is served


# --- a burst of 200 concurrent clients ------------------------------------------------------
@pytest.fixture(scope="module")
def queue_url(tiny, serve) -> Iterator[str]:
    config, engine = tiny
    with serve(create_app(config, engine=engine,
                          settings=ServerSettings(max_queue=MAX_QUEUE))) as url:
        yield url


async def _one(http: httpx.AsyncClient, i: int, outcomes: Counter[str]) -> None:
    stream = i % 2 == 1
    body = {"messages": [{"role": "user", "content": f"Story number {i % 17} about caches."}],
            "max_tokens": 16, "ignore_eos": True, "temperature": 0, "stream": stream}
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        text = (await response.aread()).decode()
    if response.status_code == 503:
        assert int(response.headers["retry-after"]) >= 1
        assert json.loads(text)["error"]["code"] == "server_busy"
        outcomes["503"] += 1
        return
    assert response.status_code == 200, f"{response.status_code}: {text[:300]}"
    if stream:
        assert text.endswith("data: [DONE]\n\n") and '"error"' not in text, text[-300:]
        assert '"finish_reason":"length"' in text
    else:
        assert json.loads(text)["usage"]["completion_tokens"] == 16
    outcomes["200"] += 1


async def _burst(url: str) -> Counter[str]:
    outcomes: Counter[str] = Counter()
    # a new connection per request: no keep-alive reuse racing uvicorn's idle-connection close
    limits = httpx.Limits(max_connections=NUM_CLIENTS, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:

        async def client(c: int) -> None:
            for r in range(REQUESTS_PER_CLIENT):
                await _one(http, c * REQUESTS_PER_CLIENT + r, outcomes)

        await asyncio.gather(*(client(c) for c in range(NUM_CLIENTS)))
    return outcomes


def _rss_after_gc() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def test_two_hundred_clients_get_200_or_503_and_nothing_leaks(tiny, queue_url: str,
                                                              idle) -> None:
    _, engine = tiny
    limit = engine.max_num_seqs + MAX_QUEUE
    peak = 0
    stop = threading.Event()

    def watch() -> None:  # the engine's in-flight count, sampled from another thread
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, engine.num_in_flight)
            time.sleep(0.002)

    def get(path: str) -> httpx.Response:
        return httpx.get(f"{queue_url}{path}", timeout=30)

    warmup = asyncio.run(_burst(queue_url))  # allocator arenas, caches, connection pools
    idle(get, num_pinned_ok=False)
    rss_before = _rss_after_gc()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        outcomes = asyncio.run(_burst(queue_url))
    finally:
        stop.set()
        watcher.join()
    report = idle(get, num_pinned_ok=False)
    rss_after = _rss_after_gc()
    total = NUM_CLIENTS * REQUESTS_PER_CLIENT
    for run_outcomes in (warmup, outcomes):
        assert sum(run_outcomes.values()) == total and set(run_outcomes) <= {"200", "503"}
    assert outcomes["503"] > 0 and outcomes["200"] >= limit  # the bound bit, work still flowed
    assert peak <= limit
    assert report["num_blocks_used"] == 0 and engine.pending()["streams"] == 0
    growth = rss_after - rss_before
    print(f"burst outcomes {dict(outcomes)}, peak in flight {peak}/{limit}, "
          f"RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB")
    assert growth < RSS_TOLERANCE_BYTES, f"RSS grew by {growth / 2**20:.1f} MiB"


def test_health_and_stats_answer_while_saturated(queue_url: str) -> None:
    """Monitoring never waits behind the queue: /health, /v1/stats and /metrics answer during
    a burst."""

    async def main() -> list[int]:
        burst = asyncio.create_task(_burst(queue_url))
        await asyncio.sleep(0.3)
        async with httpx.AsyncClient(base_url=queue_url, timeout=10) as http:
            codes = [(await http.get(path)).status_code
                     for path in ("/health", "/v1/stats", "/metrics")]
        outcomes: Any = await burst
        assert set(outcomes) <= {"200", "503"}
        return codes

    assert asyncio.run(main()) == [200, 200, 200]
