"""Kept tails: a finished request's partial last block, held so that a conversation continued
from its exact token ids (a stored Responses API reply and ``previous_response_id``) hits every
token whose KV was computed, not only its full blocks.

Runs on the engine thread only. Invariants: a kept tail holds exactly one reference on one
block, whose first ``len(token_ids)`` slots hold the KV of ``token_ids`` right after the cached
full-block chain ending in ``parent_hash``; it is released when its owner drops it or, past
``max_tails``, oldest-used first. The full blocks before it stay ordinary cached blocks (LRU):
a tail whose chain was evicted is simply never matched. A tail is only offered where the
scheduler asks for it (``tail_after``, the same hook a pin's tail uses), so a hit copies its
slots into the new request's own block and the kept block is never written again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from agentd.cache import BlockHash, KVCacheManager
from agentd.chat import common_prefix_len
from agentd.request import Request, RequestStatus
from agentd.scheduler import ScheduledRequest

_KEPT_STATUSES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


@dataclass(frozen=True)
class KeptTail:
    block_id: int
    num_full_blocks: int
    parent_hash: BlockHash
    token_ids: tuple[int, ...]


class TailKeeper:
    """The tails of finished requests that asked to keep theirs, by request id."""

    def __init__(self, kv_cache: KVCacheManager, max_tails: int) -> None:
        self.kv_cache = kv_cache
        self.max_tails = max(1, max_tails)
        self._wanted: set[str] = set()
        self._tails: OrderedDict[str, KeptTail] = OrderedDict()
        self._by_parent: dict[BlockHash, set[str]] = {}

    def __len__(self) -> int:
        return len(self._tails)

    @property
    def held_block_ids(self) -> list[int]:
        return [tail.block_id for tail in self._tails.values()]

    def want(self, request_id: str) -> None:
        """Keep ``request_id``'s tail when it finishes (stopped or cut by length)."""
        self._wanted.add(request_id)

    def on_finished(self, request: Request, item: ScheduledRequest | None) -> None:
        """Called for each request that finished this step, its blocks freed just now and
        nothing allocated since: take back the partial block that holds its computed tail."""
        if request.request_id not in self._wanted:
            return
        self._wanted.discard(request.request_id)
        if item is None or request.status not in _KEPT_STATUSES:
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
        block_id = item.block_table[num_full]
        self.kv_cache.touch([block_id])
        tail = KeptTail(block_id, num_full, cached.block_hashes[num_full - 1],
                        tuple(token_ids[num_full * block_size:]))
        self._tails[request.request_id] = tail
        self._by_parent.setdefault(tail.parent_hash, set()).add(request.request_id)
        while len(self._tails) > self.max_tails:
            self.release(next(iter(self._tails)))

    def forget(self, request_id: str) -> None:
        """The request ended without a tail to keep (aborted, failed)."""
        self._wanted.discard(request_id)

    def release(self, request_id: str) -> None:
        """Drop ``request_id``'s tail (idempotent): its block returns to the free queue."""
        tail = self._tails.pop(request_id, None)
        if tail is None:
            return
        siblings = self._by_parent[tail.parent_hash]
        siblings.discard(request_id)
        if not siblings:
            del self._by_parent[tail.parent_hash]
        self.kv_cache.free_blocks([tail.block_id])

    def release_all(self, request_ids: Iterable[str]) -> None:
        for request_id in list(request_ids):
            self.release(request_id)

    def tail_after(self, block_hashes: Sequence[BlockHash],
                   next_tokens: list[int]) -> tuple[int, int] | None:
        """``(block, n)`` of the kept tail hung on exactly ``block_hashes`` that shares the most
        (n) leading tokens with ``next_tokens``; it becomes the most recently used."""
        best: tuple[int, int, str] | None = None
        for request_id in self._by_parent.get(block_hashes[-1], ()) if block_hashes else ():
            tail = self._tails[request_id]
            if tail.num_full_blocks != len(block_hashes):
                continue
            num_equal = common_prefix_len(list(tail.token_ids), next_tokens)
            if num_equal and (best is None or num_equal > best[1]):
                best = (tail.block_id, num_equal, request_id)
        if best is None:
            return None
        self._tails.move_to_end(best[2])
        return best[0], best[1]
