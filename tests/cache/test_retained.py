"""Retained prefixes in the pin budget: holds with an expiry, refreshed on use, decaying least
recently used first, never displacing a pin (cache/retained.py, cache/pin_registry.py)."""

from __future__ import annotations

import pytest

from agentd.cache import KVCacheManager, PinBudgetError, PinRegistry

BLOCK_SIZE = 2


def computed(manager: KVCacheManager, request_id: str, tokens: list[int]):
    """Run a request through the cache (look up, allocate, 'compute', free); return the cached
    prefix of its tokens afterwards (block ids and hashes)."""
    cached = manager.find_cached_prefix(tokens)
    assert manager.allocate(request_id, len(tokens), cached) is not None
    manager.cache_blocks(request_id, tokens, len(tokens))
    manager.free(request_id)
    return manager.find_cached_prefix(tokens)


def retain(registry: PinRegistry, prefix, now_s: float, ttl_s: float = 10.0):
    return registry.retain(prefix.block_ids, prefix.block_hashes, prefix.num_tokens, ttl_s,
                           now_s, created_s=0.0)


def test_a_retained_prefix_holds_its_blocks_until_it_expires() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)
    registry = PinRegistry(manager, max_pinned_blocks=4)
    prefix = computed(manager, "a", [1, 2, 3, 4])
    assert prefix.block_ids == [0, 1]
    retained = retain(registry, prefix, now_s=100.0, ttl_s=10.0)
    assert retained is not None and retained.expires_s == 110.0
    assert [manager.pool.ref_cnt(b) for b in (0, 1)] == [1, 1]
    assert manager.pool.free_block_ids() == [2, 3, 4, 5]  # out of the free queue: not evictable
    # the whole pool allocated: the held blocks are never handed out
    assert manager.allocate("big", 4 * BLOCK_SIZE) == [2, 3, 4, 5]
    assert manager.allocate("more", 5 * BLOCK_SIZE) is None
    manager.free("big")
    assert registry.retained.expired(109.9) == []
    assert registry.retained.expired(110.0) == [retained.key]
    registry.release_retained(retained.key)
    # decayed to ordinary LRU: still cached (a hit) until evicted, most specific block first
    assert manager.pool.free_block_ids()[-2:] == [1, 0]
    assert manager.find_cached_prefix([1, 2, 3, 4]).block_ids == [0, 1]
    manager.pool.check_integrity()


def test_a_hit_or_a_second_retain_refreshes_instead_of_holding_twice() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)
    registry = PinRegistry(manager, max_pinned_blocks=4)
    prefix = computed(manager, "a", [1, 2, 3, 4])
    first = retain(registry, prefix, now_s=0.0, ttl_s=5.0)
    again = retain(registry, prefix, now_s=3.0, ttl_s=60.0)  # a longer TTL replaces a shorter
    assert again is first and len(registry.retained) == 1
    assert (first.ttl_s, first.expires_s, first.last_used_s) == (60.0, 63.0, 3.0)
    assert [manager.pool.ref_cnt(b) for b in (0, 1)] == [1, 1]
    request_chain = manager.find_cached_prefix([1, 2, 3, 4, 5, 6]).block_hashes
    assert registry.retained.matching(request_chain) == [first]
    assert registry.retained.matching(request_chain[:1]) == []  # only a whole prefix is a hit
    first.refresh(50.0)
    assert first.expires_s == 110.0
    manager.pool.check_integrity()


def test_over_budget_the_least_recently_used_prefix_decays_first() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    registry = PinRegistry(manager, max_pinned_blocks=4)
    a = retain(registry, computed(manager, "a", [1, 1, 1, 1]), now_s=1.0)
    b = retain(registry, computed(manager, "b", [2, 2, 2, 2]), now_s=2.0)
    assert registry.num_held_blocks == 4
    a.refresh(3.0)  # a was used after b: b is now the oldest
    c = retain(registry, computed(manager, "c", [3, 3]), now_s=4.0)
    assert c is not None
    assert [p.key for p in registry.retained] == [a.key, c.key]
    assert registry.num_retained_displaced == 1
    assert registry.num_held_blocks == 3
    # b's blocks are ordinary cached blocks again
    assert all(manager.pool.ref_cnt(block) == 0 for block in b.block_ids)
    manager.pool.check_integrity()


def test_shared_blocks_count_once_in_the_budget() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    registry = PinRegistry(manager, max_pinned_blocks=3)
    system = retain(registry, computed(manager, "s", [7, 7, 8, 8]), now_s=1.0, ttl_s=3600.0)
    turn = retain(registry, computed(manager, "t", [7, 7, 8, 8, 9, 9]), now_s=2.0, ttl_s=300.0)
    assert system is not None and turn is not None
    assert turn.block_ids[:2] == system.block_ids
    assert registry.num_held_blocks == 3  # not 5
    assert [manager.pool.ref_cnt(b) for b in turn.block_ids] == [2, 2, 1]
    manager.pool.check_integrity()


def test_a_pin_displaces_retention_and_retention_never_displaces_a_pin() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    registry = PinRegistry(manager, max_pinned_blocks=4)
    old = retain(registry, computed(manager, "a", [1, 1, 2, 2, 3, 3]), now_s=1.0)
    assert old is not None and registry.num_held_blocks == 3
    pinned = computed(manager, "p", [5, 5, 6, 6])
    # the pin is checked against pins alone: retention never refuses it...
    registry.add("pin", [5, 5, 6, 6], pinned.block_ids, pinned.block_hashes, now_s=2.0,
                 created_s=0.0)
    # ...and the retained prefix made room for it
    assert len(registry.retained) == 0 and registry.num_held_blocks == 2
    assert all(manager.pool.ref_cnt(block) == 0 for block in old.block_ids)
    # a retention the pins leave no room for is refused, and changes nothing
    registry.add("pin2", [8, 8], computed(manager, "q", [8, 8]).block_ids,
                 manager.find_cached_prefix([8, 8]).block_hashes, now_s=3.0, created_s=0.0)
    refused = computed(manager, "r", [4, 4, 4, 4])
    before = (manager.pool.free_block_ids(), [manager.pool.ref_cnt(b) for b in range(10)])
    assert retain(registry, refused, now_s=4.0) is None
    assert (manager.pool.free_block_ids(),
            [manager.pool.ref_cnt(b) for b in range(10)]) == before
    assert len(registry.retained) == 0
    assert sorted(p.name for p in registry) == ["pin", "pin2"]
    # retaining a prefix the pins already hold costs nothing and is allowed
    assert retain(registry, pinned, now_s=5.0) is not None
    assert registry.num_held_blocks == 3 and registry.num_retained_blocks == 0
    with pytest.raises(PinBudgetError):  # pins keep their own, unchanged budget
        registry.check_can_add("pin3", num_blocks=2)
    manager.pool.check_integrity()
