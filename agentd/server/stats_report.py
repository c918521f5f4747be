"""What ``GET /v1/stats`` reports beyond the engine's counters: TTFT of cache hits vs misses,
recent generation throughput, the pins (hits, tokens served, near misses, restore report) and
the prefixes retained by cache control (hits, TTL left).

Invariants: the window of recent requests is bounded (``WINDOW_REQUESTS`` entries, and only the
last ``WINDOW_S`` seconds count for throughput), so memory and the cost of a stats call stay
flat however long the daemon runs; everything here reads snapshots (the engine's stats and pin
summary, copied by the engine thread), never the engine itself, so stats answer at once even
during a long prefill. A request is a cache *hit* when any of its prompt tokens came from the
prefix cache (``num_cached_tokens > 0``).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from agentd.engine.llm_engine import EngineStats
    from agentd.engine.outputs import StreamDelta
    from agentd.pins.manager import PinSummary

WINDOW_REQUESTS = 2048
WINDOW_S = 60.0
NUM_RECENT_NEAR_MISSES = 5
NUM_TOP_CAUSES = 10


class _Finished(NamedTuple):
    arrival_s: float  # monotonic
    finished_s: float  # monotonic
    ttft_s: float | None
    hit: bool
    num_output_tokens: int


class RecentRequests:
    """A bounded window of finished requests (any thread may record, any may read)."""

    def __init__(self, maxlen: int = WINDOW_REQUESTS) -> None:
        self._items: deque[_Finished] = deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def record(self, last: StreamDelta, now_s: float | None = None) -> None:
        ttft = None
        if last.first_token_time_s is not None:
            ttft = max(last.first_token_time_s - last.arrival_time_s, 0.0)
        item = _Finished(last.arrival_time_s, now_s if now_s is not None else time.monotonic(),
                         ttft, last.num_cached_tokens > 0, last.num_output_tokens)
        with self._lock:
            self._items.append(item)

    def _snapshot(self) -> list[_Finished]:
        with self._lock:
            return list(self._items)

    def ttft(self) -> dict[str, dict[str, Any]]:
        """TTFT percentiles (seconds) of the window's cache hits and misses."""
        items = self._snapshot()
        out = {}
        for outcome, hit in (("hit", True), ("miss", False)):
            values = sorted(i.ttft_s for i in items if i.hit is hit and i.ttft_s is not None)
            out[outcome] = {"count": len(values),
                            **{f"p{q}": _percentile(values, q) for q in (50, 90, 99)}}
        return out

    def tokens_per_s(self, now_s: float | None = None) -> float:
        """Output tokens of the requests finished in the last ``WINDOW_S`` seconds, divided by
        the time from the earliest of their arrivals (at most the window) to now."""
        now_s = now_s if now_s is not None else time.monotonic()
        recent = [i for i in self._snapshot() if now_s - i.finished_s <= WINDOW_S]
        if not recent:
            return 0.0
        span_s = now_s - max(min(i.arrival_s for i in recent), now_s - WINDOW_S)
        return round(sum(i.num_output_tokens for i in recent) / max(span_s, 1e-3), 3)


def _percentile(sorted_values: list[float], q: int) -> float | None:
    """Nearest-rank percentile; None for an empty list."""
    if not sorted_values:
        return None
    rank = max(math.ceil(q / 100 * len(sorted_values)), 1)
    return round(sorted_values[rank - 1], 6)


def pins_report(summary: PinSummary, now_s: float | None = None) -> list[dict[str, Any]]:
    """Per pin: size, hits (requests matched), tokens served from the cache (= prefill saved)."""
    now_s = now_s if now_s is not None else time.monotonic()
    return [{"name": p.name, "owner": p.owner, "num_tokens": p.num_tokens,
             "num_blocks": p.num_blocks, "hits": p.num_hits,
             "tokens_served": p.num_tokens_served, "ttl": p.ttl_s,
             "idle_s": round(now_s - p.last_hit_s, 3),
             "near_misses": sum(c.count for c in summary.near_miss_counts
                                if (c.owner, c.pin) == (p.owner, p.name))}
            for p in summary.pins]


def retained_report(summary: PinSummary, now_s: float | None = None) -> list[dict[str, Any]]:
    """Per retained prefix (newest use first): size, hits, tokens served, TTL and TTL left;
    ``ends_with`` is the text before its end (where its breakpoint fell)."""
    now_s = now_s if now_s is not None else time.monotonic()
    return [{"owner": r.owner, "num_tokens": r.num_tokens, "num_blocks": r.num_blocks,
             "hits": r.num_hits, "tokens_served": r.num_tokens_served, "ttl": r.ttl_s,
             "ttl_left_s": round(max(r.expires_s - now_s, 0.0), 3),
             "idle_s": round(now_s - r.last_used_s, 3), "ends_with": r.preview}
            for r in summary.retained]


def near_miss_report(summary: PinSummary) -> dict[str, Any]:
    """The most frequent causes, and the latest near misses (newest first) with their texts."""
    return {
        "total": summary.num_near_misses,
        "top": [{"pin": c.pin, "owner": c.owner, "cause": c.cause, "count": c.count}
                for c in summary.near_miss_counts[:NUM_TOP_CAUSES]],
        "recent": [dataclasses.asdict(m)
                   for m in reversed(summary.recent_near_misses[-NUM_RECENT_NEAR_MISSES:])],
    }


def stats_report(stats: EngineStats, summary: PinSummary, recent: RecentRequests,
                 restore_report: list[dict[str, Any]], persist_error: str | None
                 ) -> dict[str, Any]:
    """The cache and pin part of ``/v1/stats`` (the engine's counters come as they are)."""
    queries, hits = stats.scheduler.prefix_cache_queries, stats.scheduler.prefix_cache_hits
    return {
        **stats.flat(),
        "prefix_cache_hit_rate": round(hits / queries, 6) if queries else None,
        "ttft": recent.ttft(),
        "tokens_per_s": recent.tokens_per_s(),
        "pins": pins_report(summary),
        "retained": retained_report(summary),
        "near_misses": near_miss_report(summary),
        "pin_restore": restore_report,
        "pin_persist_error": persist_error,
    }
