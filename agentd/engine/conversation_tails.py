"""Kept conversation tails: a finished request's partial last block, held so that a conversation
continued from its exact token ids (a stored Responses API reply and ``previous_response_id``)
hits every token whose KV was computed, not only its full blocks.

Runs on the engine thread only. Invariants: a kept tail holds exactly one reference on one block
(its owner in the cache manager's ``holders``, kind ``CONVERSATION``), whose first
``len(token_ids)`` slots hold the KV of ``token_ids`` right after the cached full-block chain
ending in ``parent_hash``; it is released when its owner drops it or, past ``max_tails``, least
recently used first. The full blocks before it stay ordinary cached blocks (LRU): a tail whose
chain was evicted is simply never matched. It is offered where the scheduler asks for a kept
partial block (``kv_cache.tails``, the index a pin's tail is in too), so a hit copies its slots
into the new request's own block and the kept block is never written again.
"""

from __future__ import annotations

from collections.abc import Iterable

from agentd.cache import CONVERSATION, KeptTail, KVCacheManager, Owner
from agentd.engine.hooks import RequestHooks
from agentd.engine.outputs import StreamDelta
from agentd.engine.request import Request, RequestStatus
from agentd.engine.scheduler import ScheduledRequest

_KEPT_STATUSES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


class TailKeeper(RequestHooks):
    """The tails of finished requests that asked to keep theirs (``Request.keep_tail``), by
    request id."""

    def __init__(self, kv_cache: KVCacheManager, max_tails: int) -> None:
        self.kv_cache = kv_cache
        self.max_tails = max(1, max_tails)
        self._kept: set[Owner] = set()

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def request_ids(self) -> list[str]:
        """The requests whose tails are kept."""
        return [str(owner.key) for owner in self._kept]

    def finished(self, request: Request, item: ScheduledRequest | None,
                 delta: StreamDelta) -> None:
        """A request that asked to keep its tail finished (stopped or cut by length), its blocks
        freed just now and nothing allocated since: take back the partial block that holds its
        computed tail."""
        if not request.keep_tail or item is None or request.status not in _KEPT_STATUSES:
            return
        block_size = self.kv_cache.block_size
        num_full, num_tail = divmod(request.num_computed_tokens, block_size)
        if num_full == 0 or num_tail == 0 or len(item.block_table) <= num_full:
            return  # nothing past the full blocks, or no chain to hang it on
        token_ids = request.all_token_ids[:num_full * block_size + num_tail]
        cached = self.kv_cache.find_cached_prefix(token_ids[:num_full * block_size],
                                                  request.cache_salt)
        if len(cached.block_ids) < num_full:
            return
        owner = Owner(CONVERSATION, request.request_id)
        block_id = item.block_table[num_full]
        self.kv_cache.holders.hold(owner, [block_id])
        self.kv_cache.tails.add(owner, KeptTail(block_id, num_full,
                                                cached.block_hashes[num_full - 1],
                                                tuple(token_ids[num_full * block_size:])))
        self._kept.add(owner)
        while len(self._kept) > self.max_tails:
            oldest = self.kv_cache.tails.least_recently_used(self._kept)
            assert oldest is not None
            self.release(oldest.key)

    def release(self, request_id: str) -> None:
        """Drop ``request_id``'s tail (idempotent): its block returns to the free queue."""
        owner = Owner(CONVERSATION, request_id)
        if owner not in self._kept:
            return
        self._kept.discard(owner)
        self.kv_cache.tails.remove(owner)
        self.kv_cache.holders.release(owner)

    def release_all(self, request_ids: Iterable[str]) -> None:
        for request_id in list(request_ids):
            self.release(request_id)
