"""Retained prefixes: blocks a request asked to keep until a time (Anthropic ``cache_control``,
OpenAI ``prompt_cache_options`` / ``prompt_cache_retention``).

A retained prefix is a reference held by an owner with an expiry, like a pin without a name:
retain = touch, decay = free. It is found by the hash of its last block (the chain hash names
the whole prefix and its cache salt, so its tenant too); retaining the same prefix again, or a
request that hits it whole, refreshes its expiry. The budget it shares with pins is enforced by
:class:`agentd.cache.PinRegistry`, which owns one of these.
Invariants: a retained prefix holds exactly one reference on each of its blocks (its owner in the
cache manager's ``holders``, kind ``RETAINED``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .hashing import BlockHash
from .holders import RETAINED, Owner
from .kv_cache_manager import KVCacheManager


@dataclass
class RetainedPrefix:
    block_ids: list[int]
    block_hashes: list[BlockHash]
    num_tokens: int  # whole blocks only: the tokens whose KV it keeps
    ttl_s: float
    expires_s: float  # monotonic; refreshed to now + ttl_s by every hit
    last_used_s: float  # monotonic time of its creation or latest hit (decay order)
    created_s: float  # wall clock
    owner: str | None = None  # the tenant whose salt its blocks were hashed with
    num_hits: int = 0  # requests admitted on it whole (its creator not counted)
    num_tokens_served: int = 0
    preview: str = ""  # the text just before its end, for people reading stats

    @property
    def key(self) -> BlockHash:
        return self.block_hashes[-1]

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def refresh(self, now_s: float, ttl_s: float | None = None) -> None:
        """Extend the expiry to ``now + ttl`` (a longer TTL asked again replaces a shorter)."""
        if ttl_s is not None:
            self.ttl_s = max(self.ttl_s, ttl_s)
        self.expires_s = max(self.expires_s, now_s + self.ttl_s)
        self.last_used_s = now_s


class RetainedPrefixes:
    """The retained prefixes and the references they hold; no budget (the registry has it)."""

    def __init__(self, kv_cache: KVCacheManager) -> None:
        self.kv_cache = kv_cache
        self.holders = kv_cache.holders
        self._prefixes: dict[BlockHash, RetainedPrefix] = {}

    def __iter__(self) -> Iterator[RetainedPrefix]:
        return iter(list(self._prefixes.values()))

    def __len__(self) -> int:
        return len(self._prefixes)

    def get(self, key: BlockHash) -> RetainedPrefix | None:
        return self._prefixes.get(key)

    def block_ids(self) -> Iterator[int]:
        """Distinct blocks held by retained prefixes."""
        return iter(self.holders.distinct(RETAINED))

    def holds(self, block_id: int) -> bool:
        return self.holders.holds(RETAINED, block_id)

    def add(self, prefix: RetainedPrefix) -> None:
        """Hold ``prefix``'s blocks (the caller checked the budget and that its key is new)."""
        self.holders.hold(Owner(RETAINED, prefix.key), prefix.block_ids)
        self._prefixes[prefix.key] = prefix

    def remove(self, key: BlockHash) -> RetainedPrefix:
        """Decay: drop the prefix's references; its blocks become ordinary cached (LRU) ones."""
        prefix = self._prefixes.pop(key)
        self.holders.release(Owner(RETAINED, key))
        return prefix

    def oldest(self) -> RetainedPrefix | None:
        """The least recently used prefix: the first to decay when the budget is short."""
        return min(self._prefixes.values(), key=lambda p: p.last_used_s, default=None)

    def matching(self, block_hashes: Sequence[BlockHash]) -> list[RetainedPrefix]:
        """Every retained prefix that ``block_hashes`` (a request's chain) contains whole."""
        if not self._prefixes:
            return []
        return [p for h in block_hashes if (p := self._prefixes.get(h)) is not None]

    def expired(self, now_s: float) -> list[BlockHash]:
        """Prefixes whose expiry passed without a hit (they should decay to LRU)."""
        return [p.key for p in self._prefixes.values() if now_s >= p.expires_s]
