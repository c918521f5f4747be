"""Near misses between a client's own prompts, grouped by ``prompt_cache_key``.

A ``prompt_cache_key`` names a conversation or an agent, so its requests should share their
prefixes; a request that agrees with one of its group's recent prompts but for a short span
(``agentd.pins.near_miss``) lost the run after that span to a cache-buster, and is recorded with the
cause, the varying span on both sides and the tokens lost. Requests without a key form one group
per tenant. Invariants: memory is bounded (``MAX_GROUPS`` groups of ``PER_GROUP`` prompts, each
cut to ``MAX_TOKENS``, stored as 4-byte ints; ``RECENT`` records); groups never cross tenants;
observing runs off the event loop and never delays a request (the route submits first).
"""

from __future__ import annotations

import threading
import time
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from agentd.cache import common_prefix_len
from agentd.pins.near_miss import describe, find_span

MAX_GROUPS = 128
PER_GROUP = 4
MAX_TOKENS = 32768
RECENT = 64
NUM_TOP = 10
NUM_RECENT_SHOWN = 5


@dataclass(frozen=True)
class KeyNearMiss:
    key: str | None  # the prompt_cache_key; None: the tenant's requests without one
    owner: str | None  # the tenant
    cause: str
    fix: str | None  # the client setting that turns it off, when known
    at_token: int  # the first differing token
    new_span: str  # the varying text, this request's side
    old_span: str  # ... and the earlier request's
    before: str  # the text before the span
    num_tokens_lost: int  # equal tokens after the span the cache could not serve
    time_s: float  # wall clock


class PromptHistory:
    """Recent prompts per (tenant, key) and the near misses found among them (thread-safe)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._groups: OrderedDict[tuple[str | None, str | None], deque[array]] = OrderedDict()
        self._counts: Counter[tuple[str | None, str | None, str]] = Counter()
        self._recent: deque[KeyNearMiss] = deque(maxlen=RECENT)
        self._lock = threading.Lock()

    def observe(self, owner: str | None, key: str | None,
                token_ids: Sequence[int]) -> KeyNearMiss | None:
        """Compare a request's prompt with its group's recent ones, remember it, and return
        the near miss it is (the one that lost the most tokens), if any."""
        prompt = array("i", token_ids[:MAX_TOKENS])
        with self._lock:
            group = self._groups.pop((owner, key), None) or deque(maxlen=PER_GROUP)
            self._groups[(owner, key)] = group  # most recently used last
            while len(self._groups) > MAX_GROUPS:
                self._groups.popitem(last=False)
            miss = self._worst_miss(owner, key, prompt, list(group))
            group.append(prompt)
            if miss is not None:
                self._counts[(owner, key, miss.cause)] += 1
                self._recent.append(miss)
        return miss

    def _worst_miss(self, owner: str | None, key: str | None, prompt: array,
                    earlier: list[array]) -> KeyNearMiss | None:
        best = None
        for old in reversed(earlier):
            start = common_prefix_len(prompt, old)
            if start == len(old) or start == len(prompt):
                return None  # it continues an earlier prompt: nothing was lost
            span = find_span(prompt, old, start)
            if span is not None and (best is None or span.num_equal_after > best[0].
                                     num_equal_after):
                best = (span, old)
        if best is None:
            return None
        span, old = best
        why = describe(self.tokenizer, prompt, old, span)
        return KeyNearMiss(key, owner, why.cause, why.fix, span.start, _flat(why.new_text),
                           _flat(why.old_text), _flat(why.before), span.num_equal_after,
                           time.time())

    def report(self) -> dict[str, Any]:
        """The most frequent (key, cause) pairs and the latest near misses, newest first."""
        with self._lock:
            counts = self._counts.most_common(NUM_TOP)
            total = sum(self._counts.values())
            recent = list(self._recent)[-NUM_RECENT_SHOWN:]
        return {"total": total,
                "top": [{"key": key, "owner": owner, "cause": cause, "count": n}
                        for (owner, key, cause), n in counts],
                "recent": [asdict(m) for m in reversed(recent)]}


def _flat(text: str) -> str:
    return text.replace("\n", "\\n")
