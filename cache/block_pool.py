"""The pool of KV blocks: ref counts, the LRU free queue and the hash -> block map.

Invariant: every block is in exactly one of {free queue (ref_cnt == 0), referenced
(ref_cnt > 0)}; ref counts never go negative; the hash map points only at blocks whose
``block_hash`` equals the key, and every hashed block is in the map. A pinned block holds a
reference, so it never enters the free queue and can never be evicted. Every change to the map is
reported to the pool's ``events`` sink as it happens (:mod:`.kv_events`). A block has a
``KVBlock`` from its first use on (:mod:`.free_queue`): the pool's memory grows with the blocks
used, never with ``num_blocks`` (a pool sized for a large budget costs nothing until it fills).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from .free_queue import FreeBlockQueue, KVBlock, NoFreeBlocksError
from .hashing import BlockHash
from .kv_events import NULL_KV_EVENTS, KVEventSink

__all__ = ["BlockPool", "FreeBlockQueue", "KVBlock", "NoFreeBlocksError", "PoolStats"]


@dataclass(frozen=True)
class PoolStats:
    """The pool's blocks by state, copied at one moment (free + cached + used = total)."""

    num_blocks_total: int
    num_blocks_free: int  # free and holding nothing the prefix cache can hit
    num_blocks_cached: int  # free but hashed: a hit until evicted
    num_blocks_used: int  # referenced (requests, pins, retained prefixes, tails)
    kv_cache_usage: float  # used / total


class BlockPool:
    """Owns the blocks, the free queue and the hash -> block map of cached full blocks."""

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 events: KVEventSink = NULL_KV_EVENTS) -> None:
        """``events``: told of every hash stored and removed (routers' KV events)."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.enable_caching = enable_caching
        self.events = events
        # told (block id, hash) of each cached block just before its KV is given to another
        # use (the disk tier writes a block there whose earlier write it had to drop)
        self.on_evicted: Callable[[int, BlockHash], None] | None = None
        self._num_blocks = num_blocks
        self._blocks: dict[int, KVBlock] = {}  # the blocks used so far, by id
        self._free_queue = FreeBlockQueue(fresh=range(num_blocks))
        self._cached_block_ids: dict[BlockHash, int] = {}
        self._num_cached_free = 0

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free(self) -> int:
        """Blocks in the free queue, cached (evictable) ones included."""
        return len(self._free_queue)

    @property
    def num_cached_free(self) -> int:
        """Blocks in the free queue that still hold a hash (a future cache hit)."""
        return self._num_cached_free

    @property
    def num_used(self) -> int:
        """Blocks with ref_cnt > 0."""
        return self.num_blocks - self.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return self.num_used / self.num_blocks

    def stats(self) -> PoolStats:
        return PoolStats(self.num_blocks, self.num_free - self.num_cached_free,
                         self.num_cached_free, self.num_used, self.usage)

    def ref_cnt(self, block_id: int) -> int:
        block = self._used(block_id)
        return 0 if block is None else block.ref_cnt

    def block_hash(self, block_id: int) -> BlockHash | None:
        block = self._used(block_id)
        return None if block is None else block.block_hash

    def _used(self, block_id: int) -> KVBlock | None:
        """The block of ``block_id``; None for one never used (free, empty, no object yet)."""
        block = self._blocks.get(block_id)
        if block is None and not 0 <= block_id < self._num_blocks:
            raise IndexError(f"block id {block_id} is not in a pool of {self._num_blocks}")
        return block

    def _first_use(self, block: KVBlock) -> KVBlock:
        """Keep ``block``, out of the free queue, as its id's from now on."""
        self._blocks[block.block_id] = block
        return block

    def referenced_block_ids(self) -> list[int]:
        """The ids of the blocks with ref_cnt > 0 (in time proportional to the blocks used)."""
        return [block_id for block_id, block in self._blocks.items() if block.ref_cnt > 0]

    def free_block_ids(self) -> list[int]:
        """Return the free queue's block ids, head (next allocated) to tail."""
        return self._free_queue.block_ids()

    def hashed_blocks(self) -> set[BlockHash]:
        """Every hash the pool holds a block for now (what a KV-event subscriber should know)."""
        return set(self._cached_block_ids)

    def get_cached(self, block_hash: BlockHash) -> int | None:
        """Return the id of the block holding ``block_hash``, or None on a miss."""
        return self._cached_block_ids.get(block_hash)

    def allocate(self, num_blocks: int, after: int | None = None,
                 move: Callable[[int, int], None] | None = None) -> list[int]:
        """Pop ``num_blocks`` blocks from the head of the free queue, evicting their hashes.

        With ``after`` (the last block of the table being grown), each block is the one right
        after the previous where that one is free, so a table is a run of consecutive blocks as
        often as it can be (attention reads such a run in place, without gathering it). A free
        block that holds a hash is only taken with ``move``: the head block is evicted as it
        would have been and takes over the wanted block's hash, in its place in the LRU order;
        ``move(src, dst)`` is told that the wanted block's KV belongs in the head block now. The
        pool holds no KV: the caller copies it before anything writes into the wanted block
        (the scheduler queues it as a ``KVCopy`` of its step). Nothing that head order would
        have kept cached is evicted.

        Args:
            num_blocks: how many blocks to hand out.
            after: the block the first one should follow; ``None``: head order, as the queue
                stands.
            move: told of each such move, as it happens (``src`` the wanted block, ``dst`` the
                head block that holds its hash now).

        Returns:
            The block ids, each with ref_cnt 1.

        Raises:
            NoFreeBlocksError: fewer than ``num_blocks`` are free; nothing changes.
        """
        if num_blocks > self.num_free:
            raise NoFreeBlocksError(f"asked for {num_blocks} blocks, {self.num_free} free")
        block_ids = []
        for _ in range(num_blocks):
            block = self._take(None if after is None else after + 1, move)
            block.ref_cnt = 1
            block_ids.append(block.block_id)
            if after is not None:
                after = block.block_id
        return block_ids

    def _take(self, wanted_id: int | None, move: Callable[[int, int], None] | None) -> KVBlock:
        """A free block out of the queue, hash-free: ``wanted_id`` where it can be (allocate)."""
        wanted = None if wanted_id is None else self._blocks.get(wanted_id)
        if wanted is None and wanted_id is not None and self._free_queue.is_fresh(wanted_id):
            return self._first_use(self._free_queue.take_fresh(wanted_id))
        if wanted is None or wanted.ref_cnt > 0 or (wanted.block_hash is not None and move is None):
            return self._evict(self._first_use(self._free_queue.popleft()))
        if wanted.block_hash is None:
            self._free_queue.remove(wanted)
            return wanted
        head = self._first_use(self._free_queue.popleft())
        if head is wanted:
            return self._evict(head)
        self._evict(head)
        move(wanted.block_id, head.block_id)
        self._free_queue.replace(wanted, head)
        head.block_hash, wanted.block_hash = wanted.block_hash, None
        self._cached_block_ids[head.block_hash] = head.block_id
        return wanted

    def _evict(self, block: KVBlock) -> KVBlock:
        """Drop a block's hash as it leaves the free queue."""
        if block.block_hash is not None:
            if self.on_evicted is not None:
                self.on_evicted(block.block_id, block.block_hash)
            self._num_cached_free -= 1
            del self._cached_block_ids[block.block_hash]
            self.events.removed(block.block_hash)
            block.block_hash = None
        return block

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per id, in order; blocks reaching 0 return to the free queue.

        Cached blocks go to the tail (evicted last), uncached ones to the head (reused first),
        so callers pass a request's blocks in reverse to evict its most specific block first.

        Args:
            block_ids: ids to release; an id may repeat once per reference held.

        Raises:
            ValueError: a block would go below ref_cnt 0; nothing changes.
        """
        block_ids = list(block_ids)
        for block_id, num_refs in Counter(block_ids).items():
            block = self._blocks.get(block_id)  # one never used has no reference either
            if block is None or block.ref_cnt < num_refs:
                raise ValueError(f"freeing block {block_id} would make its ref_cnt negative")
        for block_id in block_ids:
            block = self._blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt > 0:
                continue
            if block.block_hash is None:
                self._free_queue.appendleft(block)
            else:
                self._free_queue.append(block)
                self._num_cached_free += 1

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one reference per id; a free block leaves the free queue (a hit revives it).

        Args:
            block_ids: ids to reference; this is also how a pin holds its blocks.
        """
        for block_id in block_ids:
            block = self._blocks.get(block_id)
            if block is None:  # never used: free, so it leaves the queue as any free block
                block = self._first_use(self._free_queue.take_fresh(block_id))
            elif block.ref_cnt == 0:
                self._free_queue.remove(block)
                if block.block_hash is not None:
                    self._num_cached_free -= 1
            block.ref_cnt += 1

    def cache_full_blocks(
        self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int] = (), parent_block_hash: BlockHash | None = None,
    ) -> None:
        """Register full blocks under their content hashes so later requests can reuse them.

        A hash already held by a different block is left to that block and this one stays
        unhashed. Does nothing when caching is disabled. Each run of newly registered blocks is
        reported to ``events`` as stored.

        Args:
            block_ids: the full blocks, in the same order as ``block_hashes``; each allocated
                at least once (a block never allocated holds no KV: a ValueError, nothing
                changes).
            block_hashes: the blocks' chained content hashes.
            token_ids: the blocks' tokens, all of them in order (for the stored events; may be
                empty when nobody listens).
            parent_block_hash: the hash of the block before the first (None: the first block
                of its chain).
        """
        if len(block_ids) != len(block_hashes):
            raise ValueError(f"{len(block_ids)} block ids but {len(block_hashes)} hashes")
        if not self.enable_caching:
            return
        for block_id in block_ids:
            if self._used(block_id) is None:
                raise ValueError(f"block {block_id} was never allocated: it holds no KV to cache")
        run: list[int] = []  # indexes of the newly stored blocks, one consecutive run
        for index, (block_id, block_hash) in enumerate(zip(block_ids, block_hashes, strict=True)):
            block = self._blocks[block_id]
            if block.block_hash is not None:
                if block.block_hash != block_hash:
                    raise ValueError(f"block {block_id} already holds a different hash")
            elif block_hash not in self._cached_block_ids:
                block.block_hash = block_hash
                self._cached_block_ids[block_hash] = block_id
                if block.ref_cnt == 0:
                    self._num_cached_free += 1
                run.append(index)
                continue
            self._report_stored(run, block_hashes, token_ids, parent_block_hash)
        self._report_stored(run, block_hashes, token_ids, parent_block_hash)

    def _report_stored(self, run: list[int], block_hashes: Sequence[BlockHash],
                       token_ids: Sequence[int], parent_block_hash: BlockHash | None) -> None:
        """Tell ``events`` of the run of blocks just stored (then empty the run)."""
        if not run:
            return
        first, end = run[0], run[-1] + 1
        num_tokens = len(token_ids) // len(block_hashes)
        parent = block_hashes[first - 1] if first else parent_block_hash
        self.events.stored(block_hashes[first:end], parent,
                           token_ids[first * num_tokens:end * num_tokens])
        run.clear()

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first violated invariant of the pool (in time
        proportional to the blocks used)."""
        self._free_queue.check_links()
        linked = [block.block_id for block in self._free_queue]
        in_queue = set(linked)
        assert len(in_queue) == len(linked), "a block appears twice in the free queue"
        assert in_queue <= self._blocks.keys(), "the free queue links a block the pool lost"
        for block_id, block in self._blocks.items():
            assert block.block_id == block_id, f"block {block.block_id} is kept as {block_id}"
            assert not self._free_queue.is_fresh(block_id), f"block {block_id} is used and fresh"
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            queued = block.block_id in in_queue
            assert queued == (block.ref_cnt == 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but in free queue: {queued}"
            )
            if block.block_hash is not None:
                assert self._cached_block_ids.get(block.block_hash) == block.block_id, (
                    f"hashed block {block.block_id} is missing from the hash map"
                )
        num_fresh = len(self._free_queue) - len(linked)
        assert len(self._blocks) + num_fresh == self._num_blocks, (
            f"{len(self._blocks)} blocks used and {num_fresh} fresh in a pool of "
            f"{self._num_blocks}"
        )
        for block_hash, block_id in self._cached_block_ids.items():
            assert self.block_hash(block_id) == block_hash, (
                f"hash map points at block {block_id}, which holds a different hash"
            )
        num_cached_free = sum(1 for b in self._free_queue if b.block_hash is not None)
        assert num_cached_free == self._num_cached_free, (
            f"num_cached_free is {self._num_cached_free}, free queue holds {num_cached_free}"
        )
