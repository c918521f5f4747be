"""Per-request block tables on top of the BlockPool, with prefix-cache lookup and registration.

Invariant: each live request holds exactly one reference on every block of its block table;
a request's first ``num_cached_blocks`` blocks are registered in the pool (or lost a hash race to
an identical block), and ``allocate`` either succeeds entirely or changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from .block_pool import BlockPool
from .hashing import BlockHash, hash_blocks


@dataclass(frozen=True)
class CachedPrefix:
    """The cached leading blocks of a token sequence, found by ``find_cached_prefix``.

    ``block_hashes`` holds the hashes of ALL full blocks of the tokens looked up, so the caller
    (via ``allocate``) never hashes them twice.
    """

    block_ids: list[int]
    block_hashes: list[BlockHash]
    num_tokens: int


@dataclass
class _RequestBlocks:
    block_ids: list[int]
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_cached_blocks: int = 0


class KVCacheManager:
    """Maps request ids to block tables and shares full blocks between equal prefixes."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        extra_key: bytes = b"",
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.extra_key = extra_key
        self.pool = BlockPool(num_blocks, enable_caching=enable_caching)
        self._requests: dict[str, _RequestBlocks] = {}
        # Copies a block's KV into another at once (the runner's): with it, a table grows into
        # the block after its last even when that one holds a cached prefix (BlockPool.allocate).
        self.move_block: Callable[[int, int], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return self.pool.usage

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def block_table(self, request_id: str) -> list[int]:
        """Return a copy of the request's block ids, in token order."""
        return list(self._requests[request_id].block_ids)

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
        state = self._requests.get(request_id)
        cached_ids: list[int] = []
        if state is None and cached is not None:
            cached_ids = cached.block_ids
            self._check_still_cached(cached)
        num_held = len(state.block_ids) if state is not None else len(cached_ids)
        num_new = max(0, -(-num_tokens // self.block_size) - num_held)
        # Touching a cached block that sits in the free queue takes it out of the free pool.
        num_revived = sum(1 for block_id in cached_ids if self.pool.ref_cnt(block_id) == 0)
        if num_new + num_revived > self.pool.num_free:
            return None
        if state is None:
            self.pool.touch(cached_ids)
            state = _RequestBlocks(block_ids=list(cached_ids), num_cached_blocks=len(cached_ids))
            if cached is not None:
                state.block_hashes = list(cached.block_hashes)
            self._requests[request_id] = state
        new_block_ids: list[int] = []
        if state.block_ids:
            last = state.block_ids[-1]
        elif num_new:  # a table's first block is the queue's head; the rest follow it
            new_block_ids = self.pool.allocate(1)
            last = new_block_ids[0]
        else:
            last = None
        new_block_ids += self.pool.allocate(num_new - len(new_block_ids), after=last,
                                            move=self.move_block)
        state.block_ids.extend(new_block_ids)
        return new_block_ids

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
    ) -> None:
        """Register the request's newly completed full blocks so other requests can hit them.

        Args:
            request_id: an allocated request.
            token_ids: the request's tokens (at least ``num_computed_tokens`` of them).
            num_computed_tokens: tokens whose KV is now written; only full blocks count.
            cache_salt: the request's salt, as given to ``find_cached_prefix``.
        """
        if not self.enable_caching:
            return
        state = self._requests[request_id]
        num_full_blocks = min(num_computed_tokens, len(token_ids)) // self.block_size
        num_full_blocks = min(num_full_blocks, len(state.block_ids))
        start = state.num_cached_blocks
        if num_full_blocks <= start:
            return
        self._extend_hashes(state.block_hashes, token_ids, num_full_blocks, cache_salt)
        self.pool.cache_full_blocks(
            state.block_ids[start:num_full_blocks], state.block_hashes[start:num_full_blocks]
        )
        state.num_cached_blocks = num_full_blocks

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
        state = self._requests[request_id]
        num_kept = -(-num_tokens // self.block_size)
        if num_kept < state.num_cached_blocks:
            raise ValueError(
                f"cannot trim request {request_id!r} to {num_tokens} tokens: its first "
                f"{state.num_cached_blocks} blocks are registered in the prefix cache"
            )
        freed = state.block_ids[num_kept:]
        del state.block_ids[num_kept:]
        self.pool.free(reversed(freed))
        return freed

    def free(self, request_id: str) -> None:
        """Release the request's blocks, last block first, and forget it; unknown ids: no-op."""
        state = self._requests.pop(request_id, None)
        if state is not None:
            self.pool.free(reversed(state.block_ids))

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on each block (a pin holds its prefix this way)."""
        self.pool.touch(block_ids)

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per block, freeing them in REVERSE of the given (prefix) order."""
        self.pool.free(reversed(block_ids))
