"""Cache figures per ``prompt_cache_key``: the name a client gives a conversation or an agent
(OpenAI's field, on chat completions and responses), so ``agentd stats --by-key`` can say which
of them hit the prefix cache and which keep missing.

Invariants: bounded — at most ``MAX_KEYS`` keys are tracked, the least recently seen dropped
first — and per tenant: two API keys (tenants) that use the same ``prompt_cache_key`` are
counted apart and each sees only its own (operators see all, labelled by tenant).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentd.engine.outputs import StreamDelta

MAX_KEYS = 1024


@dataclass
class _KeyFigures:
    num_requests: int = 0
    num_hits: int = 0  # requests with any cached prompt token
    prompt_tokens: int = 0
    cached_tokens: int = 0


class KeyStats:
    """Thread-safe per-(tenant, key) counters of finished requests."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self._figures: OrderedDict[tuple[str | None, str], _KeyFigures] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, tenant: str | None, key: str, last: StreamDelta) -> None:
        with self._lock:
            figures = self._figures.pop((tenant, key), None) or _KeyFigures()
            self._figures[(tenant, key)] = figures
            while len(self._figures) > self.max_keys:
                self._figures.popitem(last=False)
            figures.num_requests += 1
            figures.num_hits += last.num_cached_tokens > 0
            figures.prompt_tokens += last.num_prompt_tokens
            figures.cached_tokens += last.num_cached_tokens

    def report(self) -> list[dict[str, Any]]:
        """One row per key, most prompt tokens first."""
        with self._lock:
            items = [(tenant, key, _KeyFigures(**vars(f))) for (tenant, key), f
                     in self._figures.items()]
        rows = [{"key": key, "tenant": tenant, "requests": f.num_requests, "hits": f.num_hits,
                 "prompt_tokens": f.prompt_tokens, "cached_tokens": f.cached_tokens,
                 "hit_rate": round(f.cached_tokens / f.prompt_tokens, 6) if f.prompt_tokens
                 else None} for tenant, key, f in items]
        return sorted(rows, key=lambda row: (-row["prompt_tokens"], row["key"]))
