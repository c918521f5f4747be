"""The pool's free queue: an intrusive doubly linked LRU list of blocks, and the ids never used.

Invariant: the queue is, head to tail, the linked blocks up to ``fresh_after``, then the fresh
ids (never handed out, so no ``KVBlock`` exists for them yet) in ascending order, then the rest
of the linked blocks. A fresh id becomes a ``KVBlock`` when it leaves the queue for the first
time and is linked from then on, so a pool of any size costs an object per block it has used,
not per block it could hold. Fresh ids only ever leave (a pool starts with all of them), which
keeps them one run in the queue: a freed block goes to the head or the tail, never between them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .hashing import BlockHash


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


class FreshIds:
    """Ids in ``[start, stop)`` not yet taken, in ascending order: ``next_id`` onwards, less
    ``taken`` (those taken out of order: each costs a set entry until ``next_id`` passes it)."""

    def __init__(self, ids: range) -> None:
        self._next_id = ids.start
        self._stop = ids.stop
        self._taken: set[int] = set()

    def __len__(self) -> int:
        return self._stop - self._next_id - len(self._taken)

    def __contains__(self, block_id: int) -> bool:
        return self._next_id <= block_id < self._stop and block_id not in self._taken

    def __iter__(self) -> Iterator[int]:
        return (i for i in range(self._next_id, self._stop) if i not in self._taken)

    def pop_lowest(self) -> int:
        while self._next_id in self._taken:
            self._taken.remove(self._next_id)
            self._next_id += 1
        block_id = self._next_id
        self._next_id += 1
        return block_id

    def take(self, block_id: int) -> None:
        """Take ``block_id``, which must be here, out of order."""
        if block_id == self._next_id:
            self.pop_lowest()
        else:
            self._taken.add(block_id)


class FreeBlockQueue:
    """Free blocks, LRU first: O(1) pop, append, appendleft and remove.

    Head is evicted first (LRU); the links live on the blocks themselves. ``fresh``: ids of
    blocks never used, queued after ``blocks`` (a ``KVBlock`` is made for one as it leaves).
    """

    def __init__(self, blocks: Sequence[KVBlock] = (), fresh: range = range(0)) -> None:
        self._head: KVBlock | None = None
        self._tail: KVBlock | None = None
        self._num_linked = 0
        self._fresh = FreshIds(fresh)
        self._fresh_after: KVBlock | None = None  # the linked block just before the fresh ids
        for block in blocks:
            self.append(block)
        self._fresh_after = self._tail

    def __len__(self) -> int:
        return self._num_linked + len(self._fresh)

    def __iter__(self) -> Iterator[KVBlock]:
        """The linked blocks, head to tail (fresh ids have no ``KVBlock``: see ``block_ids``)."""
        block = self._head
        while block is not None:
            yield block
            block = block.next_free

    def is_fresh(self, block_id: int) -> bool:
        """Whether ``block_id`` is queued and was never used (it has no ``KVBlock`` yet)."""
        return block_id in self._fresh

    def take_fresh(self, block_id: int) -> KVBlock:
        """Take a fresh id out of the queue, from anywhere in it: its new, unqueued block."""
        if block_id not in self._fresh:
            raise ValueError(f"block {block_id} is not a fresh block of the free queue")
        self._fresh.take(block_id)
        return KVBlock(block_id)

    def popleft(self) -> KVBlock:
        """Remove and return the head block (the next to reuse)."""
        if self._fresh_after is None and self._fresh:
            return KVBlock(self._fresh.pop_lowest())
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
        self._num_linked += 1

    def appendleft(self, block: KVBlock) -> None:
        """Put a block at the head (reused first)."""
        if self._fresh_after is None:
            self._fresh_after = block  # the fresh ids, if any, were the head: now after it
        block.prev_free, block.next_free = None, self._head
        if self._head is None:
            self._tail = block
        else:
            self._head.prev_free = block
        self._head = block
        self._num_linked += 1

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
        if self._fresh_after is old:
            self._fresh_after = new
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
        if self._fresh_after is block:
            self._fresh_after = block.prev_free
        block.prev_free = block.next_free = None
        self._num_linked -= 1

    def block_ids(self) -> list[int]:
        """Return the queued block ids, head to tail."""
        block_ids = [] if self._fresh_after is not None else list(self._fresh)
        for block in self:
            block_ids.append(block.block_id)
            if block is self._fresh_after:
                block_ids.extend(self._fresh)
        return block_ids

    def check_links(self) -> None:
        """Raise AssertionError if the links or the length are inconsistent."""
        prev: KVBlock | None = None
        num_seen = 0
        seen_fresh_after = self._fresh_after is None
        for block in self:
            assert block.prev_free is prev, f"free queue: bad prev link at block {block.block_id}"
            assert block.block_id not in self._fresh, f"block {block.block_id} is also fresh"
            seen_fresh_after = seen_fresh_after or block is self._fresh_after
            prev = block
            num_seen += 1
            assert num_seen <= self._num_linked, "free queue: longer than its length (a cycle?)"
        assert prev is self._tail, "free queue: tail does not match the last block"
        assert num_seen == self._num_linked, f"free queue: length {self._num_linked} != {num_seen}"
        assert seen_fresh_after, "free queue: the fresh ids follow a block not in the queue"
