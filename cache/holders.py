"""Who holds the references on blocks: one owner -> blocks map for every kind of holder.

A reference is held by an owner: a request's block table, a pin, a retained prefix, a kept
partial block (a stored conversation's). Holding is touching, releasing is
freeing (last block first, so a prefix's most specific block is evicted first); the pool only
counts, this map says who. Design §9: retention is one mechanism, this is it.

Invariant: every block's ``ref_cnt`` in the pool equals the number of owners listing it, when
no one else takes references (``check`` asserts it); an owner lists a block at most once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterator, Sequence
from typing import NamedTuple

from .block_pool import BlockPool

REQUEST = "request"  # a live request's block table (the cache manager's)
PIN = "pin"  # a pin's full blocks and its tail block (key: its PinKey)
RETAINED = "retained"  # a retained prefix (key: the hash of its last block)
CONVERSATION = "conversation"  # a stored conversation's last partial block (key: request id)


class Owner(NamedTuple):
    kind: str
    key: Hashable


class BlockHolders:
    """The owners of references on a pool's blocks, counted per kind."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._held: dict[Owner, list[int]] = {}
        self._counts: dict[str, Counter[int]] = {}  # kind -> block id -> owners of that kind

    def __contains__(self, owner: Owner) -> bool:
        return owner in self._held

    def items(self) -> Iterator[tuple[Owner, list[int]]]:
        return iter(list(self._held.items()))

    def blocks(self, owner: Owner) -> list[int]:
        """The blocks ``owner`` holds, in the order it took them (a copy)."""
        return list(self._held[owner])

    def view(self, owner: Owner) -> Sequence[int]:
        """The same, without copying: read it, never change it."""
        return self._held[owner]

    def hold(self, owner: Owner, block_ids: Sequence[int]) -> None:
        """``owner`` takes a reference on each block (appended to what it holds already)."""
        self.pool.touch(block_ids)
        self.adopt(owner, block_ids)

    def adopt(self, owner: Owner, block_ids: Sequence[int]) -> None:
        """``owner`` holds these blocks by references already taken (fresh allocations)."""
        self._held.setdefault(owner, []).extend(block_ids)
        self._counts.setdefault(owner.kind, Counter()).update(block_ids)

    def release(self, owner: Owner) -> list[int]:
        """Drop every reference ``owner`` holds, last block first; unknown owners: none."""
        if owner not in self._held:
            return []
        dropped = self._drop(owner, 0)
        del self._held[owner]
        return dropped

    def shrink(self, owner: Owner, num_kept: int) -> list[int]:
        """Drop ``owner``'s references past its first ``num_kept`` blocks (last first)."""
        return self._drop(owner, num_kept)

    def _drop(self, owner: Owner, num_kept: int) -> list[int]:
        held = self._held[owner]
        dropped = held[num_kept:]
        self.pool.free(reversed(dropped))  # raises, changing nothing, on a double free
        del held[num_kept:]
        counts = self._counts[owner.kind]
        counts.subtract(dropped)
        for block_id in dropped:
            if not counts[block_id]:
                del counts[block_id]
        return dropped

    def holds(self, kind: str, block_id: int) -> bool:
        """Whether an owner of ``kind`` holds ``block_id``."""
        return block_id in self._counts.get(kind, ())

    def distinct(self, kind: str) -> set[int]:
        """The distinct blocks owners of ``kind`` hold."""
        return set(self._counts.get(kind, ()))

    def num_distinct(self, kind: str) -> int:
        return len(self._counts.get(kind, ()))

    def check(self) -> None:
        """Raise AssertionError unless each block's ref count equals the owners holding it."""
        owners: Counter[int] = Counter()
        for block_ids in self._held.values():
            owners.update(block_ids)
        for block_id in sorted(owners.keys() | set(self.pool.referenced_block_ids())):
            ref_cnt = self.pool.ref_cnt(block_id)
            assert ref_cnt == owners[block_id], (
                f"block {block_id} has ref_cnt {ref_cnt} but {owners[block_id]} owners (a leaked "
                "or double-freed reference)"
            )
