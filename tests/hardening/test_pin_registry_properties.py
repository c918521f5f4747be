"""Property test: random pin / unpin / hit / expire / pool-pressure sequences on ``PinRegistry``
keep its invariants (cache/pin_registry.py): a pin holds exactly one reference on each of its
blocks, so every block's ref count equals its owners (live requests + pins holding it); distinct
pinned blocks never exceed the budget; pinned blocks are never evicted however hard the pool is
pressed; a refused pin (name taken, over budget) changes nothing; ``match`` returns the longest pin
whose whole chain starts a request's; TTLs expire exactly the pins idle longer than their TTL; and
unpinning everything returns the pool to all-free. Retained prefixes (cache control) share the
budget: pins and retained prefixes together never hold more than it, a retention only ever displaces
retained prefixes used less recently than those it keeps, never a pin, and a refused one changes
nothing. (The block pool and the KV cache manager have their own state machines in tests/cache.)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agentd.cache import KVCacheManager, PinError, PinNotFoundError, PinRegistry, hash_blocks

NUM_BLOCKS = 8
BLOCK_SIZE = 2
MAX_PINNED_BLOCKS = 4
NAMES = st.sampled_from(["a", "b", "c", "d"])
# shared stems make pins share blocks and requests hit pins
STEMS = st.sampled_from([[0, 1, 2, 0], [0, 1, 1, 2], [2, 2, 0, 0, 1, 1]])
PROMPTS = st.builds(lambda stem, tail: stem + tail, STEMS, st.lists(st.integers(0, 2), max_size=3))
TTLS = st.sampled_from([None, 5.0, 20.0])


@dataclass
class PinModel:
    token_ids: list[int]
    block_ids: list[int]
    block_hashes: list[bytes]
    ttl_s: float | None
    last_hit_s: float


class PinRegistryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.pool = self.manager.pool
        self.registry = PinRegistry(self.manager, MAX_PINNED_BLOCKS)
        self.pins: dict[str, PinModel] = {}
        self.requests: list[str] = []  # live requests holding blocks (pool pressure)
        self.now_s = 0.0
        self.next_id = 0

    def _request_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def snapshot(self) -> tuple:
        return (self.pool.free_block_ids(), [self.pool.ref_cnt(b) for b in range(NUM_BLOCKS)],
                sorted(p.name for p in self.registry), self.registry.num_pinned_blocks)

    @rule(name=NAMES, prompt=PROMPTS, ttl_s=TTLS)
    def pin(self, name: str, prompt: list[int], ttl_s: float | None) -> None:
        """Prefill ``prompt`` like the engine does for a pin, then pin its full blocks."""
        request_id = self._request_id()
        cached = self.manager.find_cached_prefix(prompt)
        if self.manager.allocate(request_id, len(prompt), cached) is None:
            return  # the pool is held by pins and requests: no room to prefill
        self.manager.cache_blocks(request_id, prompt, len(prompt))
        num_blocks = len(prompt) // BLOCK_SIZE
        full = self.manager.find_cached_prefix(prompt)
        assert len(full.block_ids) == num_blocks
        before = self.snapshot()
        try:
            pin = self.registry.add(name, prompt[:num_blocks * BLOCK_SIZE], full.block_ids,
                                    full.block_hashes[:num_blocks], now_s=self.now_s,
                                    created_s=0.0, ttl_s=ttl_s)
        except PinError:
            event("refused")
            assert self.snapshot() == before, "a refused pin changed something"
            new_blocks = {b for b in full.block_ids if not self.registry.holds(b)}
            taken = name in self.pins
            over = self.registry.num_pinned_blocks + len(new_blocks) > MAX_PINNED_BLOCKS
            assert taken or over, "a pin within budget and with a free name was refused"
        else:
            assert name not in self.pins
            event("pinned")
            assert pin.block_ids == full.block_ids and pin.num_blocks == num_blocks
            self.pins[name] = PinModel(prompt[:num_blocks * BLOCK_SIZE], list(full.block_ids),
                                       list(full.block_hashes[:num_blocks]), ttl_s, self.now_s)
        finally:
            self.manager.free(request_id)

    @rule(prompt=PROMPTS, ttl_s=st.sampled_from([5.0, 20.0]))
    def retain(self, prompt: list[int], ttl_s: float) -> None:
        """Compute ``prompt`` like a request and retain its full blocks (cache control)."""
        request_id = self._request_id()
        cached = self.manager.find_cached_prefix(prompt)
        if self.manager.allocate(request_id, len(prompt), cached) is None:
            return
        self.manager.cache_blocks(request_id, prompt, len(prompt))
        self.manager.free(request_id)
        full = self.manager.find_cached_prefix(prompt)
        held = {p.key: p.last_used_s for p in self.registry.retained}
        before = self.snapshot()
        prefix = self.registry.retain(full.block_ids, full.block_hashes, full.num_tokens, ttl_s,
                                      self.now_s, created_s=0.0)
        if prefix is None:
            event("retention refused")
            assert self.snapshot() == before, "a refused retention changed something"
            beyond = {b for b in full.block_ids if not self.registry.holds(b)}
            assert self.registry.num_pinned_blocks + len(beyond) > MAX_PINNED_BLOCKS
            return
        kept = {p.key: p.last_used_s for p in self.registry.retained if p.key in held}
        displaced = [last for key, last in held.items() if key not in kept]
        if displaced:
            event("retention displaced")
            assert max(displaced) <= min(kept.values(), default=float("inf"))

    @rule(name=NAMES)
    def unpin(self, name: str) -> None:
        before = self.snapshot()
        if name not in self.pins:
            with pytest.raises(PinNotFoundError):
                self.registry.remove(name)
            assert self.snapshot() == before
            return
        self.registry.remove(name)
        del self.pins[name]

    @rule(num_tokens=st.integers(1, NUM_BLOCKS * BLOCK_SIZE), salt=st.sampled_from([None, "s"]))
    def press(self, num_tokens: int, salt: str | None) -> None:
        """A request grabs blocks, evicting cached free ones — never pinned ones."""
        request_id = self._request_id()
        tokens = [7] * num_tokens  # a token no prompt uses: never a hit
        cached = self.manager.find_cached_prefix(tokens, salt)
        if self.manager.allocate(request_id, num_tokens, cached) is not None:
            self.requests.append(request_id)

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 100))
    def release(self, index: int) -> None:
        self.manager.free(self.requests.pop(index % len(self.requests)))

    @precondition(lambda self: self.pins)
    @rule(data=st.data(), tail=st.lists(st.integers(0, 2), max_size=4))
    def hit_a_pin(self, data: st.DataObject, tail: list[int]) -> None:
        """A request that starts with a pin's tokens hits that pin or a longer one."""
        name = data.draw(st.sampled_from(sorted(self.pins)))
        self.hit(self.pins[name].token_ids + tail)
        assert self.registry.match(hash_blocks(self.pins[name].token_ids + tail, BLOCK_SIZE)) \
            .num_blocks >= len(self.pins[name].block_ids)

    @rule(prompt=PROMPTS)
    def hit(self, prompt: list[int]) -> None:
        hashes = hash_blocks(prompt, BLOCK_SIZE)
        pin = self.registry.match(hashes)
        candidates = [(len(m.block_hashes), name) for name, m in self.pins.items()
                      if hashes[:len(m.block_hashes)] == m.block_hashes]
        if not candidates:
            assert pin is None
            return
        event("hit")
        assert pin is not None and pin.num_blocks == max(candidates)[0]
        assert hashes[:pin.num_blocks] == self.pins[pin.name].block_hashes
        self.registry.record_hit(pin, pin.num_tokens, self.now_s)
        self.pins[pin.name].last_hit_s = self.now_s

    @rule(prompt=PROMPTS)
    def hit_retained(self, prompt: list[int]) -> None:
        """A request that holds a retained prefix whole refreshes it (as the engine does)."""
        for prefix in self.registry.retained.matching(hash_blocks(prompt, BLOCK_SIZE)):
            event("retained hit")
            prefix.refresh(self.now_s)
            assert prefix.expires_s >= self.now_s + prefix.ttl_s

    @rule(elapsed_s=st.sampled_from([1.0, 6.0, 25.0]))
    def expire(self, elapsed_s: float) -> None:
        self.now_s += elapsed_s
        expired = sorted(key.name for key in self.registry.expired(self.now_s))
        assert expired == sorted(name for name, m in self.pins.items()
                                 if m.ttl_s is not None and self.now_s - m.last_hit_s > m.ttl_s)
        if expired:
            event("expired")
        for name in expired:  # what the engine does: they decay to ordinary LRU blocks
            self.registry.remove(name)
            del self.pins[name]
        for key in self.registry.retained.expired(self.now_s):
            event("retained expired")
            self.registry.release_retained(key)
        assert all(p.expires_s > self.now_s for p in self.registry.retained)

    @invariant()
    def every_reference_has_an_owner(self) -> None:
        self.pool.check_integrity()
        owners = Counter(b for r in self.requests for b in self.manager.block_table(r))
        owners.update(b for m in self.pins.values() for b in m.block_ids)
        owners.update(b for p in self.registry.retained for b in p.block_ids)
        assert [self.pool.ref_cnt(b) for b in range(NUM_BLOCKS)] == \
            [owners[b] for b in range(NUM_BLOCKS)]

    @invariant()
    def budget_and_names_hold(self) -> None:
        pinned = {b for m in self.pins.values() for b in m.block_ids}
        assert self.registry.num_pinned_blocks == len(pinned) <= MAX_PINNED_BLOCKS
        retained = {b for p in self.registry.retained for b in p.block_ids}
        assert self.registry.num_held_blocks == len(pinned | retained) <= MAX_PINNED_BLOCKS
        assert sorted(p.name for p in self.registry) == sorted(self.pins)
        assert all(self.registry.holds(b) for b in pinned)

    @invariant()
    def pinned_blocks_are_never_evicted(self) -> None:
        for model in self.pins.values():
            for block_id, block_hash in zip(model.block_ids, model.block_hashes, strict=True):
                assert self.pool.get_cached(block_hash) == block_id
        for prefix in self.registry.retained:
            for block_id, block_hash in zip(prefix.block_ids, prefix.block_hashes, strict=True):
                assert self.pool.get_cached(block_hash) == block_id

    def teardown(self) -> None:
        for name in list(self.pins):
            self.registry.remove(name)
        for prefix in self.registry.retained:
            self.registry.release_retained(prefix.key)
        for request_id in self.requests:
            self.manager.free(request_id)
        assert self.pool.num_free == NUM_BLOCKS and self.registry.num_pinned_blocks == 0
        self.pool.check_integrity()


PinRegistryMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40,
                                                deadline=None)
TestPinRegistryMachine = PinRegistryMachine.TestCase
