"""Property tests: random allocate/free/pin/unpin/cache sequences keep the design §3 invariants."""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agentd.cache import BlockPool, NoFreeBlocksError, hash_block

NUM_BLOCKS = 8


class BlockPoolMachine(RuleBasedStateMachine):
    """Owners (requests and pins) hold references; the model counts them per block."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.requests: list[list[int]] = []
        self.pins: list[list[tuple[int, bytes | None]]] = []
        # What each block's memory holds: the hash it was registered with (a stand-in for KV),
        # carried along by allocate's moves.
        self.content: dict[int, bytes] = {}

    def model_ref_cnts(self) -> Counter[int]:
        refs = Counter(b for owner in self.requests for b in owner)
        refs.update(b for pin in self.pins for b, _ in pin)
        return refs

    @rule(num_blocks=st.integers(0, NUM_BLOCKS + 1))
    def allocate(self, num_blocks: int) -> None:
        before = self.pool.free_block_ids()
        if num_blocks > len(before):
            try:
                self.pool.allocate(num_blocks)
            except NoFreeBlocksError:
                assert self.pool.free_block_ids() == before
                return
            raise AssertionError("allocate past num_free did not raise")
        block_ids = self.pool.allocate(num_blocks)
        assert block_ids == before[:num_blocks]
        for block_id in block_ids:
            self.content.pop(block_id, None)  # about to be written
        refs = self.model_ref_cnts()
        assert all(refs[b] == 0 for b in block_ids), "allocate handed out a referenced block"
        self.requests.append(block_ids)

    @rule(num_blocks=st.integers(0, NUM_BLOCKS), after=st.integers(0, NUM_BLOCKS - 1),
          moves=st.booleans())
    def allocate_after(self, num_blocks: int, after: int, moves: bool) -> None:
        """A table grown after block ``after``: consecutive blocks where free; what is cached
        stays cached, each hash with its content."""
        if num_blocks > self.pool.num_free:
            return
        cached_before = {self.pool.block_hash(b) for b in self.pool.free_block_ids()
                         if self.pool.block_hash(b) is not None}
        num_uncached = self.pool.num_free - len(cached_before)

        def move(src: int, dst: int) -> None:
            assert self.pool.ref_cnt(src) == 0 and self.pool.ref_cnt(dst) == 0
            self.content[dst] = self.content[src]

        block_ids = self.pool.allocate(num_blocks, after=after, move=move if moves else None)
        refs = self.model_ref_cnts()
        assert all(refs[b] == 0 for b in block_ids), "allocate handed out a referenced block"
        assert len(set(block_ids)) == len(block_ids)
        for block_id in block_ids:
            self.content.pop(block_id, None)  # about to be written
        cached_after = {self.pool.block_hash(b) for b in self.pool.free_block_ids()
                        if self.pool.block_hash(b) is not None}
        # only as many hashes as the head order would have evicted are gone
        assert len(cached_before - cached_after) <= max(0, num_blocks - num_uncached)
        self.requests.append(block_ids)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), keys=st.lists(st.integers(0, 5), max_size=NUM_BLOCKS))
    def cache_full_blocks(self, data: st.DataObject, keys: list[int]) -> None:
        owner = data.draw(st.sampled_from(self.requests))
        block_ids = owner[: len(keys)]
        # Small key space: distinct blocks often compute the same hash (the conflict path).
        block_hashes = [
            self.pool.block_hash(b) or hash_block(None, [k])
            for b, k in zip(block_ids, keys, strict=False)
        ]
        self.pool.cache_full_blocks(block_ids, block_hashes)
        for block_id in block_ids:
            block_hash = self.pool.block_hash(block_id)
            if block_hash is not None:
                self.content.setdefault(block_id, block_hash)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free_request(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.requests) - 1))
        self.pool.free(reversed(self.requests.pop(index)))

    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        refs = self.model_ref_cnts()
        held = sorted(refs)
        cached_free = [b for b in self.pool.free_block_ids() if self.pool.block_hash(b)]
        candidates = held + cached_free
        if not candidates:
            return
        block_ids = data.draw(st.lists(st.sampled_from(candidates), max_size=4, unique=True))
        self.pool.touch(block_ids)
        self.pins.append([(b, self.pool.block_hash(b)) for b in block_ids])

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.pins) - 1))
        self.pool.free(reversed([b for b, _ in self.pins.pop(index)]))

    @rule()
    def free_everything(self) -> None:
        for owner in self.requests:
            self.pool.free(reversed(owner))
        for pin in self.pins:
            self.pool.free(reversed([b for b, _ in pin]))
        self.requests, self.pins = [], []
        assert self.pool.num_free == NUM_BLOCKS and self.pool.num_used == 0

    @invariant()
    def pool_is_consistent(self) -> None:
        self.pool.check_integrity()
        refs = self.model_ref_cnts()
        for block_id in range(NUM_BLOCKS):
            assert self.pool.ref_cnt(block_id) == refs[block_id] >= 0

    @invariant()
    def every_hash_names_the_content_of_its_block(self) -> None:
        for block_id in range(NUM_BLOCKS):
            block_hash = self.pool.block_hash(block_id)
            if block_hash is not None:
                assert self.content.get(block_id) == block_hash

    @invariant()
    def pinned_blocks_are_never_evicted(self) -> None:
        for pin in self.pins:
            for block_id, block_hash in pin:
                assert self.pool.ref_cnt(block_id) > 0
                if block_hash is not None:
                    assert self.pool.block_hash(block_id) == block_hash
                    assert self.pool.get_cached(block_hash) == block_id


BlockPoolMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None
)
TestBlockPoolMachine = BlockPoolMachine.TestCase
