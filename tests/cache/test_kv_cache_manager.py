"""KVCacheManager: prefix hits across requests, caps, salts, all-or-nothing allocation."""

from __future__ import annotations

import pytest

from agentd.cache import CachedPrefix, KVCacheManager, hash_blocks

BLOCK_SIZE = 4
PROMPT = list(range(10))  # two full blocks and a partial one


def run_request(manager: KVCacheManager, request_id: str, tokens: list[int]) -> list[int]:
    """Look up, allocate and 'compute' every token of a request; return its block table."""
    cached = manager.find_cached_prefix(tokens, max_num_tokens=len(tokens) - 1)
    assert manager.allocate(request_id, len(tokens), cached) is not None
    manager.cache_blocks(request_id, tokens, len(tokens))
    return manager.block_table(request_id)


def test_second_request_hits_first_requests_prefix() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    assert run_request(manager, "a", PROMPT) == [0, 1, 2]
    cached = manager.find_cached_prefix(PROMPT)
    assert cached == CachedPrefix([0, 1], hash_blocks(PROMPT, BLOCK_SIZE), 8)
    assert manager.allocate("b", len(PROMPT), cached) == [3]
    assert manager.block_table("b") == [0, 1, 3]
    assert [manager.pool.ref_cnt(i) for i in range(4)] == [2, 2, 1, 1]
    manager.free("a")
    assert manager.pool.free_block_ids() == [2, 4, 5, 6, 7]
    manager.free("b")
    # b's table reversed: 3 (uncached) to head; 1, 0 (cached) to tail.
    assert manager.pool.free_block_ids() == [3, 2, 4, 5, 6, 7, 1, 0]
    assert not manager.has_request("a") and manager.num_free_blocks == 8
    manager.pool.check_integrity()


def test_hit_on_free_cached_blocks_after_first_request_ends() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    run_request(manager, "a", PROMPT)
    manager.free("a")
    assert manager.pool.free_block_ids() == [2, 3, 1, 0]
    cached = manager.find_cached_prefix(PROMPT)
    assert cached.block_ids == [0, 1]
    assert manager.allocate("b", 12, cached) == [2]
    assert manager.pool.free_block_ids() == [3]
    manager.pool.check_integrity()


def test_prefix_is_capped_by_max_num_tokens_in_whole_blocks() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    tokens = list(range(8))
    run_request(manager, "a", tokens)
    assert manager.find_cached_prefix(tokens).num_tokens == 8
    assert manager.find_cached_prefix(tokens, max_num_tokens=7).block_ids == [0]
    assert manager.find_cached_prefix(tokens, max_num_tokens=3).block_ids == []
    assert len(manager.find_cached_prefix(tokens, max_num_tokens=3).block_hashes) == 2


def test_different_salt_misses() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    cached = manager.find_cached_prefix(PROMPT, cache_salt="x")
    manager.allocate("a", len(PROMPT), cached)
    manager.cache_blocks("a", PROMPT, len(PROMPT), cache_salt="x")
    assert manager.find_cached_prefix(PROMPT, cache_salt="x").block_ids == [0, 1]
    assert manager.find_cached_prefix(PROMPT, cache_salt="y").block_ids == []
    assert manager.find_cached_prefix(PROMPT).block_ids == []


def test_extra_key_scopes_the_cache() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, extra_key=b"model-a")
    run_request(manager, "a", PROMPT)
    assert manager.pool.block_hash(0) == hash_blocks(PROMPT, BLOCK_SIZE, b"model-a")[0]


def test_stops_at_first_miss() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    run_request(manager, "a", list(range(13)))
    tokens = list(range(4)) + [99] * 4 + list(range(8, 12))
    assert manager.find_cached_prefix(tokens).block_ids == [0]


def test_incremental_cache_blocks_during_decode() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    tokens = list(range(6))
    assert manager.allocate("a", 6) == [0, 1]
    manager.cache_blocks("a", tokens, 6)
    assert manager.pool.block_hash(0) is not None and manager.pool.block_hash(1) is None
    tokens += [6, 7, 8]
    assert manager.allocate("a", 9) == [2]
    assert manager.allocate("a", 9) == []
    manager.cache_blocks("a", tokens, 8)
    assert [manager.pool.block_hash(i) for i in range(3)] == hash_blocks(tokens, 4) + [None]
    manager.pool.check_integrity()


def test_allocate_none_changes_nothing_counting_revived_blocks() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    run_request(manager, "a", PROMPT)
    manager.free("a")
    cached = manager.find_cached_prefix(PROMPT)
    assert cached.block_ids == [0, 1] and manager.num_free_blocks == 4
    # 3 new blocks + 2 revived cached blocks > 4 free, though 3 new alone would fit.
    before = manager.pool.free_block_ids()
    assert manager.allocate("b", 20, cached) is None
    assert manager.pool.free_block_ids() == before and not manager.has_request("b")
    assert [manager.pool.ref_cnt(i) for i in range(4)] == [0] * 4
    assert manager.allocate("b", 16, cached) == [2, 3]
    assert manager.allocate("b", 17) is None
    assert manager.block_table("b") == [0, 1, 2, 3]
    manager.pool.check_integrity()


def test_stale_prefix_is_refused() -> None:
    manager = KVCacheManager(num_blocks=2, block_size=BLOCK_SIZE)
    run_request(manager, "a", PROMPT[:8])
    manager.free("a")
    cached = manager.find_cached_prefix(PROMPT[:8])
    assert cached.block_ids == [0, 1]
    manager.allocate("evictor", 8)  # pops both cached blocks
    manager.free("evictor")
    with pytest.raises(ValueError, match="stale"):
        manager.allocate("b", 8, cached)
    assert not manager.has_request("b")


def test_pins_hold_blocks_across_request_end() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    table = run_request(manager, "a", PROMPT)
    manager.touch(table[:2])  # pin the cached prefix
    manager.free("a")
    assert manager.pool.free_block_ids() == [2, 3]
    assert manager.allocate("b", 16) is None
    assert manager.find_cached_prefix(PROMPT).block_ids == [0, 1]
    manager.free_blocks(table[:2])  # unpin: most specific block is evicted first
    assert manager.pool.free_block_ids() == [2, 3, 1, 0]
    manager.pool.check_integrity()


def test_caching_disabled() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, enable_caching=False)
    run_request(manager, "a", PROMPT)
    assert manager.find_cached_prefix(PROMPT) == CachedPrefix([], [], 0)
    assert manager.pool.block_hash(0) is None
    manager.free("a")
    manager.free("unknown")
    assert manager.num_free_blocks == 4 and manager.usage == 0.0


def test_the_owner_audit_catches_a_reference_without_an_owner_and_one_freed_behind_it() -> None:
    manager = KVCacheManager(num_blocks=1_000_000, block_size=BLOCK_SIZE)  # audited as used
    table = run_request(manager, "a", PROMPT)
    manager.holders.check()
    manager.pool.touch([table[0], 999_999])  # references nobody owns
    with pytest.raises(AssertionError, match="block 0 has ref_cnt 2 but 1 owners"):
        manager.holders.check()
    manager.pool.free([table[0]])
    with pytest.raises(AssertionError, match="block 999999 has ref_cnt 1 but 0 owners"):
        manager.holders.check()
    manager.pool.free([999_999, table[2]])  # and one freed behind its owner's back
    with pytest.raises(AssertionError, match=f"block {table[2]} has ref_cnt 0 but 1 owners"):
        manager.holders.check()
