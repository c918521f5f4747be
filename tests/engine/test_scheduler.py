"""Scheduler with a real KVCacheManager and a fake runner: exact steps, blocks and preemptions.

The fake runner is plain Python: each step it returns one fixed next token per sampling request.
Every step goes through ``run_step``, which checks the token budget, ``max_num_seqs`` and the
pool's integrity, so each test also holds those invariants at every step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from agentd.cache import KVCacheManager
from agentd.engine.output_processor import OutputProcessor
from agentd.engine.request import Request, RequestStatus
from agentd.engine.sampling_params import SamplingParams
from agentd.engine.scheduler import Scheduler, SchedulerOutput

BLOCK_SIZE = 4
EOS = 2


class ProcessingScheduler(Scheduler):
    """The scheduler as the engine drives it: the output processor takes each step's sampled
    tokens (and decides who finished) before ``update_from_output``."""

    def __init__(self, *args, eos_token_ids: list[int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.processor = OutputProcessor(eos_token_ids, self.max_model_len)

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        self.processor.add(request)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        requests = [self.requests[s.request_id] for s in out.scheduled
                    if s.sample and s.request_id in self.requests]
        self.processor.process(requests, sampled)
        super().update_from_output(out, sampled)


@dataclass
class FakeRunner:
    """Returns ``next_token[request_id]`` for every row that samples; counts what ran."""

    next_token: dict[str, int] = field(default_factory=dict)
    num_tokens: int = 0

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        self.num_tokens += out.num_batched_tokens
        return {s.request_id: [self.next_token.get(s.request_id, 7)] for s in out.scheduled
                if s.sample}


@dataclass
class Harness:
    scheduler: Scheduler
    runner: FakeRunner
    budget: int
    max_num_seqs: int

    @property
    def kv_cache(self) -> KVCacheManager:
        return self.scheduler.kv_cache

    def add(self, request_id: str, prompt: list[int], max_tokens: int = 16,
            next_token: int = 7, **params) -> Request:
        request = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params),
                          max_output_tokens=max_tokens)
        self.runner.next_token[request_id] = next_token
        self.scheduler.add_request(request)
        return request

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        assert out.num_batched_tokens <= self.budget
        assert len(out.scheduled) <= self.max_num_seqs
        assert len(self.scheduler.running) <= self.max_num_seqs
        self.scheduler.update_from_output(out, self.runner.execute(out))
        self.kv_cache.pool.check_integrity()
        return out

    def run_to_end(self, max_steps: int = 200) -> list[SchedulerOutput]:
        outs = []
        while self.scheduler.has_unfinished():
            outs.append(self.step())
            assert len(outs) < max_steps, "the scheduler does not make progress"
        return outs

    def assert_pool_empty(self) -> None:
        pool = self.kv_cache.pool
        assert pool.num_free == pool.num_blocks
        assert all(pool.ref_cnt(i) == 0 for i in range(pool.num_blocks))
        pool.check_integrity()


def make(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 64,
         max_model_len: int = 256, long_prefill_chunk: int | None = None) -> Harness:
    kv_cache = KVCacheManager(num_blocks, BLOCK_SIZE)
    scheduler = ProcessingScheduler(kv_cache, max_num_seqs, budget, max_model_len,
                                    long_prefill_chunk, eos_token_ids=[EOS])
    return Harness(scheduler, FakeRunner(), budget, max_num_seqs)


def rows(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    """(request id, start position, number of tokens, samples) per scheduled row."""
    return [(s.request_id, s.start_position, len(s.token_ids), s.sample) for s in out.scheduled]


def prompt(start: int, num_tokens: int) -> list[int]:
    return list(range(start, start + num_tokens))


def test_token_budget_and_max_num_seqs_bound_every_step() -> None:
    h = make(budget=10, max_num_seqs=2)
    a = h.add("a", prompt(100, 6), max_tokens=3, next_token=11)
    b = h.add("b", prompt(200, 14), max_tokens=3, next_token=12)
    c = h.add("c", prompt(300, 6), max_tokens=1, next_token=13)

    out = h.step()  # a takes 6 of the 10 tokens; b's 14 do not end in the 4 left: it waits
    assert rows(out) == [("a", 0, 6, True)]
    assert out.scheduled[0].token_ids == prompt(100, 6)
    assert out.scheduled[0].block_table == [0, 1]
    assert [r.request_id for r in h.scheduler.waiting] == ["b", "c"]

    out = h.step()  # a's next token, then b has the 9 left; c waits for a seat
    assert rows(out) == [("a", 6, 1, True), ("b", 0, 9, False)]
    assert out.scheduled[1].token_ids == prompt(200, 9)
    assert out.scheduled[1].block_table == [2, 3, 4]
    assert [r.request_id for r in h.scheduler.waiting] == ["c"]

    out = h.step()  # budget left after these two is 4, but both seats are taken
    assert rows(out) == [("a", 7, 1, True), ("b", 9, 5, True)]
    assert a.status is RequestStatus.FINISHED_LENGTH and a.output_token_ids == [11, 11, 11]
    assert h.scheduler.num_waiting == 1

    out = h.step()  # a's seat is free: c is admitted beside b's decode
    assert rows(out) == [("b", 14, 1, True), ("c", 0, 6, True)]
    assert c.output_token_ids == [13]
    out = h.step()
    assert rows(out) == [("b", 15, 1, True)]
    assert b.output_token_ids == [12, 12, 12]
    assert not h.scheduler.has_unfinished()
    assert h.runner.num_tokens == 6 + 10 + 6 + 7 + 1
    h.assert_pool_empty()


def test_chunked_prefill_splits_a_long_prompt_beside_decode_rows() -> None:
    h = make(budget=8)
    long_prompt = prompt(500, 20)
    h.add("short", prompt(100, 4), max_tokens=6)
    long = h.add("long", long_prompt, max_tokens=2)

    outs = [h.step() for _ in range(5)]
    assert [rows(out) for out in outs] == [
        [("short", 0, 4, True)],  # the long one starts when it does not lengthen this step
        [("short", 4, 1, True), ("long", 0, 7, False)],
        [("short", 5, 1, True), ("long", 7, 7, False)],
        [("short", 6, 1, True), ("long", 14, 6, True)],
        [("short", 7, 1, True), ("long", 20, 1, True)],
    ]
    chunks = [s.token_ids for out in outs[:4] for s in out.scheduled if s.request_id == "long"]
    assert [t for chunk in chunks for t in chunk] == long_prompt
    assert long.status is RequestStatus.FINISHED_LENGTH
    # Full blocks are registered as chunks complete: the whole prompt is a hit now.
    assert h.kv_cache.find_cached_prefix(long_prompt).num_tokens == 20
    h.run_to_end()
    h.assert_pool_empty()


def test_chunk_boundaries_register_blocks_as_they_fill() -> None:
    h = make(budget=8)
    long_prompt = prompt(500, 20)
    h.add("long", long_prompt, max_tokens=1)
    h.step()
    assert h.kv_cache.find_cached_prefix(long_prompt).num_tokens == 8
    h.step()
    assert h.kv_cache.find_cached_prefix(long_prompt).num_tokens == 16
    h.run_to_end()
    h.assert_pool_empty()


def test_newest_request_is_preempted_then_recomputed_mostly_from_cache() -> None:
    h = make(num_blocks=6, budget=64)
    a = h.add("a", prompt(100, 8), max_tokens=8, next_token=11)
    b = h.add("b", prompt(200, 8), max_tokens=8, next_token=12)

    assert rows(h.step()) == [("a", 0, 8, True), ("b", 0, 8, True)]
    for position in (8, 9, 10, 11):  # both grow into their third block (ids 4 and 5)
        assert rows(h.step()) == [("a", position, 1, True), ("b", position, 1, True)]
    assert h.kv_cache.block_table("a") == [0, 1, 4] and h.kv_cache.block_table("b") == [2, 3, 5]
    assert h.kv_cache.num_free_blocks == 0

    out = h.step()  # a needs a fourth block: b, the newest, is preempted and a takes its last
    assert rows(out) == [("a", 12, 1, True)] and out.preempted_ids == ["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert not h.kv_cache.has_request("b") and list(h.scheduler.waiting) == [b]
    assert h.kv_cache.block_table("a") == [0, 1, 4, 5]
    assert h.kv_cache.pool.free_block_ids() == [3, 2]  # b's cached prompt blocks, LRU order
    assert h.scheduler.stats.num_preemptions == 1 and b.num_preemptions == 1
    assert b.output_token_ids == [12] * 5  # what it generated is kept

    # b cannot come back while a holds the pool (it needs 4 blocks, 2 are free).
    assert rows(h.step()) == [("a", 13, 1, True)]
    assert rows(h.step()) == [("a", 14, 1, True)]
    assert a.status is RequestStatus.FINISHED_LENGTH and a.output_token_ids == [11] * 8

    out = h.step()  # b is recomputed: its two prompt blocks hit, only the rest runs
    assert rows(out) == [("b", 8, 5, True)]
    assert out.scheduled[0].token_ids == [12] * 5
    assert out.scheduled[0].block_table[:2] == [2, 3]
    assert b.num_cached_tokens == 0  # reported once, at first admission
    h.run_to_end()
    assert b.status is RequestStatus.FINISHED_LENGTH and b.output_token_ids == [12] * 8
    h.assert_pool_empty()


def test_preemption_under_heavy_pressure_always_finishes() -> None:
    h = make(num_blocks=10, budget=16, max_num_seqs=4)
    requests = [h.add(f"r{i}", prompt(1000 * (i + 1), 5 + 3 * i), max_tokens=10, next_token=20 + i)
                for i in range(6)]
    outs = h.run_to_end()
    assert h.scheduler.stats.num_preemptions > 0
    assert any(out.preempted_ids for out in outs)
    for i, request in enumerate(requests):
        assert request.status is RequestStatus.FINISHED_LENGTH
        assert request.output_token_ids == [20 + i] * 10
    h.assert_pool_empty()


@pytest.mark.parametrize("num_tokens", [32, 40])
def test_prompt_of_max_model_len_or_more_is_refused_naming_both_numbers(num_tokens: int) -> None:
    h = make(max_model_len=32)
    with pytest.raises(ValueError, match=rf"{num_tokens} tokens.*is 32 tokens"):
        h.add("x", prompt(0, num_tokens))
    with pytest.raises(ValueError, match="empty"):
        h.add("y", [])
    assert not h.scheduler.has_unfinished() and h.scheduler.requests == {}


def test_request_that_can_never_fit_finishes_with_length_at_admission() -> None:
    h = make(num_blocks=4, budget=64)  # the pool holds 16 tokens
    request = h.add("big", prompt(0, 20))
    out = h.step()
    assert out.empty and out.failed_ids == ["big"]
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert not h.scheduler.has_unfinished()
    h.assert_pool_empty()


def test_request_that_outgrows_the_pool_mid_prefill_finishes_with_length() -> None:
    h = make(num_blocks=4, budget=8)
    request = h.add("big", prompt(0, 20))
    assert rows(h.step()) == [("big", 0, 8, False)]
    assert rows(h.step()) == [("big", 8, 8, False)]
    out = h.step()
    assert out.empty and out.failed_ids == ["big"]
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert not h.scheduler.has_unfinished()
    h.assert_pool_empty()


def test_request_waits_behind_runners_then_fails_when_alone() -> None:
    h = make(num_blocks=4, budget=64)
    small = h.add("small", prompt(0, 3), max_tokens=2)
    big = h.add("big", prompt(100, 20))
    assert rows(h.step()) == [("small", 0, 3, True)]  # big does not fit beside small: it waits
    assert big.status is RequestStatus.WAITING
    assert rows(h.step()) == [("small", 3, 1, True)]
    out = h.step()
    assert out.failed_ids == ["big"] and big.status is RequestStatus.FINISHED_LENGTH
    assert small.status is RequestStatus.FINISHED_LENGTH
    h.assert_pool_empty()


@pytest.mark.parametrize("pinned", [True, False])
def test_pin_survives_eviction_pressure_that_evicts_an_equally_old_prefix(pinned: bool) -> None:
    h = make(num_blocks=8, budget=64)
    prompt_a, prompt_b = prompt(100, 9), prompt(200, 9)
    h.add("a", prompt_a, max_tokens=1)
    h.add("b", prompt_b, max_tokens=1)
    assert rows(h.step()) == [("a", 0, 9, True), ("b", 0, 9, True)]  # both end in this step
    # Partial blocks 2 and 5 went to the head, the cached ones to the tail, a's before b's.
    assert h.kv_cache.pool.free_block_ids() == [5, 2, 6, 7, 1, 0, 4, 3]

    pin = h.kv_cache.find_cached_prefix(prompt_a).block_ids
    assert pin == [0, 1]
    if pinned:
        h.kv_cache.touch(pin)
        assert [h.kv_cache.pool.ref_cnt(i) for i in pin] == [1, 1]
        h.kv_cache.pool.check_integrity()

    h.add("pressure", prompt(900, 23), max_tokens=1)  # 6 blocks: evicts the 6 oldest free ones
    out = h.step()
    # It takes the free queue's six head blocks (the pinned blocks 0 and 1 are not in it), each
    # the one after the previous where that one is free and empty (6 after 5, 7 after 6).
    assert out.scheduled[0].block_table == ([5, 6, 7, 2, 4, 3] if pinned else [5, 6, 7, 2, 1, 0])
    lookup_a = h.kv_cache.find_cached_prefix(prompt_a)
    lookup_b = h.kv_cache.find_cached_prefix(prompt_b)
    if pinned:
        assert lookup_a.block_ids == [0, 1] and lookup_b.block_ids == []
        assert [h.kv_cache.pool.ref_cnt(i) for i in pin] == [1, 1]
        h.kv_cache.free_blocks(pin)  # unpin
    else:
        assert lookup_a.block_ids == [] and lookup_b.block_ids == [3, 4]

    # A later request with the pinned prompt hits it (or, unpinned, recomputes it).
    again = h.add("again", prompt_a + [42, 43], max_tokens=1)
    out = h.step()
    assert again.num_cached_tokens == (8 if pinned else 0)
    assert rows(out) == [("again", 8 if pinned else 0, 3 if pinned else 11, True)]
    h.run_to_end()
    h.assert_pool_empty()


def test_eos_and_stop_token_ids_finish_with_stop() -> None:
    h = make()
    eos = h.add("eos", prompt(100, 5), next_token=EOS)
    ignored = h.add("ignored", prompt(200, 5), max_tokens=3, next_token=EOS, ignore_eos=True)
    stopped = h.add("stopped", prompt(300, 5), next_token=99, stop_token_ids=[99])
    h.run_to_end()
    assert eos.status is RequestStatus.FINISHED_STOPPED and eos.output_token_ids == [EOS]
    assert ignored.status is RequestStatus.FINISHED_LENGTH
    assert ignored.output_token_ids == [EOS] * 3
    assert stopped.status is RequestStatus.FINISHED_STOPPED and stopped.stop_reason == 99
    h.assert_pool_empty()


def test_finish_request_from_outside_frees_blocks_and_ignores_its_step_result() -> None:
    h = make()
    a = h.add("a", prompt(100, 10), max_tokens=4)
    b = h.add("b", prompt(200, 10), max_tokens=4)
    out = h.scheduler.schedule()
    assert h.scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED) is a
    assert not h.kv_cache.has_request("a")
    h.scheduler.update_from_output(out, h.runner.execute(out))  # a's row is dropped
    assert a.output_token_ids == [] and a.status is RequestStatus.FINISHED_ABORTED
    assert b.output_token_ids == [7]
    assert h.scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED) is None
    h.run_to_end()
    h.assert_pool_empty()


@pytest.fixture
def wait_for_two_blocks(monkeypatch) -> None:
    """Tests' prompts are short: wait for a running prefill from 2 blocks (8 tokens) up."""
    from agentd.engine import scheduler

    monkeypatch.setattr(scheduler, "WAIT_FOR_TOKENS", 2 * BLOCK_SIZE)


def test_agents_starting_together_wait_for_the_first_prefill_instead_of_repeating_it(
        wait_for_two_blocks) -> None:
    h = make(budget=64)
    shared = prompt(1000, 40)  # 10 blocks that nobody has computed yet
    a = h.add("a", shared + [1, 2, 3], max_tokens=2)
    b = h.add("b", shared + [4, 5], max_tokens=2)
    h.add("c", prompt(3000, 6), max_tokens=2)

    out = h.step()  # b would compute a's 40 tokens again: it waits; c, behind it, goes ahead
    assert rows(out) == [("a", 0, 43, True), ("c", 0, 6, True)]
    assert [r.request_id for r in h.scheduler.waiting] == ["b"]
    out = h.step()  # a's blocks are cached now: b computes only its own 2 tokens
    assert rows(out) == [("a", 43, 1, True), ("c", 6, 1, True), ("b", 40, 2, True)]
    assert b.num_cached_tokens == 40
    h.run_to_end()
    assert a.output_token_ids == [7, 7] and b.output_token_ids == [7, 7]
    assert h.runner.num_tokens == 43 + 6 + (1 + 1 + 2) + 1
    h.assert_pool_empty()


def test_a_short_overlap_with_a_running_prefill_is_computed_again_at_once(
        wait_for_two_blocks) -> None:
    """One shared block in flight is cheaper to recompute than a step's wait."""
    h = make(budget=64)
    h.add("a", prompt(1000, 4) + [1, 2, 3, 4, 5], max_tokens=1)
    h.add("b", prompt(1000, 4) + [6, 7, 8, 9, 10], max_tokens=1)
    out = h.step()
    assert rows(out) == [("a", 0, 9, True), ("b", 0, 9, True)]
    h.run_to_end()
    h.assert_pool_empty()


def test_a_waiting_request_goes_ahead_when_the_prefill_it_waits_for_is_aborted(
        wait_for_two_blocks) -> None:
    h = make(budget=16)
    shared = prompt(1000, 40)
    h.add("a", shared + [1], max_tokens=1)
    b = h.add("b", shared + [2], max_tokens=1)
    out = h.step()  # a's first chunk: 4 of its 10 shared blocks
    assert rows(out) == [("a", 0, 16, False)]
    h.scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    out = h.step()  # what a computed is cached; the rest nobody is computing
    assert rows(out) == [("b", 16, 16, False)]
    assert b.num_cached_tokens == 16
    h.run_to_end()
    h.assert_pool_empty()


def test_a_waiting_request_is_hashed_once_not_every_step_it_waits(monkeypatch) -> None:
    """vLLM's ``request.block_hashes``: a prompt looked up step after step while it waits for
    room is hashed once; decoding extends the chain, and no block is ever hashed twice."""
    from collections import Counter

    from agentd.cache import kv_cache_manager

    hashed: Counter[tuple[int, int]] = Counter()  # (block index, its first token) -> times
    real_hash_blocks = kv_cache_manager.hash_blocks

    def counting(token_ids, block_size, *args, start_block=0, **kwargs):
        for index in range(start_block, len(token_ids) // block_size):
            hashed[index, token_ids[index * block_size]] += 1
        return real_hash_blocks(token_ids, block_size, *args, start_block=start_block, **kwargs)

    monkeypatch.setattr(kv_cache_manager, "hash_blocks", counting)
    h = make(num_blocks=8, budget=64)
    long = h.add("long", prompt(0, 20), max_tokens=8)  # 5 blocks, then 7 with its output
    waiter = h.add("waiter", prompt(500, 16), max_tokens=2)  # 4 blocks + 1: no room beside it
    steps_waited = 0
    while waiter.status is RequestStatus.WAITING:
        h.step()
        steps_waited += 1
    assert steps_waited >= 5 and long.status.finished
    h.run_to_end()
    assert hashed[0, 500] == 1 and max(hashed.values()) == 1, hashed
    assert set(hashed) >= {(i, 500 + 4 * i) for i in range(4)}
    h.assert_pool_empty()


def test_a_short_request_is_not_held_behind_a_long_prefill() -> None:
    """A step's prompt chunks share one budget (``long_prefill_chunk``, else the token budget),
    shortest remaining prompt first: a short request that arrives while a long prompt prefills
    (a title request behind a coding agent's first prompt) runs whole and alone in the next
    step (a chunk of the long one beside it would only delay its first token), and the long one
    goes on in the step after, beside the short one's decode."""
    for chunk in (16, None):
        h = make(num_blocks=128, budget=64, max_model_len=512, long_prefill_chunk=chunk)
        h.add("long", list(range(10, 330)), max_tokens=2)  # 320 prompt tokens
        first = h.step()
        size = chunk or 64
        assert rows(first) == [("long", 0, size, False)]
        h.add("short", list(range(400, 412)), max_tokens=2)  # 12 tokens
        out = h.step()  # the short one alone: the long one's next chunk would not end it
        assert rows(out) == [("short", 0, 12, True)]
        out = h.step()  # the short one decodes first; the long one has the rest of the budget
        assert rows(out) == [("long", size, min(size, 63), False), ("short", 12, 1, True)]
        h.run_to_end()
        h.assert_pool_empty()


def test_running_prefills_share_the_budget_shortest_remaining_first() -> None:
    h = make(num_blocks=128, budget=64, max_model_len=512, long_prefill_chunk=16)
    h.add("a", prompt(1000, 100), max_tokens=1)
    h.add("b", prompt(2000, 30), max_tokens=1)
    out = h.step()  # b has less to go: it runs first, a gets nothing of the 16
    assert rows(out) == [("b", 0, 16, False)]
    out = h.step()  # b runs its last 14 and samples; a's 100 do not end in the 2 left
    assert rows(out) == [("b", 16, 14, True)]
    out = h.step()
    assert rows(out) == [("a", 0, 16, False)]
    h.run_to_end()
    h.assert_pool_empty()


def test_deep_prompt_rows_count_their_attention_against_the_budget() -> None:
    """With ``attention_context`` C, a row at position p costs 1 + p / C of the budget: chunks
    shrink as the prompt deepens, so a step deep in a long prompt lasts about as long as one at
    its start; however deep, a step runs at least one row."""
    kv_cache = KVCacheManager(256, BLOCK_SIZE)
    scheduler = ProcessingScheduler(kv_cache, 8, 512, 1024, 32, attention_context=64,
                                    eos_token_ids=[EOS])
    h = Harness(scheduler, FakeRunner(), 512, 8)
    h.add("long", prompt(1000, 1000), max_tokens=1)
    sizes = []
    while h.scheduler.running or h.scheduler.waiting:
        out = h.step()
        (item,) = out.scheduled
        sizes.append((item.start_position, len(item.token_ids)))
        if item.sample:
            break
    for start, size in sizes:  # the largest chunk within the budget of 32
        if start + size < 1000:
            assert size == max(int(32 / (1 + start / 64)), 1), (start, size)
    assert sizes[0] == (0, 32) and sizes[1] == (32, 21) and sum(n for _, n in sizes) == 1000
    h.run_to_end()
    h.assert_pool_empty()


def test_shortest_first_under_pool_pressure_always_progresses() -> None:
    """A decoding request grows while a long prompt prefills and a short one arrives, in a pool
    that cannot hold all three: shares go to requests that then cannot start, requests are
    preempted and come back. A request handed the budget that could not start gets no share
    the next step (``_stalled``), so the others run: no step is empty but the one where that
    is found, and all three finish."""
    h = make(num_blocks=38, budget=64, max_model_len=260, long_prefill_chunk=16)
    hog = h.add("hog", prompt(5000, 8), max_tokens=30)
    long = h.add("long", prompt(1000, 150), max_tokens=1)
    for _ in range(7):
        h.step()
    short = h.add("short", prompt(2000, 40), max_tokens=1)
    outs = []
    while h.scheduler.has_unfinished() and len(outs) < 60:
        outs.append(h.step())
    assert not h.scheduler.has_unfinished(), [rows(out) for out in outs]
    empty = [i for i, out in enumerate(outs) if not out.scheduled]
    assert all(outs[i + 1].scheduled for i in empty)  # never two empty steps in a row
    assert len(empty) <= 3
    assert h.scheduler.stats.num_preemptions >= 1  # the pool really could not hold them
    assert len(hog.output_token_ids) == 30 and len(long.output_token_ids) == 1
    assert len(short.output_token_ids) == 1
    h.assert_pool_empty()


def test_prefill_chunks_are_the_steps_a_prompt_alone_runs_in() -> None:
    kv_cache = KVCacheManager(256, BLOCK_SIZE)
    scheduler = ProcessingScheduler(kv_cache, 8, 512, 1024, 32, attention_context=64,
                                    eos_token_ids=[EOS])
    h = Harness(scheduler, FakeRunner(), 512, 8)
    h.add("long", prompt(1000, 700), max_tokens=1)
    steps = 0
    while h.scheduler.has_unfinished():
        h.step()
        steps += 1
    chunks = scheduler.prefill_chunks(0, 700)
    assert steps == len(chunks) > 700 // 32
    assert chunks[:2] == [(0, 32), (32, 21)] and sum(n for _, n in chunks) == 700
    assert scheduler.prefill_chunks(0, 32) == [(0, 32)]
    assert scheduler.prefill_chunks(0, 33) == [(0, 32), (32, 1)]


@pytest.mark.parametrize(("num_blocks", "budget", "chunk", "attention_context"), [
    (48, 64, None, None), (48, 64, 16, 64), (30, 32, 16, 100), (20, 64, None, 50)])
def test_random_arrivals_in_a_small_pool_always_finish(num_blocks, budget, chunk,
                                                       attention_context) -> None:
    """Fifteen requests of random lengths (some sharing a prefix) arrive over the first 60
    steps into a pool that holds a few of them. Shortest first alone livelocked here: shorter
    newcomers took the budget, could not grow, preempted themselves, while the older prefills
    that held the pool never ran (and a failed admission stopped the ones behind it, which held
    the step's share). Every run must end, with no run of empty steps."""
    for seed in range(60):
        rng = random.Random(seed)
        kv_cache = KVCacheManager(num_blocks, BLOCK_SIZE)
        scheduler = ProcessingScheduler(kv_cache, 8, budget, 200, chunk,
                                        attention_context=attention_context, eos_token_ids=[EOS])
        h = Harness(scheduler, FakeRunner(), budget, 8)
        arrivals = sorted((rng.randrange(60), i, rng.randrange(2, 120), rng.randrange(1, 20))
                          for i in range(15))
        shared = prompt(7000, 60)
        step = empty = 0
        while arrivals or h.scheduler.has_unfinished():
            while arrivals and arrivals[0][0] <= step:
                _, i, length, max_tokens = arrivals.pop(0)
                tokens = shared[:rng.randrange(60)] + prompt(10000 + 1000 * i, length)
                h.add(f"r{i}", tokens[:190], max_tokens=max_tokens)
            out = h.step()
            step += 1
            empty = empty + 1 if not out.scheduled and h.scheduler.has_unfinished() else 0
            assert empty <= 2 and step < 3000, (seed, step)
        h.assert_pool_empty()
