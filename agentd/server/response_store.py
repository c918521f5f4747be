"""Stored responses (``store: true``): the reply a client can fetch again, and the exact token
ids of its prompt and output, which ``previous_response_id`` continues from.

Invariants: bounded — at most ``max_size`` responses per owner (the API key that made them,
``agentd.server.auth.key_owner``, whether or not keys share the cache), the least recently
used dropped first, and none kept past ``ttl_s`` after its last use; an owner only ever reads,
continues or deletes its own (another key's id is "not found", as an unknown one is); a
dropped response releases its engine tail (``release``), so the pool never holds a block for a
conversation nobody can continue. Thread-safe: handlers may run on any worker.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StoredResponse:
    """A finished response as the client saw it, and what a continuation needs."""

    response: Any  # the wire's Response struct
    token_ids: list[int]  # prompt + output, exactly as the engine ran them
    request_id: str  # the engine request whose tail is kept
    instructions: str | None
    function_calls: list[dict[str, Any]] = field(default_factory=list)  # its output's calls
    used_s: float = field(default_factory=time.monotonic)


class ResponseStore:
    """Responses by (owner, id); ``release`` gets the engine request ids of dropped ones."""

    def __init__(self, max_size: int, ttl_s: float,
                 release: Callable[[list[str]], None]) -> None:
        self.max_size = max_size
        self.ttl_s = ttl_s
        self._release = release
        self._items: dict[str | None, OrderedDict[str, StoredResponse]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(items) for items in self._items.values())

    def put(self, owner: str | None, response_id: str, stored: StoredResponse) -> None:
        dropped: list[StoredResponse] = []
        with self._lock:
            items = self._items.setdefault(owner, OrderedDict())
            items[response_id] = stored
            dropped += self._expire(items)
            while len(items) > self.max_size:
                dropped.append(items.popitem(last=False)[1])
        self._release([s.request_id for s in dropped])

    def get(self, owner: str | None, response_id: str) -> StoredResponse | None:
        """The stored response (now the most recently used), or None if unknown or expired."""
        with self._lock:
            items = self._items.get(owner)
            dropped = self._expire(items) if items is not None else []
            stored = items.get(response_id) if items is not None else None
            if stored is not None:
                stored.used_s = time.monotonic()
                items.move_to_end(response_id)  # type: ignore[union-attr]
        self._release([s.request_id for s in dropped])
        return stored

    def delete(self, owner: str | None, response_id: str) -> bool:
        with self._lock:
            stored = self._items.get(owner, OrderedDict()).pop(response_id, None)
        if stored is not None:
            self._release([stored.request_id])
        return stored is not None

    def clear(self) -> None:
        """Forget every response (the app is closing): their engine tails are released."""
        with self._lock:
            dropped = [s for items in self._items.values() for s in items.values()]
            self._items.clear()
        self._release([s.request_id for s in dropped])

    def _expire(self, items: OrderedDict[str, StoredResponse]) -> list[StoredResponse]:
        """Drop (and return) the responses unused for ``ttl_s``; the oldest come first."""
        cutoff = time.monotonic() - self.ttl_s
        dropped = []
        while items and next(iter(items.values())).used_s < cutoff:
            dropped.append(items.popitem(last=False)[1])
        return dropped
