"""BlockPool: exact block ids, ref counts and free-queue order after every operation."""

from __future__ import annotations

import tracemalloc

import pytest

from agentd.cache import BlockPool, FreeBlockQueue, KVBlock, NoFreeBlocksError, hash_block


def h(n: int) -> bytes:
    return hash_block(None, [n])


def test_free_block_queue_ops() -> None:
    blocks = [KVBlock(i) for i in range(4)]
    queue = FreeBlockQueue(blocks)
    assert queue.block_ids() == [0, 1, 2, 3] and len(queue) == 4
    queue.remove(blocks[2])
    assert queue.block_ids() == [0, 1, 3]
    assert queue.popleft() is blocks[0]
    queue.appendleft(blocks[2])
    queue.append(blocks[0])
    assert queue.block_ids() == [2, 1, 3, 0] and len(queue) == 4
    for block in (blocks[0], blocks[2], blocks[3], blocks[1]):
        queue.remove(block)
    assert queue.block_ids() == [] and len(queue) == 0
    with pytest.raises(NoFreeBlocksError):
        queue.popleft()
    queue.check_links()


def test_initial_state() -> None:
    pool = BlockPool(4)
    assert pool.free_block_ids() == [0, 1, 2, 3]
    assert (pool.num_blocks, pool.num_free, pool.num_used, pool.usage) == (4, 4, 0, 0.0)
    pool.check_integrity()
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_pops_head_in_id_order() -> None:
    pool = BlockPool(5)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(0) == []
    assert pool.allocate(1) == [2]
    assert [pool.ref_cnt(i) for i in range(5)] == [1, 1, 1, 0, 0]
    assert pool.free_block_ids() == [3, 4]
    assert (pool.num_used, pool.usage) == (3, 0.6)
    pool.check_integrity()


def test_free_cached_to_tail_in_reverse_uncached_to_head() -> None:
    pool = BlockPool(6)
    block_ids = pool.allocate(4)  # a request's table: 0 1 2 3, blocks 0-2 full
    pool.cache_full_blocks([0, 1, 2], [h(0), h(1), h(2)])
    assert pool.free_block_ids() == [4, 5]
    pool.free(reversed(block_ids))
    # 3 (uncached) to the head; 2, 1, 0 (cached) to the tail, most specific first to evict.
    assert pool.free_block_ids() == [3, 4, 5, 2, 1, 0]
    assert [pool.ref_cnt(i) for i in range(6)] == [0] * 6
    assert (pool.num_free, pool.num_cached_free) == (6, 3)
    pool.check_integrity()


def test_popping_a_cached_block_evicts_its_hash() -> None:
    pool = BlockPool(2)
    pool.allocate(2)
    pool.cache_full_blocks([0, 1], [h(0), h(1)])
    pool.free([1, 0])
    assert pool.free_block_ids() == [1, 0]
    assert pool.allocate(1) == [1]
    assert pool.get_cached(h(1)) is None and pool.block_hash(1) is None
    assert pool.get_cached(h(0)) == 0 and pool.block_hash(0) == h(0)
    assert (pool.num_free, pool.num_cached_free) == (1, 1)
    pool.check_integrity()


def test_touch_revives_a_cached_free_block() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    pool.cache_full_blocks([0, 1], [h(0), h(1)])
    pool.free([1, 0])
    assert pool.free_block_ids() == [2, 1, 0]
    pool.touch([pool.get_cached(h(0))])  # type: ignore[list-item]
    assert pool.ref_cnt(0) == 1 and pool.free_block_ids() == [2, 1]
    pool.touch([0])
    assert pool.ref_cnt(0) == 2 and pool.free_block_ids() == [2, 1]
    assert pool.num_cached_free == 1
    pool.check_integrity()


def test_pin_survives_allocation_pressure() -> None:
    pool = BlockPool(4)
    pool.allocate(2)
    pool.cache_full_blocks([0, 1], [h(0), h(1)])
    pool.touch([0, 1])  # pin
    pool.free([1, 0])  # the request ends; the pin still holds both blocks
    assert [pool.ref_cnt(i) for i in range(4)] == [1, 1, 0, 0]
    assert pool.free_block_ids() == [2, 3]
    assert pool.allocate(2) == [2, 3]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    assert pool.get_cached(h(0)) == 0 and pool.get_cached(h(1)) == 1
    pool.free([1, 0])  # unpin
    assert pool.free_block_ids() == [1, 0]
    pool.check_integrity()


def test_double_hash_conflict_leaves_second_block_unhashed() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    pool.cache_full_blocks([0], [h(7)])
    pool.cache_full_blocks([1], [h(7)])
    assert pool.get_cached(h(7)) == 0
    assert pool.block_hash(0) == h(7) and pool.block_hash(1) is None
    pool.cache_full_blocks([0], [h(7)])  # re-registering the same block is a no-op
    pool.free([1, 0])
    assert pool.free_block_ids() == [1, 2, 0]
    pool.check_integrity()


def test_no_free_blocks_changes_nothing() -> None:
    pool = BlockPool(3)
    pool.allocate(1)
    pool.cache_full_blocks([0], [h(0)])
    pool.free([0])
    before = (pool.free_block_ids(), [pool.ref_cnt(i) for i in range(3)])
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(4)
    assert (pool.free_block_ids(), [pool.ref_cnt(i) for i in range(3)]) == before
    assert pool.get_cached(h(0)) == 0
    pool.check_integrity()


def test_negative_ref_cnt_raises_and_changes_nothing() -> None:
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(ValueError, match="negative"):
        pool.free([0, 0])
    with pytest.raises(ValueError, match="negative"):
        pool.free([1])
    assert pool.ref_cnt(0) == 1 and pool.free_block_ids() == [1]
    pool.check_integrity()


def test_caching_disabled_registers_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    pool.allocate(2)
    pool.cache_full_blocks([0, 1], [h(0), h(1)])
    assert pool.get_cached(h(0)) is None and pool.block_hash(0) is None
    pool.free([1, 0])
    assert pool.free_block_ids() == [0, 1]
    pool.check_integrity()


def test_check_integrity_catches_corruption() -> None:
    pool = BlockPool(2)
    pool.allocate(1)
    pool._blocks[0].ref_cnt = 0  # not in the free queue, yet unreferenced
    with pytest.raises(AssertionError, match="block 0"):
        pool.check_integrity()


def test_allocate_after_grows_a_table_into_the_next_block() -> None:
    pool = BlockPool(5)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1, after=2) == [3]  # free and empty: taken out of head order
    assert pool.free_block_ids() == [2, 4]
    assert pool.allocate(2, after=4) == [2, 4]  # past the last block: the head, then 2 + 1 ...
    pool.check_integrity()


def test_allocate_after_moves_the_kv_of_a_cached_next_block() -> None:
    pool = BlockPool(6)
    ids = pool.allocate(4)  # an earlier request: a prefix 0 1, its own full block 2, and 3
    pool.cache_full_blocks([0, 1, 2], [h(0), h(1), h(2)])
    pool.free(reversed(ids))
    pool.touch([0, 1])  # a new request hits the prefix
    assert pool.free_block_ids() == [3, 4, 5, 2]
    # without a way to move KV, a cached block is never taken out of LRU order
    assert pool.allocate(1, after=1) == [3]
    pool.free([3])
    moves: list[tuple[int, int]] = []
    assert pool.allocate(1, after=1, move=lambda src, dst: moves.append((src, dst))) == [2]
    # the head (3) was evicted as head order would have; it now holds block 2's KV and hash,
    # in block 2's place in the LRU order
    assert moves == [(2, 3)]
    assert pool.get_cached(h(2)) == 3 and pool.block_hash(2) is None
    assert pool.free_block_ids() == [4, 5, 3]
    assert pool.num_cached_free == 1
    pool.check_integrity()


def test_blocks_never_used_sit_between_the_head_and_the_tail_in_id_order() -> None:
    pool = BlockPool(8)
    table = pool.allocate(3)
    pool.cache_full_blocks(table[:2], [h(0), h(1)])
    pool.free(reversed(table))  # 2 (uncached) to the head, 1 then 0 (cached) to the tail
    assert pool.free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    pool.touch([5])  # a block never used, taken from the middle of the run
    assert pool.allocate(2, after=3) == [4, 2]  # 4 right after 3, then the head
    assert pool.free_block_ids() == [3, 6, 7, 1, 0]
    assert [pool.ref_cnt(i) for i in range(8)] == [0, 0, 1, 0, 1, 1, 0, 0]
    assert pool.allocate(4) == [3, 6, 7, 1] and pool.get_cached(h(1)) is None
    pool.check_integrity()


def test_caching_a_block_never_allocated_is_refused() -> None:
    pool = BlockPool(4)
    pool.allocate(1)
    with pytest.raises(ValueError, match="block 2 was never allocated"):
        pool.cache_full_blocks([0, 2], [h(0), h(2)])
    assert pool.get_cached(h(0)) is None and pool.free_block_ids() == [1, 2, 3]
    pool.check_integrity()


def test_a_pool_costs_memory_for_the_blocks_it_uses_not_for_those_it_could_hold() -> None:
    """A pool sized for a large KV budget (10 million blocks is 160M tokens) must not build
    bookkeeping for every block up front: it grows with the blocks handed out."""
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        pool = BlockPool(10_000_000)
        built, _ = tracemalloc.get_traced_memory()
        table = pool.allocate(1000)
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert built - before < 64 * 1024, f"an empty pool of 10M blocks took {built - before:,} B"
    assert (used - built) / 1000 < 1024, f"{(used - built) / 1000:,.0f} B a block used"
    assert table == list(range(1000)) and pool.num_free == 10_000_000 - 1000
    pool.free(reversed(table))
    assert pool.num_free == pool.num_blocks
    pool.check_integrity()
    assert pool.allocate(2) == [0, 1]  # freed to the head, in table order
