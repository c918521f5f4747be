"""Streams that go away: however a consumer leaves — ``aclose()`` before the first read, dropping
the stream unread, ``break`` out of ``async for``, a cancelled read, an HTTP client that hangs
up mid-stream — its request is aborted and its blocks go back to the pool, while the streams
that stay produce exactly what they produce alone. Also: the in-flight bound and a stopped engine
refuse at once, with nothing queued.
"""

from __future__ import annotations

import asyncio
import gc
import random
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import pytest

from agentd.config import EngineConfig
from agentd.engine.async_engine import AsyncEngine, EngineBusyError, EngineDeadError, RequestStream
from agentd.engine.llm_engine import LLMEngine
from agentd.engine.request import EngineRequest
from agentd.engine.sampling_params import SamplingParams
from agentd.server.app import create_app

LONG = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
MODES = ("close-unread", "drop-unread", "aclose", "break", "cancel")
TEXTS = ["The quick brown fox jumps over", "def fibonacci(n):", "In 1492, Columbus sailed",
         "Dear team, the deploy is"]


def run(engine: AsyncEngine, main: Callable[[], Awaitable[Any]], timeout_s: float = 120) -> Any:
    async def guarded() -> Any:
        try:
            return await asyncio.wait_for(main(), timeout_s)
        finally:
            await wait_engine_idle(engine)

    return asyncio.run(guarded())


async def wait_engine_idle(engine: AsyncEngine, timeout_s: float = 30.0) -> None:
    """Poll the engine's integrity report until nothing runs, waits, streams or holds a block."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        report = await engine.check_integrity()
        assert report.ok, report.error
        if not (report.num_requests or report.num_streams or report.num_blocks_used):
            return
        assert loop.time() < deadline, f"the engine never went idle: {report}"
        await asyncio.sleep(0.02)


async def read_all(stream: RequestStream) -> list[int]:
    return [t async for delta in stream for t in delta.token_ids]


def prompt_ids(engine: AsyncEngine, text: str) -> list[int]:
    return engine.tokenizer(text).input_ids


# --- RequestStream, one way of leaving at a time ----------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_every_way_of_leaving_aborts_the_request(tiny, mode: str) -> None:
    _, engine = tiny
    prompt = prompt_ids(engine, "Tell me about caches and what they are for")

    async def main() -> None:
        await leave(engine, prompt, mode, num_reads=3)
        await wait_engine_idle(engine)
        assert engine.pending()["streams"] == 0
        # and the engine still serves
        assert len(await read_all(engine.add_request(
            EngineRequest(prompt, GREEDY)))) == GREEDY.max_tokens

    run(engine, main)


async def leave(engine: AsyncEngine, prompt: list[int], mode: str, num_reads: int) -> None:
    """Open a long stream and walk away from it after ``num_reads`` deltas, the ``mode`` way."""
    stream = engine.add_request(EngineRequest(prompt, LONG))
    if mode == "close-unread":
        await stream.aclose()
        assert stream.done
        return
    if mode == "drop-unread":
        del stream
        gc.collect()
        return
    if mode == "cancel":
        got_enough = asyncio.Event()

        async def consume() -> None:
            num_seen = 0
            async for _ in stream:
                num_seen += 1
                if num_seen >= num_reads:
                    got_enough.set()

        task = asyncio.create_task(consume())
        if num_reads:
            await got_enough.wait()
        else:
            await asyncio.sleep(0)  # the task has started and awaits its first delta
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert stream.done
        return
    num_seen = 0
    async for delta in stream:
        assert not delta.finished
        num_seen += 1
        if num_seen >= num_reads:
            break
    if mode == "aclose":
        await stream.aclose()
        await stream.aclose()  # idempotent
        assert stream.done
    else:  # "break": the consumer simply drops it
        del stream
        gc.collect()


def test_a_finished_stream_ends_and_closing_it_is_a_no_op(tiny) -> None:
    _, engine = tiny
    prompt = prompt_ids(engine, "Hello there")

    async def main() -> None:
        stream = engine.add_request(
            EngineRequest(prompt, SamplingParams(temperature=0.0, max_tokens=3)))
        deltas = [d async for d in stream]
        assert deltas[-1].finished and stream.done
        assert [d async for d in stream] == []  # exhausted stays exhausted
        before = await engine.call(lambda e: e.stats().totals.num_requests_finished)
        await stream.aclose()
        stream.abort()
        await wait_engine_idle(engine)
        assert await engine.call(lambda e: e.stats().totals.num_requests_finished) == before

    run(engine, main)


def test_the_in_flight_bound_refuses_at_once_and_queues_nothing(tiny) -> None:
    _, engine = tiny
    prompt = prompt_ids(engine, "Hello there")

    async def main() -> None:
        first = engine.add_request(EngineRequest(prompt, LONG), max_in_flight=1)
        with pytest.raises(EngineBusyError, match="busy"):
            engine.add_request(EngineRequest(prompt, LONG), max_in_flight=1)
        assert engine.num_in_flight == 1
        await first.aclose()
        await wait_engine_idle(engine)
        second = engine.add_request(EngineRequest(prompt, GREEDY), max_in_flight=1)
        assert len(await read_all(second)) == GREEDY.max_tokens

    run(engine, main)


def test_a_stopped_engine_refuses_new_requests_and_ends_open_streams(tiny) -> None:
    config, shared = tiny
    engine = AsyncEngine(LLMEngine(
        EngineConfig(model=config.model, kv_cache_memory_bytes=config.kv_cache_memory_bytes),
        loaded=shared.engine.loaded))
    engine.start()
    prompt = prompt_ids(engine, "Hello there")

    async def main() -> None:
        stream = engine.add_request(EngineRequest(prompt, SamplingParams(
            temperature=0.0, max_tokens=3000, ignore_eos=True)))
        await stream.__anext__()
        await asyncio.to_thread(engine.shutdown)
        deltas = [d async for d in stream]  # the stream ends: aborted, not hanging
        assert deltas and deltas[-1].finish_reason == "abort"
        with pytest.raises(EngineDeadError):
            engine.add_request(EngineRequest(prompt, GREEDY))
        assert engine.pending()["streams"] == 0

    asyncio.run(asyncio.wait_for(main(), 60))


# --- 50 streams abandoned at random points while 4 others run --------------------------------
def test_fifty_abandoned_streams_free_their_blocks_and_leave_the_others_unchanged(tiny) -> None:
    _, engine = tiny
    rng = random.Random(20240527)
    survivors = [prompt_ids(engine, text) for text in TEXTS]
    quitters = [prompt_ids(engine, f"{rng.choice(TEXTS)} and then number {i} said")
                for i in range(50)]
    plans = [(rng.choice(MODES), rng.randrange(0, 25)) for _ in quitters]

    async def solo() -> list[list[int]]:
        return [await read_all(engine.add_request(EngineRequest(p, GREEDY))) for p in survivors]

    async def crowd() -> tuple[list[list[int]], int]:
        kept = [asyncio.create_task(read_all(engine.add_request(EngineRequest(p, GREEDY))))
                for p in survivors]
        peak = 0

        async def one(prompt: list[int], mode: str, num_reads: int) -> None:
            nonlocal peak
            await asyncio.sleep(rng.random() * 0.5)
            peak = max(peak, engine.num_in_flight)
            await leave(engine, prompt, mode, num_reads)

        await asyncio.gather(*(one(p, *plan) for p, plan in zip(quitters, plans, strict=True)))
        return await asyncio.gather(*kept), peak

    alone = run(engine, solo)
    together, peak = run(engine, crowd)
    assert together == alone
    assert all(len(tokens) == GREEDY.max_tokens for tokens in alone)
    assert peak > len(survivors)  # the quitters really ran beside the survivors
    assert engine.pending() == {"streams": 0, "commands": 0}


# --- the same over HTTP: clients that hang up mid-stream ---------------------------------------
@pytest.fixture(scope="module")
def live_url(tiny, serve) -> Iterator[str]:
    config, engine = tiny
    with serve(create_app(config, engine=engine)) as url:
        yield url


def _chat_body(text: str, max_tokens: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}


async def _stream_text(http: httpx.AsyncClient, text: str, max_tokens: int,
                       num_lines: int | None = None) -> str:
    """Read a chat stream; with ``num_lines``, hang up after that many lines."""
    pieces: list[str] = []
    async with http.stream("POST", "/v1/chat/completions", json=_chat_body(text, max_tokens)) \
            as response:
        assert response.status_code == 200
        num_read = 0
        async for line in response.aiter_lines():
            if num_lines is not None and num_read >= num_lines:
                break  # leaving the block closes the connection
            num_read += 1
            if line.startswith("data: {"):
                pieces.append(line)
    return "\n".join(pieces)


def test_fifty_http_clients_hanging_up_free_everything(live_url: str, idle) -> None:
    rng = random.Random(7)
    cuts = [rng.randrange(0, 40) for _ in range(50)]

    def content(events: str) -> str:
        import json

        return "".join(json.loads(e[len("data: "):])["choices"][0]["delta"].get("content") or ""
                       for e in events.splitlines() if '"choices":[{' in e)

    async def main() -> tuple[list[str], list[str]]:
        async with httpx.AsyncClient(base_url=live_url, timeout=120,
                                     limits=httpx.Limits(max_connections=100)) as http:
            alone = [content(await _stream_text(http, t, 40)) for t in TEXTS]
            kept = [asyncio.create_task(_stream_text(http, t, 40)) for t in TEXTS]

            async def quitter(i: int) -> None:
                await asyncio.sleep(rng.random() * 0.5)
                await _stream_text(http, f"{TEXTS[i % 4]} number {i}", 200, cuts[i])

            await asyncio.gather(*(quitter(i) for i in range(50)))
            together = [content(events) for events in await asyncio.gather(*kept)]
            return alone, together

    def generated() -> int:
        return httpx.get(f"{live_url}/v1/stats", timeout=30).json()["generation_tokens_total"]

    before = generated()
    alone, together = asyncio.run(asyncio.wait_for(main(), 180))
    assert together == alone and all(alone)
    idle(lambda path: httpx.get(f"{live_url}{path}", timeout=30), num_pinned_ok=False)
    assert generated() - before < 8 * 40 + 50 * 200 // 2  # the quitters were cut short


def test_non_streamed_clients_timing_out_leave_no_server_error(live_url: str, idle,
                                                               caplog) -> None:
    """A non-streamed request whose client gives up is aborted quietly: no 'unhandled error'
    (the handler once read the result of a task it had just cancelled)."""
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 2000, "ignore_eos": True, "temperature": 0}
    with caplog.at_level("ERROR", logger="agentd.server"):
        for timeout_s in (0.05, 0.2, 0.5):
            with pytest.raises(httpx.TimeoutException):
                httpx.post(f"{live_url}/v1/chat/completions", json=body, timeout=timeout_s)
        idle(lambda path: httpx.get(f"{live_url}{path}", timeout=30), num_pinned_ok=False)
    assert not [r for r in caplog.records if r.name == "agentd.server"], caplog.text


def test_shutdown_during_a_long_step_still_answers_every_request(tiny, monkeypatch,
                                                                 poll, tmp_path) -> None:
    """``serve`` with a 1 s grace while every engine step takes 2 s (a long prefill on a busy
    CPU): the abort cannot land between steps in time, so open requests are ended from the
    event loop — a JSON reply (200 "abort" or an OpenAI-shaped 503) or a stream that ends with
    [DONE] — never uvicorn's plain-text 500; and serve returns 0."""
    import socket
    import threading
    import time

    from agentd.engine.llm_engine import LLMEngine as Engine
    from agentd.server.serve import serve
    from agentd.server.settings import ServerSettings

    config, _ = tiny
    slow = threading.Event()
    real_step = Engine.step

    def step(self):
        if slow.is_set():
            time.sleep(2.0)
        return real_step(self)

    monkeypatch.setattr(Engine, "step", step)
    threads_before = set(threading.enumerate())
    sock = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    status: list[int] = []
    thread = threading.Thread(daemon=True, target=lambda: status.append(serve(
        config, ServerSettings(shutdown_grace_s=1.0, state_dir=tmp_path), sock,
        log_level="warning")))
    thread.start()

    def health() -> int | None:
        try:
            return httpx.get(f"{url}/health").status_code
        except httpx.TransportError:
            return None

    poll(health, lambda code: code == 200)
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 3000,
            "ignore_eos": True, "temperature": 0}
    replies: dict[str, httpx.Response | str] = {}

    def plain() -> None:
        replies["plain"] = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)

    def streamed() -> None:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True},
                          timeout=60) as response:
            replies["stream"] = "\n".join(response.iter_lines())

    clients = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    for client in clients:
        client.start()
    time.sleep(0.5)  # both are running
    slow.set()
    time.sleep(0.1)
    token = (tmp_path / "cli.token").read_text().strip()
    assert httpx.post(f"{url}/admin/shutdown", headers={"x-agentd-token": token}).status_code \
        == 202
    for client in clients:
        client.join(30)
    thread.join(30)
    plain_reply = replies["plain"]
    assert isinstance(plain_reply, httpx.Response)
    assert plain_reply.headers["content-type"].startswith("application/json"), plain_reply.text
    if plain_reply.status_code == 200:
        assert plain_reply.json()["choices"][0]["finish_reason"] == "abort"
    else:
        assert plain_reply.status_code == 503 and "shutting down" in \
            plain_reply.json()["error"]["message"]
    events = [line for line in str(replies["stream"]).splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert '"finish_reason":"abort"' in events[-2] or '"service_unavailable"' in events[-2] \
        or "shutting down" in events[-2], events[-2]
    assert status == [0]
    # serve returned only once its engine thread had left the slow step: a process that exits
    # with that thread inside torch dies of SIGABRT ("terminate called without an active
    # exception") instead of exiting 0
    assert not [t for t in set(threading.enumerate()) - threads_before
                if t.name == "agentd-engine"]
