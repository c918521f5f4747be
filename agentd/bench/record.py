"""A recording reverse proxy: what a client sends a server, and what the server answers, one JSON
line per exchange.

The coding agents (Claude Code, Codex CLI, opencode) are tested and benchmarked on their real
traffic: pointed at this proxy instead of the daemon, every request they make is passed on as
sent (streams too, chunk by chunk) and written to a JSONL file with its status, timings and the
usage the server reported. ``benchmarks/harness_replay.py`` replays such a file;
``tests/clients/test_coding_agents.py`` judges a session by it.

    python -m agentd.bench.record --upstream http://127.0.0.1:8000 --port 8001 --out s.jsonl

Invariants: the proxy changes nothing it passes on but hop-by-hop headers and ``Host``; a
record is written once its response has ended (or the client went away), so a line is always a
whole exchange; bodies are recorded decoded (gzip, zstd) when they are JSON, and a record's
``usage`` is read from the reply's own usage fields, on every wire.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import httpx

HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te",
              "trailer", "upgrade", "host", "content-length"}
# Request headers a record keeps (the rest are the client's plumbing): who sent it, its session.
KEPT_HEADERS = {"user-agent", "content-encoding", "anthropic-beta", "x-claude-code-session-id",
                "session-id", "session_id", "thread-id", "x-session-id", "x-session-affinity",
                "conversation_id", "originator"}


@dataclass(frozen=True)
class Usage:
    """A reply's prompt tokens, how many the cache served, and its output tokens."""

    prompt_tokens: int
    cached_tokens: int
    output_tokens: int

    @property
    def cached_fraction(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def decode_body(raw: bytes, encoding: str | None) -> Any:
    """A request or reply body as JSON when it is JSON (after its Content-Encoding), else None."""
    try:
        if encoding == "gzip":
            raw = gzip.decompress(raw)
        elif encoding == "zstd":
            import zstandard

            raw = zstandard.ZstdDecompressor().decompressobj().decompress(raw)
        return json.loads(raw) if raw else None
    except (ValueError, OSError, ImportError):
        return None


def sse_events(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The JSON ``data:`` payloads of an event stream's lines, as they come."""
    for line in lines:
        if line.startswith("data:"):
            payload = line[5:].strip()
            if payload and payload != "[DONE]":
                try:
                    event = json.loads(payload)
                except ValueError:
                    continue
                if isinstance(event, dict):
                    yield event


def usage_of(reply: list[dict[str, Any]]) -> Usage | None:
    """The usage a reply reports, whatever its wire: Chat and Completions ``usage`` (streamed in
    the last chunk), Responses ``response.usage``, Messages ``message.usage`` (the prompt is its
    uncached, cache-written and cache-read tokens together)."""
    prompt = cached = output = None
    for event in reply:
        if event.get("type") == "message_start":
            event = event.get("message", {})
        if event.get("type") in ("response.completed", "response.incomplete"):
            event = event.get("response", {})
        usage = event.get("usage")
        if not isinstance(usage, dict):
            continue
        if "prompt_tokens" in usage:  # Chat Completions, Completions
            prompt = usage["prompt_tokens"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            output = usage.get("completion_tokens", 0)
        elif "input_tokens_details" in usage or "output_tokens_details" in usage:  # Responses
            prompt = usage.get("input_tokens", 0)
            cached = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
            output = usage.get("output_tokens", 0)
        else:  # Messages: message_start, then message_delta's output count
            if "input_tokens" in usage:
                read = usage.get("cache_read_input_tokens") or 0
                prompt = (usage["input_tokens"] + read
                          + (usage.get("cache_creation_input_tokens") or 0))
                cached = read
            output = usage.get("output_tokens", output)
    if prompt is None:
        return None
    return Usage(prompt, cached or 0, output or 0)


def finish_of(reply: list[dict[str, Any]]) -> str | None:
    """How a reply ended, on any wire: a Chat/Completions ``finish_reason``, a Messages
    ``stop_reason``, or a Responses status (``incomplete:<reason>`` when cut short)."""
    finish = None
    for event in reply:
        if (event.get("type") in ("response.completed", "response.incomplete")
                or event.get("object") == "response"):
            response = event.get("response", event)
            reason = (response.get("incomplete_details") or {}).get("reason")
            finish = response.get("status", finish) + (f":{reason}" if reason else "")
        for choice in event.get("choices") or []:
            finish = choice.get("finish_reason") or finish
        message = event.get("message", event) if event.get("type") == "message_start" else event
        delta = event.get("delta")  # a Messages delta's fields, or a Responses delta's text
        stop = (delta.get("stop_reason") if isinstance(delta, dict) else None) \
            or message.get("stop_reason")
        finish = stop or finish
    return finish


def reply_events(raw: bytes, content_type: str) -> list[dict[str, Any]]:
    if "event-stream" in content_type:
        return list(sse_events(raw.decode("utf-8", "replace").splitlines()))
    body = decode_body(raw, None)
    return [body] if isinstance(body, dict) else []


class Recorder:
    """The proxy as an ASGI app; ``records`` holds every exchange, and each is appended to
    ``out`` (JSONL) as it ends."""

    def __init__(self, upstream: str, out: Path | None = None, label: str = "") -> None:
        self.upstream = upstream.rstrip("/")
        self.out = out
        self.label = label
        self.records: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._client: httpx.AsyncClient | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            if self._client is not None:
                await self._client.aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(3600.0, connect=10.0))
        body = bytearray()
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        sent = {k.lower(): v for k, v in headers}
        query = scope.get("query_string", b"").decode("latin-1")
        url = self.upstream + scope["path"] + (f"?{query}" if query else "")
        record: dict[str, Any] = {
            "label": self.label, "time": time.time(), "method": scope["method"],
            "path": scope["path"], "query": query,
            "headers": {k: v for k, v in sent.items() if k in KEPT_HEADERS},
            "body": decode_body(bytes(body), sent.get("content-encoding")),
        }
        start = time.perf_counter()
        request = self._client.build_request(
            scope["method"], url, content=bytes(body),
            headers=[(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP])
        reply = bytearray()
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            record.update(status=502, error=repr(exc))
            await send({"type": "http.response.start", "status": 502, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            self._keep(record)
            return
        record["status"] = response.status_code
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": [(k.encode("latin-1"), v.encode("latin-1"))
                                for k, v in response.headers.multi_items()
                                if k.lower() not in HOP_BY_HOP]})
        try:
            async for chunk in response.aiter_raw():
                record.setdefault("first_byte_s", time.perf_counter() - start)
                reply += chunk
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        except OSError as exc:  # the client went away
            record["client_disconnected"] = repr(exc)
        finally:
            await response.aclose()
            content_type = response.headers.get("content-type", "")
            events = reply_events(bytes(reply), content_type)
            usage = usage_of(events)
            record["duration_s"] = time.perf_counter() - start
            record["usage"] = None if usage is None else usage.__dict__
            record["finish"] = finish_of(events)
            if response.status_code >= 400 or "event-stream" not in content_type:
                record["reply"] = events[0] if events else bytes(reply[:4096]).decode(
                    "utf-8", "replace")
            self._keep(record)

    def _keep(self, record: dict[str, Any]) -> None:
        with self._lock:
            self.records.append(record)
            if self.out is not None:
                with self.out.open("a") as f:
                    f.write(json.dumps(record) + "\n")


def read_records(path: Path) -> list[dict[str, Any]]:
    """A recording's exchanges (``.jsonl`` or ``.jsonl.gz``)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


@contextmanager
def recording(upstream: str, out: Path | None = None, label: str = "") -> Iterator[
        tuple[str, Recorder]]:
    """A recorder in front of ``upstream`` on a free loopback port: yields its URL and itself."""
    import socket

    import uvicorn

    recorder = Recorder(upstream, out, label)
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(recorder, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the recording proxy did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", recorder
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@click.command()
@click.option("--upstream", required=True, help="The server to pass requests on to.")
@click.option("--port", default=8001, show_default=True, help="The port to listen on (loopback).")
@click.option("--out", required=True, type=click.Path(path_type=Path),
              help="The JSONL file each exchange is appended to.")
@click.option("--label", default="", help="A label written into every record.")
def main(upstream: str, port: int, out: Path, label: str) -> None:
    """Record every exchange between a client and UPSTREAM."""
    import uvicorn

    uvicorn.run(Recorder(upstream, out, label), host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main()
