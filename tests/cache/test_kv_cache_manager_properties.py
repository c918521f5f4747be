"""Property tests: random request lifecycles on KVCacheManager keep the design §3 invariants.

Prompts are a few shared stems plus a tail from a three-token vocabulary, with two-token
blocks, so prefixes collide often and exercise hits, shared blocks, hash conflicts and the
eviction of cached free blocks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agentd.cache import KVCacheManager, hash_blocks

NUM_BLOCKS = 6
BLOCK_SIZE = 2
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=5)
# Prompts share a few stems so that later requests hit blocks cached by earlier ones.
STEMS = st.sampled_from([[0, 1, 2, 0], [0, 1, 1, 2, 2, 0], [2, 2]])
PROMPTS = st.builds(lambda stem, tail: stem + tail, STEMS, st.lists(st.integers(0, 2), max_size=3))
SALTS = st.sampled_from([None, "tenant"])


@dataclass
class Request:
    token_ids: list[int]
    cache_salt: str | None
    num_computed_tokens: int
    num_hit_blocks: int


class KVCacheManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.pool = self.manager.pool
        self.requests: dict[str, Request] = {}
        self.pins: list[list[tuple[int, bytes]]] = []
        self.content: dict[int, bytes] = {}  # block id -> hash of the KV last written there
        self.next_id = 0

    def snapshot(self) -> tuple[list[int], list[int]]:
        return self.pool.free_block_ids(), [self.pool.ref_cnt(b) for b in range(NUM_BLOCKS)]

    @rule(token_ids=PROMPTS, cache_salt=SALTS)
    def add_request(self, token_ids: list[int], cache_salt: str | None) -> None:
        request_id = f"r{self.next_id}"
        self.next_id += 1
        cached = self.manager.find_cached_prefix(
            token_ids, cache_salt, max_num_tokens=len(token_ids) - 1
        )
        assert cached.block_hashes == hash_blocks(token_ids, BLOCK_SIZE, cache_salt=cache_salt)
        for block_id, block_hash in zip(cached.block_ids, cached.block_hashes, strict=False):
            assert self.content[block_id] == block_hash, "a hit on a block of other content"
        before = self.snapshot()
        new_block_ids = self.manager.allocate(request_id, len(token_ids), cached)
        if new_block_ids is None:
            assert self.snapshot() == before and not self.manager.has_request(request_id)
            return
        assert all(before[1][b] == 0 for b in new_block_ids), "allocate took a held block"
        self.requests[request_id] = Request(
            token_ids, cache_salt, cached.num_tokens, len(cached.block_ids)
        )

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def compute(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        request = self.requests[request_id]
        num_tokens = data.draw(st.integers(request.num_computed_tokens, len(request.token_ids)))
        table = self.manager.block_table(request_id)
        expected = hash_blocks(request.token_ids, BLOCK_SIZE, cache_salt=request.cache_salt)
        for index in range(request.num_hit_blocks, num_tokens // BLOCK_SIZE):
            self.content[table[index]] = expected[index]
        request.num_computed_tokens = num_tokens
        self.manager.cache_blocks(request_id, request.token_ids, num_tokens, request.cache_salt)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), new_token_ids=TOKENS)
    def decode(self, data: st.DataObject, new_token_ids: list[int]) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        request = self.requests[request_id]
        if request.num_computed_tokens < len(request.token_ids):
            return
        before = self.snapshot()
        num_tokens = len(request.token_ids) + len(new_token_ids)
        if self.manager.allocate(request_id, num_tokens) is None:
            assert self.snapshot() == before
            return
        request.token_ids = request.token_ids + new_token_ids

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        del self.requests[request_id]
        self.manager.free(request_id)
        assert not self.manager.has_request(request_id)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        table = self.manager.block_table(request_id)
        hashed = [(b, h) for b in table if (h := self.pool.block_hash(b)) is not None]
        num_pinned = data.draw(st.integers(0, len(hashed)))
        self.manager.touch([b for b, _ in hashed[:num_pinned]])
        self.pins.append(hashed[:num_pinned])

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        pin = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        self.manager.free_blocks([b for b, _ in pin])

    @rule()
    def free_everything(self) -> None:
        for request_id in self.requests:
            self.manager.free(request_id)
        for pin in self.pins:
            self.manager.free_blocks([b for b, _ in pin])
        self.requests, self.pins = {}, []
        assert self.manager.num_free_blocks == NUM_BLOCKS and self.manager.usage == 0.0

    @invariant()
    def refs_match_owners(self) -> None:
        self.pool.check_integrity()
        refs = Counter(b for r in self.requests for b in self.manager.block_table(r))
        refs.update(b for pin in self.pins for b, _ in pin)
        assert [self.pool.ref_cnt(b) for b in range(NUM_BLOCKS)] == [
            refs[b] for b in range(NUM_BLOCKS)
        ]

    @invariant()
    def hashes_match_content(self) -> None:
        for block_id in range(NUM_BLOCKS):
            block_hash = self.pool.block_hash(block_id)
            if block_hash is not None:
                assert self.content[block_id] == block_hash

    @invariant()
    def pinned_blocks_are_never_evicted(self) -> None:
        for pin in self.pins:
            for block_id, block_hash in pin:
                assert self.pool.get_cached(block_hash) == block_id


KVCacheManagerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None
)
TestKVCacheManagerMachine = KVCacheManagerMachine.TestCase
