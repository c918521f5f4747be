"""The pool's KV events: exact events for each change of its hash map, and a property test that
replaying them always rebuilds the pool's hashed blocks, with parents and token ids that hash to
the blocks they name, and never a removal of a pinned block."""

from __future__ import annotations

from hypothesis import settings
from hypothesis.stateful import invariant

from agentd.cache import (
    BlockPool,
    BlockRemoved,
    BlockStored,
    KVCacheManager,
    KVEventLog,
    hash_block,
    hash_blocks,
    replay,
)

from .test_kv_cache_manager_properties import BLOCK_SIZE, NUM_BLOCKS, KVCacheManagerMachine


def h(n: int) -> bytes:
    return hash_block(None, [n])


def test_stored_runs_carry_parent_and_tokens_and_evictions_are_removed() -> None:
    log = KVEventLog()
    pool = BlockPool(4, events=log)
    block_ids = pool.allocate(3)
    assert block_ids == [0, 1, 2]
    pool.cache_full_blocks(block_ids[:1], [h(0)], [10, 11], None)
    assert log.take() == [BlockStored((h(0),), None, (10, 11))]
    pool.cache_full_blocks(block_ids, [h(0), h(1), h(2)], [10, 11, 12, 13, 14, 15], None)
    assert log.take() == [BlockStored((h(1), h(2)), h(0), (12, 13, 14, 15))]
    pool.free(reversed(block_ids))
    assert log.take() == []  # freed, still cached: nothing removed
    assert pool.free_block_ids() == [3, 2, 1, 0]
    pool.allocate(2)  # the free block 3, then block 2 (h(2)) is evicted
    assert log.take() == [BlockRemoved((h(2),))]
    assert pool.hashed_blocks() == {h(0), h(1)}
    pool.check_integrity()


def test_a_hash_held_elsewhere_splits_the_run() -> None:
    log = KVEventLog()
    pool = BlockPool(5, events=log)
    first = pool.allocate(1)
    pool.cache_full_blocks(first, [h(1)], [7], h(0))
    log.take()
    table = pool.allocate(3)
    pool.cache_full_blocks(table, [h(0), h(1), h(2)], [6, 7, 8], None)
    assert log.take() == [BlockStored((h(0),), None, (6,)), BlockStored((h(2),), h(1), (8,))]
    assert pool.block_hash(table[1]) is None and pool.hashed_blocks() == {h(0), h(1), h(2)}


def test_a_moved_hash_stays_stored() -> None:
    log = KVEventLog()
    pool = BlockPool(4, events=log)
    table = pool.allocate(2)
    pool.cache_full_blocks(table[1:], [h(9)], [9])
    pool.free(table[1:])
    assert table == [0, 1] and pool.free_block_ids() == [2, 3, 1]
    log.take()
    moves: list[tuple[int, int]] = []
    got = pool.allocate(1, after=0, move=lambda src, dst: moves.append((src, dst)))
    assert got == [1] and moves == [(1, 2)]  # block 1's KV moves to the head block, 2
    assert log.take() == [] and pool.hashed_blocks() == {h(9)} and pool.get_cached(h(9)) == 2
    pool.check_integrity()


class KVEventsMachine(KVCacheManagerMachine):
    """The manager machine's random lifecycles (hits, pins, evictions), with an event log."""

    def __init__(self) -> None:
        super().__init__()
        self.log = KVEventLog()
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, events=self.log)
        self.pool = self.manager.pool
        self.known: set[bytes] = set()

    @invariant()
    def events_replay_to_the_pool(self) -> None:
        events = self.log.take()
        pinned = {block_hash for pin in self.pins for _, block_hash in pin}
        for event in events:
            if isinstance(event, BlockRemoved):
                assert not pinned & set(event.block_hashes), "a pinned block reported removed"
            else:
                assert isinstance(event, BlockStored)
                assert _rehash(event) == list(event.block_hashes)
        replay(events, self.known)
        assert self.known == self.pool.hashed_blocks()


def _rehash(event: BlockStored) -> list[bytes]:
    """The hashes of the event's token ids chained on its parent (a first block: under either
    salt the machine uses)."""
    if event.parent_block_hash is not None:
        padded = [0] * BLOCK_SIZE + list(event.token_ids)
        return hash_blocks(padded, BLOCK_SIZE, parent=event.parent_block_hash, start_block=1)
    for salt in (None, "tenant"):
        if (hashes := hash_blocks(list(event.token_ids), BLOCK_SIZE, cache_salt=salt)) == \
                list(event.block_hashes):
            return hashes
    return []


KVEventsMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30,
                                            deadline=None)
TestKVEventsMachine = KVEventsMachine.TestCase
