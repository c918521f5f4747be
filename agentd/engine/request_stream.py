"""A request's deltas as the event loop reads them: an async iterator that always cleans up.

Invariant: a stream ends in exactly one of two ways: read to its last delta, or aborted — by
``aclose()``, by a cancelled read, or by being dropped unread (even before its first read) — and
either way its owner (:class:`agentd.engine.async_engine.AsyncEngine`) is told once, so the
request's blocks always return to the pool and its entry is always removed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from agentd.engine.outputs import StreamDelta


class RequestStream:
    """The deltas of one request: an async iterator that always cleans up after itself.

    Unlike an async generator, whose ``finally`` never runs when it is closed before its first
    read, this aborts its request on ``aclose()``/``abort()``, on a cancelled read and when it is
    garbage-collected unfinished.
    """

    def __init__(self, request_id: str, queue: asyncio.Queue[StreamDelta | BaseException],
                 release: Callable[[str, bool], None]) -> None:
        """``release(request_id, abort)`` is called once, when the stream ends: its owner forgets
        it, and aborts the request when ``abort``."""
        self.request_id = request_id
        self._queue = queue
        self._release = release
        self._done = False

    @property
    def done(self) -> bool:
        """True once the last delta was read or the request was aborted."""
        return self._done

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamDelta:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # the reader was cancelled: nobody will read the rest
            self.abort()
            raise
        if isinstance(item, BaseException):
            self._end(abort=False)
            raise item
        if item.finished:
            self._end(abort=False)
        return item

    async def aclose(self) -> None:
        """Abort the request unless it has finished (idempotent)."""
        self.abort()

    def abort(self) -> None:
        """Abort the request unless it has finished (idempotent; safe from any thread)."""
        self._end(abort=True)

    def _end(self, abort: bool) -> None:
        if not self._done:
            self._done = True
            self._release(self.request_id, abort)

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            try:
                self.abort()
            except Exception:  # interpreter shutdown: the engine is gone anyway
                pass
