"""Per-request block tables on top of the BlockPool, with prefix-cache lookup and registration.

Invariant: each live request holds exactly one reference on every block of its block table
(its owner in ``holders``, the one owner -> blocks map for every kind of reference);
a request's first ``num_cached_blocks`` blocks are registered in the pool (or lost a hash race to
an identical block), and ``allocate`` either succeeds entirely or changes nothing. Block hashes
are the caller's (a request's own chain, extended in place), never kept here. Every KV copy the
tables need (a cached block moved out of a growing table's way, a prefix's partial block copied
in) is queued as a ``KVCopy`` until ``take_copies``: the caller runs them, in order, before any
forward writes into those blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from .block_pool import BlockPool
from .hashing import BlockHash, hash_blocks
from .holders import REQUEST, BlockHolders, Owner
from .kv_events import NULL_KV_EVENTS, KVEventSink
from .tails import TailIndex


@dataclass(frozen=True)
class CachedPrefix:
    """The cached leading blocks of a token sequence, found by ``find_cached_prefix``.

    ``block_hashes`` holds the hashes of ALL full blocks of the tokens looked up, so the caller
    (via ``allocate``) never hashes them twice.
    """

    block_ids: list[int]
    block_hashes: list[BlockHash]
    num_tokens: int


@dataclass(frozen=True)
class KVCopy:
    """Before the next forward: copy slots ``0..num_slots-1`` of block ``src`` to ``dst``."""

    src: int
    dst: int
    num_slots: int


class KVCacheManager:
    """Maps request ids to block tables and shares full blocks between equal prefixes."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        extra_key: bytes = b"",
        move_cached_blocks: bool = False,
        events: KVEventSink = NULL_KV_EVENTS,
    ) -> None:
        """``move_cached_blocks``: grow a table into the block after its last even when that one
        holds a cached prefix, whose KV then moves to another block (a queued ``KVCopy``: only
        for a caller that runs ``take_copies`` before each forward). ``events``: the pool reports
        each hash it stores or removes there (routers' KV events)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.extra_key = extra_key
        self.pool = BlockPool(num_blocks, enable_caching=enable_caching, events=events)
        self.holders = BlockHolders(self.pool)  # every reference's owner: tables, pins, ...
        self.tails = TailIndex()  # kept partial blocks (pins', conversations'), by their chain
        self._num_cached_blocks: dict[str, int] = {}  # request id -> blocks registered
        self.move_cached_blocks = move_cached_blocks
        self._copies: list[KVCopy] = []  # queued for the next forward (take_copies)
        # told (block ids, hashes, keep) of each run of blocks that cache_blocks registers: the
        # disk tier writes them behind the pool (kept over anonymous prefixes where ``keep``)
        self.on_cached: Callable[[Sequence[int], Sequence[BlockHash], bool], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return self.pool.usage

    def has_request(self, request_id: str) -> bool:
        return request_id in self._num_cached_blocks

    def block_table(self, request_id: str) -> list[int]:
        """Return a copy of the request's block ids, in token order."""
        return self.holders.blocks(Owner(REQUEST, request_id))

    def find_cached_prefix(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        max_num_tokens: int | None = None,
        block_hashes: list[BlockHash] | None = None,
    ) -> CachedPrefix:
        """Find the longest run of leading full blocks already in the pool; changes nothing.

        Args:
            token_ids: the request's tokens.
            cache_salt: the request's salt; a different salt never hits.
            max_num_tokens: cap on the prefix length, rounded down to whole blocks.
            block_hashes: the hashes of ``token_ids``' leading full blocks known so far (a
                waiting request's own list, vLLM's ``request.block_hashes``): extended in place
                with the blocks it lacks, so a request looked up every step is hashed once.

        Returns:
            The hit blocks (no references taken) and the hashes of every full block.
        """
        if not self.enable_caching:
            return CachedPrefix(block_ids=[], block_hashes=[], num_tokens=0)
        if block_hashes is None:
            block_hashes = []
        self._extend_hashes(block_hashes, token_ids, len(token_ids) // self.block_size,
                            cache_salt)
        max_num_blocks = len(block_hashes)
        if max_num_tokens is not None:
            max_num_blocks = min(max_num_blocks, max(0, max_num_tokens) // self.block_size)
        block_ids: list[int] = []
        for block_hash in block_hashes[:max_num_blocks]:
            block_id = self.pool.get_cached(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return CachedPrefix(block_ids, block_hashes, len(block_ids) * self.block_size)

    def allocate(
        self, request_id: str, num_tokens: int, cached: CachedPrefix | None = None
    ) -> list[int] | None:
        """Grow the request's block table to cover ``num_tokens`` tokens in total.

        Args:
            request_id: the request; its first call creates its block table.
            num_tokens: total tokens the table must cover (computed + about to be computed).
            cached: on the first call only, the prefix from ``find_cached_prefix``; its blocks
                are referenced and head the block table. Ignored on later calls.

        Returns:
            The newly allocated block ids (maybe empty), or None if the pool is too short,
            in which case nothing changes.
        """
        owner = Owner(REQUEST, request_id)
        known = request_id in self._num_cached_blocks
        cached_ids: list[int] = []
        if not known and cached is not None:
            cached_ids = cached.block_ids
            self._check_still_cached(cached)
        table = self.holders.view(owner) if known else cached_ids
        num_new = max(0, -(-num_tokens // self.block_size) - len(table))
        # Touching a cached block that sits in the free queue takes it out of the free pool.
        num_revived = sum(1 for block_id in cached_ids if self.pool.ref_cnt(block_id) == 0)
        if num_new + num_revived > self.pool.num_free:
            return None
        if not known:
            self.holders.hold(owner, cached_ids)
            self._num_cached_blocks[request_id] = len(cached_ids)
        new_block_ids: list[int] = []
        if table:
            last = table[-1]
        elif num_new:  # a table's first block is the queue's head; the rest follow it
            new_block_ids = self.pool.allocate(1)
            last = new_block_ids[0]
        else:
            last = None
        new_block_ids += self.pool.allocate(num_new - len(new_block_ids), after=last,
                                            move=self._move if self.move_cached_blocks else None)
        self.holders.adopt(owner, new_block_ids)
        return new_block_ids

    def _move(self, src: int, dst: int) -> None:
        """The pool gave a growing table the cached block ``src``; its KV moves to ``dst``."""
        self._copies.append(KVCopy(src, dst, self.block_size))

    def copy_slots(self, src: int, dst: int, num_slots: int) -> None:
        """Queue a copy of block ``src``'s first ``num_slots`` slots into ``dst`` (a prefix's
        partial last block, into a request's first new block)."""
        self._copies.append(KVCopy(src, dst, num_slots))

    def take_copies(self) -> list[KVCopy]:
        """The KV copies queued since the last call, in the order they must run."""
        copies, self._copies = self._copies, []
        return copies

    def _check_still_cached(self, cached: CachedPrefix) -> None:
        for block_id, block_hash in zip(cached.block_ids, cached.block_hashes, strict=False):
            if self.pool.block_hash(block_id) != block_hash:
                raise ValueError(
                    f"stale CachedPrefix: block {block_id} was evicted since the lookup; "
                    "call find_cached_prefix again right before allocate"
                )

    def cache_blocks(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        cache_salt: str | None = None,
        block_hashes: list[BlockHash] | None = None,
        keep: bool = False,
    ) -> None:
        """Register the request's newly completed full blocks so other requests can hit them.

        Args:
            request_id: an allocated request.
            token_ids: the request's tokens (at least ``num_computed_tokens`` of them).
            num_computed_tokens: tokens whose KV is now written; only full blocks count.
            cache_salt: the request's salt, as given to ``find_cached_prefix``.
            block_hashes: the request's own chain (as given to ``find_cached_prefix``), extended
                in place with the blocks it lacks; None: hashed afresh for this call.
            keep: passed on to ``on_cached`` (the request belongs to a session a client named).
        """
        if not self.enable_caching:
            return
        table = self.holders.view(Owner(REQUEST, request_id))
        num_full_blocks = min(num_computed_tokens, len(token_ids)) // self.block_size
        num_full_blocks = min(num_full_blocks, len(table))
        start = self._num_cached_blocks[request_id]
        if num_full_blocks <= start:
            return
        block_hashes = [] if block_hashes is None else block_hashes
        self._extend_hashes(block_hashes, token_ids, num_full_blocks, cache_salt)
        bs = self.block_size
        block_ids = table[start:num_full_blocks]
        self.pool.cache_full_blocks(
            block_ids, block_hashes[start:num_full_blocks],
            token_ids[start * bs:num_full_blocks * bs], block_hashes[start - 1] if start else None,
        )
        self._num_cached_blocks[request_id] = num_full_blocks
        if self.on_cached is not None:
            self.on_cached(block_ids, block_hashes[start:num_full_blocks], keep)

    def _extend_hashes(
        self,
        block_hashes: list[BlockHash],
        token_ids: Sequence[int],
        num_blocks: int,
        cache_salt: str | None,
    ) -> None:
        """Append the hashes of blocks ``len(block_hashes) .. num_blocks - 1`` of the chain."""
        num_known = len(block_hashes)
        if num_known >= num_blocks:
            return
        block_hashes.extend(
            hash_blocks(
                token_ids[: num_blocks * self.block_size],
                self.block_size,
                self.extra_key,
                cache_salt,
                parent=block_hashes[-1] if num_known else None,
                start_block=num_known,
            )
        )

    def trim(self, request_id: str, num_tokens: int) -> list[int]:
        """Shrink the request's block table to the blocks that cover ``num_tokens`` tokens.

        For KV written on a guess that turned out wrong (rejected draft tokens): the blocks that
        held only such tokens go back to the free queue. Registered blocks are never trimmed.

        Returns:
            The freed block ids, in table order.
        """
        num_kept = -(-num_tokens // self.block_size)
        num_cached_blocks = self._num_cached_blocks[request_id]
        if num_kept < num_cached_blocks:
            raise ValueError(
                f"cannot trim request {request_id!r} to {num_tokens} tokens: its first "
                f"{num_cached_blocks} blocks are registered in the prefix cache"
            )
        return self.holders.shrink(Owner(REQUEST, request_id), num_kept)

    def free(self, request_id: str) -> None:
        """Release the request's blocks, last block first, and forget it; unknown ids: no-op."""
        if self._num_cached_blocks.pop(request_id, None) is not None:
            self.holders.release(Owner(REQUEST, request_id))

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on each block, owned by no one here (the engine's holders take
        theirs through ``holders``)."""
        self.pool.touch(block_ids)

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per block, freeing them in REVERSE of the given (prefix) order."""
        self.pool.free(reversed(block_ids))
