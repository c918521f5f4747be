"""The pool of KV blocks: ref counts, the LRU free queue and the hash -> block map.

Invariant: every block is in exactly one of {free queue (ref_cnt == 0), referenced
(ref_cnt > 0)}; ref counts never go negative; the hash map points only at blocks whose
``block_hash`` equals the key, and every hashed block is in the map. A pinned block holds a
reference, so it never enters the free queue and can never be evicted. Every change to the map is
reported to the pool's ``events`` sink as it happens (:mod:`.kv_events`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from .hashing import BlockHash
from .kv_events import NULL_KV_EVENTS, KVEventSink


@dataclass(slots=True)
class KVBlock:
    """Bookkeeping for one physical KV block; the runner owns the memory."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free: KVBlock | None = None
    next_free: KVBlock | None = None


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than the free queue holds."""


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks: O(1) pop, append and remove.

    Head is evicted first (LRU); the links live on the blocks themselves.
    """

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self._head: KVBlock | None = None
        self._tail: KVBlock | None = None
        self._num_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._num_blocks

    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head
        while block is not None:
            yield block
            block = block.next_free

    def popleft(self) -> KVBlock:
        """Remove and return the head block (the next to reuse)."""
        block = self._head
        if block is None:
            raise NoFreeBlocksError("the free block queue is empty")
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        """Put a block at the tail (reused last)."""
        block.prev_free, block.next_free = self._tail, None
        if self._tail is None:
            self._head = block
        else:
            self._tail.next_free = block
        self._tail = block
        self._num_blocks += 1

    def appendleft(self, block: KVBlock) -> None:
        """Put a block at the head (reused first)."""
        block.prev_free, block.next_free = None, self._head
        if self._head is None:
            self._tail = block
        else:
            self._head.prev_free = block
        self._head = block
        self._num_blocks += 1

    def replace(self, old: KVBlock, new: KVBlock) -> None:
        """Put ``new`` (not queued) where ``old`` (queued) is, and unlink ``old``."""
        new.prev_free, new.next_free = old.prev_free, old.next_free
        if old.prev_free is None:
            self._head = new
        else:
            old.prev_free.next_free = new
        if old.next_free is None:
            self._tail = new
        else:
            old.next_free.prev_free = new
        old.prev_free = old.next_free = None

    def remove(self, block: KVBlock) -> None:
        """Unlink a block that is in the queue, from anywhere in it."""
        if block.prev_free is None:
            if self._head is not block:
                raise ValueError(f"block {block.block_id} is not in the free queue")
            self._head = block.next_free
        else:
            block.prev_free.next_free = block.next_free
        if block.next_free is None:
            self._tail = block.prev_free
        else:
            block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self._num_blocks -= 1

    def block_ids(self) -> list[int]:
        """Return the queued block ids, head to tail."""
        return [block.block_id for block in self]

    def check_links(self) -> None:
        """Raise AssertionError if the links or the length are inconsistent."""
        prev: KVBlock | None = None
        num_seen = 0
        for block in self:
            assert block.prev_free is prev, f"free queue: bad prev link at block {block.block_id}"
            prev = block
            num_seen += 1
            assert num_seen <= self._num_blocks, "free queue: longer than its length (a cycle?)"
        assert prev is self._tail, "free queue: tail does not match the last block"
        assert num_seen == self._num_blocks, f"free queue: length {self._num_blocks} != {num_seen}"


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
        self._blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        self._free_queue = FreeBlockQueue(self._blocks)
        self._cached_block_ids: dict[BlockHash, int] = {}
        self._num_cached_free = 0

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

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
        return self._blocks[block_id].ref_cnt

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._blocks[block_id].block_hash

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
        wanted = (self._blocks[wanted_id] if wanted_id is not None and wanted_id < len(self._blocks)
                  else None)
        if wanted is None or wanted.ref_cnt > 0 or (wanted.block_hash is not None and move is None):
            return self._evict(self._free_queue.popleft())
        if wanted.block_hash is None:
            self._free_queue.remove(wanted)
            return wanted
        head = self._free_queue.popleft()
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
            if self._blocks[block_id].ref_cnt < num_refs:
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
            block = self._blocks[block_id]
            if block.ref_cnt == 0:
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
            block_ids: the full blocks, in the same order as ``block_hashes``.
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
        """Raise AssertionError naming the first violated invariant of the pool."""
        self._free_queue.check_links()
        free_ids = self._free_queue.block_ids()
        assert len(set(free_ids)) == len(free_ids), "a block appears twice in the free queue"
        in_queue = set(free_ids)
        for block in self._blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            queued = block.block_id in in_queue
            assert queued == (block.ref_cnt == 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but in free queue: {queued}"
            )
            if block.block_hash is not None:
                assert self._cached_block_ids.get(block.block_hash) == block.block_id, (
                    f"hashed block {block.block_id} is missing from the hash map"
                )
        for block_hash, block_id in self._cached_block_ids.items():
            assert self._blocks[block_id].block_hash == block_hash, (
                f"hash map points at block {block_id}, which holds a different hash"
            )
        num_cached_free = sum(1 for b in self._free_queue if b.block_hash is not None)
        assert num_cached_free == self._num_cached_free, (
            f"num_cached_free is {self._num_cached_free}, free queue holds {num_cached_free}"
        )
