"""Helpers shared by the completion handlers: submitting to the engine, reading a request to its
end, watching for a client that goes away, and Server-Sent Events framing.

Invariant: an engine stream is always either read to its last delta or closed, and closing it
aborts the request (``AsyncEngine`` frees its blocks), so a client that disconnects — streaming
or not, before or after its first token — never leaves work behind. A request is submitted
before the reply starts, so "busy" (503 + ``Retry-After``) is a real status, never an error
inside a 200 stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from litestar import Request
from litestar.response import Stream

from agentd.engine.async_engine import AsyncEngine, EngineBusyError, EngineDeadError
from agentd.engine.outputs import StreamDelta
from agentd.engine.request import EngineRequest
from agentd.engine.request_stream import RequestStream
from agentd.pins.manager import tenant_salt
from agentd.server.errors import APIError

T = TypeVar("T")
RETRY_AFTER_S = 1
SSE_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_encoder = msgspec.json.Encoder()


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def submit(engine: AsyncEngine, request: EngineRequest,
           max_in_flight: int | None = None) -> RequestStream:
    """Queue the request, whole; the engine's at-once rejections become errors (503 when
    ``max_in_flight`` requests are in flight already, with ``Retry-After``)."""
    try:
        return engine.add_request(request, max_in_flight)
    except EngineBusyError as exc:
        raise APIError(503, str(exc), code="server_busy",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from exc
    except EngineDeadError as exc:
        raise APIError(503, str(exc)) from exc
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc


def effective_cache_salt(tenant: str | None, client_salt: str | None) -> str | None:
    """The salt mixed into a request's first block hash (vLLM's ``cache_salt`` semantics).

    Without a tenant (no keys, one key, or ``--shared-cache``) it is the client's salt as sent.
    With per-key isolation every salt starts with the key's tenant id, so no client salt can
    reach another tenant's blocks.
    """
    base = tenant_salt(tenant)  # a tenant's pins are hashed with it too
    if base is None or client_salt is None:
        return base or client_salt
    return f"{base}|salt:{client_salt}"


def delta_error(delta: StreamDelta) -> APIError:
    """The engine finished ``delta``'s request with an error: it can never fit in the pool, or
    its output constraint reached a dead end."""
    if delta.error_code == "grammar_dead_end":
        return APIError(500, str(delta.error), code="grammar_dead_end")
    return APIError(413, f"{delta.error}; shorten the prompt or raise --kv-cache-memory",
                    code="context_length_exceeded")


def exception_error(exc: BaseException) -> APIError:
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc))
    return APIError(500, f"the engine failed the request: {exc}")


@dataclass
class Collected:
    text: str
    last: StreamDelta
    token_ids: list[int]  # every output token id, as the engine produced them


async def collect(deltas: AsyncIterator[StreamDelta]) -> Collected:
    """Read a request to its end: the whole text and the last delta (usage, finish reason)."""
    pieces: list[str] = []
    token_ids: list[int] = []
    last: StreamDelta | None = None
    try:
        async for delta in deltas:
            pieces.append(delta.text)
            token_ids += delta.token_ids
            last = delta
    except (ValueError, RuntimeError) as exc:
        raise exception_error(exc) from exc
    assert last is not None  # the engine always ends a stream with a finished delta
    if last.error is not None:
        raise delta_error(last)
    return Collected("".join(pieces), last, token_ids)


async def until_disconnect(request: Request[Any, Any, Any], work: Awaitable[T],
                           deltas: RequestStream) -> T:
    """Await ``work`` (which reads ``deltas``) unless the client disconnects first; then cancel
    it. ``deltas`` is closed either way, so the request is aborted even if ``work`` never ran.

    The body has been read already, so the next ASGI message is ``http.disconnect``.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # takes effect at the task's next step: it is not done yet below
        await deltas.aclose()  # a no-op once the request finished
    if not task.done() or task.cancelled():
        raise APIError(499, "the client closed the connection", code="client_closed_request")
    return task.result()


async def _wait_disconnect(request: Request[Any, Any, Any]) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(obj: Any) -> bytes:
    """One Server-Sent Event carrying ``obj`` as JSON."""
    return b"data: " + _encoder.encode(obj) + b"\n\n"


class EventStream(Stream):
    """A ``text/event-stream`` response, whatever media type the handler declares for JSON."""

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["media_type"] = "text/event-stream"
        return super().to_asgi_response(*args, **kwargs)


SSE_COMMENT = b": keep-alive\n\n"  # OpenAI's wires: an SSE comment, which clients skip


async def with_keepalive(chunks: AsyncIterator[bytes], ping: bytes,
                         interval_s: float) -> AsyncIterator[bytes]:
    """``chunks``, with ``ping`` sent whenever none came for ``interval_s``: a long CPU prefill
    sends nothing for minutes, and clients give up on an idle stream. Closing this closes
    ``chunks`` (which aborts the request)."""
    source = aiter(chunks)
    pending = asyncio.ensure_future(anext(source))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield ping
                continue
            try:
                chunk = pending.result()
            except StopAsyncIteration:
                return
            yield chunk
            pending = asyncio.ensure_future(anext(source))
    finally:
        if not pending.done():
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
        await source.aclose()  # type: ignore[attr-defined]


def event_stream(events: AsyncIterator[bytes],
                 headers: dict[str, str] | None = None) -> EventStream:
    return EventStream(events, headers={**_SSE_HEADERS, **(headers or {})})
