"""Engine-side retention: hold a request's prefix once its KV is computed, refresh retained
prefixes on every hit, let them decay at their expiry, and copy their numbers for observers.

Runs on the engine thread only; the scheduler never sees retention (it is references held in the pin
registry, :mod:`agentd.cache.pin_registry`, in the pin budget). Invariants: a prefix is retained
only once every one of its blocks holds computed KV (it is looked up in the prefix cache, which
registers computed full blocks only); a retained prefix covers whole blocks (the tokens past the
last full block are recomputed by the next request); retained prefixes live in memory only — a
restart forgets them, as Anthropic's cache does — while pins are saved.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agentd.cache import BlockHash, KVCacheManager, PinRegistry
from agentd.engine.hooks import RequestHooks
from agentd.engine.request import Request, RetentionRequest
from agentd.engine.scheduler import ScheduledRequest

_PREVIEW_TOKENS = 12
_PREVIEW_CHARS = 48


@dataclass(frozen=True)
class Retained:
    """What a hold achieved."""

    num_tokens: int  # tokens now held (whole blocks)
    num_blocks: int
    expires_in_s: float
    new: bool  # False: the same prefix was retained already and was refreshed


@dataclass(frozen=True)
class RetainedStat:
    """One retained prefix's numbers, copied on the engine thread for other threads."""

    owner: str | None
    num_tokens: int
    num_blocks: int
    num_hits: int
    num_tokens_served: int
    ttl_s: float
    expires_s: float  # monotonic
    last_used_s: float  # monotonic
    created_s: float  # wall clock
    preview: str


class RetentionManager(RequestHooks):
    def __init__(self, kv_cache: KVCacheManager, registry: PinRegistry, tokenizer) -> None:
        self.kv_cache = kv_cache
        self.registry = registry
        self.tokenizer = tokenizer
        self.num_expired = 0
        # told (block ids, hashes) of each prefix held: the disk tier keeps them over anonymous
        # prefixes (its kept class), so a retained prefix outlives churn on disk for its TTL
        self.on_held: Callable[[list[int], list[BlockHash]], None] | None = None

    def computed(self, request: Request, item: ScheduledRequest) -> None:
        """A request whose held prefix (``request.retention``) is now computed gets it
        retained (finished or not: a finished request's blocks are still cached within the
        step); ``request.num_retained_tokens`` says how much."""
        hold = request.retention
        if hold is None or request.num_computed_tokens < min(hold.num_tokens,
                                                            request.num_prompt_tokens):
            return
        request.retention = None  # asked once
        retained = self.retain(request.prompt_token_ids, hold, request.cache_salt,
                               request.owner,
                               request.prompt_block_hashes(self.kv_cache.block_size))
        if retained is not None:
            request.num_retained_tokens = retained.num_tokens

    def retain(self, token_ids: Sequence[int], hold: RetentionRequest, cache_salt: str | None,
               owner: str | None = None,
               block_hashes: list[BlockHash] | None = None) -> Retained | None:
        """Hold the cached whole blocks of ``token_ids[:hold.num_tokens]`` for ``hold.ttl_s``,
        in ``owner``'s name (the tenant: stats show it; its salt is in the hashes).

        Returns:
            What is held now (maybe fewer blocks than asked, if fewer are cached), or None when
            nothing is: no whole block cached, or pins leave the budget no room.
        """
        num_tokens = min(hold.num_tokens, len(token_ids))
        num_blocks = num_tokens // self.kv_cache.block_size
        if num_blocks == 0:
            return None
        cached = self.kv_cache.find_cached_prefix(
            token_ids[:num_blocks * self.kv_cache.block_size], cache_salt,
            block_hashes=list(block_hashes[:num_blocks]) if block_hashes else None)
        if not cached.block_ids:
            return None
        num_held = len(cached.block_ids)
        end = num_held * self.kv_cache.block_size
        now = time.monotonic()
        existing = self.registry.retained.get(cached.block_hashes[num_held - 1])
        prefix = self.registry.retain(cached.block_ids, cached.block_hashes[:num_held], end,
                                      hold.ttl_s, now, time.time(), owner,
                                      "" if existing else self._preview(token_ids, end))
        if prefix is None:
            return None
        if self.on_held is not None:
            self.on_held(list(cached.block_ids[:num_held]), list(cached.block_hashes[:num_held]))
        return Retained(end, num_held, prefix.expires_s - now, new=existing is None)

    def admitted(self, request: Request) -> None:
        """A request admitted for the first time refreshes every retained prefix it holds whole
        (as Anthropic refreshes a cache entry on use) and counts as its hit."""
        now = time.monotonic()
        hashes = request.prompt_block_hashes(self.kv_cache.block_size)
        for prefix in self.registry.retained.matching(hashes):
            prefix.num_hits += 1
            prefix.num_tokens_served += min(request.num_cached_tokens or 0, prefix.num_tokens)
            prefix.refresh(now)

    def expire(self, now_s: float) -> None:
        """Let prefixes whose expiry passed decay to LRU (their blocks stay cached until
        evicted)."""
        for key in self.registry.retained.expired(now_s):
            self.registry.release_retained(key)
            self.num_expired += 1

    def _preview(self, token_ids: Sequence[int], end: int) -> str:
        text = self.tokenizer.decode(list(token_ids[max(0, end - _PREVIEW_TOKENS):end]))
        return text[-_PREVIEW_CHARS:].replace("\n", "\\n")


def retained_stats(registry: PinRegistry) -> tuple[RetainedStat, ...]:
    """The retained prefixes' numbers, newest use first (on the engine thread)."""
    return tuple(RetainedStat(p.owner, p.num_tokens, p.num_blocks, p.num_hits,
                              p.num_tokens_served, p.ttl_s, p.expires_s, p.last_used_s,
                              p.created_s, p.preview)
                 for p in sorted(registry.retained, key=lambda p: -p.last_used_s))
