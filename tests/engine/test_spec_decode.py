"""Prompt-lookup speculative decoding, piece by piece: the n-gram lookup, the acceptance rule on
hand-made logits, and the scheduler's rollback of rejected drafts (real KVCacheManager, plain
Python, exact block ids). The engine-level checks against transformers are in
tests/engine/test_spec_engine.py.
"""

from __future__ import annotations

import pytest
import torch

from agentd.cache import KVCacheManager
from agentd.cache.hashing import hash_blocks
from agentd.config import SpeculativeConfig
from agentd.engine.output_processor import OutputProcessor
from agentd.engine.request import Request
from agentd.engine.sampler import Sampler
from agentd.engine.sampling_params import SamplingParams
from agentd.engine.scheduler import Scheduler, SchedulerOutput
from agentd.engine.spec_decode import NgramSpeculator, propose_ngram, verify

BLOCK_SIZE = 4
VOCAB = 50


# --- the n-gram lookup -----------------------------------------------------------------------

def test_lookup_takes_the_longest_suffix_match_then_the_most_recent() -> None:
    #            0  1  2  3  4  5  6  7  8  9 10 11 12 13
    tokens = [1, 2, 3, 9, 9, 5, 2, 3, 7, 8, 4, 1, 2, 3]
    # (1, 2, 3) occurs at 0..2 only: the draft is what followed it, even though (2, 3) occurs
    # later (at 6..7, followed by 7, 8).
    assert propose_ngram(tokens, 3, ngram_max=3, ngram_min=1) == [9, 9, 5]
    assert propose_ngram(tokens, 3, ngram_max=2, ngram_min=1) == [7, 8, 4]
    assert propose_ngram(tokens, 10, ngram_max=2, ngram_min=2) == [7, 8, 4, 1, 2, 3]
    assert propose_ngram(tokens, 2, ngram_max=4, ngram_min=4) == []  # no 4-gram repeats


def test_lookup_never_matches_the_suffix_itself_nor_across_token_boundaries() -> None:
    assert propose_ngram([5, 6, 7], 4, ngram_max=2, ngram_min=1) == []
    # 256 and 1 are b"\x00\x01\x00\x00" and b"\x01\x00\x00\x00": the bytes of (1, 256) ...
    # contain those of a 1 that starts mid-token; only the aligned occurrence counts.
    tokens = [256, 1, 256, 3, 1]
    assert propose_ngram(tokens, 2, ngram_max=1, ngram_min=1) == [256, 3]
    assert propose_ngram([7, 7, 7, 7], 3, ngram_max=2, ngram_min=2) == [7]


# --- the acceptance rule ---------------------------------------------------------------------

def make_request(request_id: str = "r", **params) -> Request:
    return Request(request_id, [1, 2, 3], SamplingParams(**params), max_output_tokens=100)


def peaked_logits(targets: list[int]) -> torch.Tensor:
    logits = torch.randn(len(targets), VOCAB, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(targets)), targets] += 20
    return logits


@pytest.mark.parametrize(("draft", "expected"), [
    ([4, 5, 6], [4, 5, 6, 7]),  # all accepted, plus the token after the last draft
    ([4, 5, 9], [4, 5, 6]),  # the third is wrong: the model's own token replaces it
    ([9, 5, 6], [4]),  # the first is wrong: one token, as without a draft
])
def test_greedy_keeps_the_drafts_the_argmax_agrees_with(draft, expected) -> None:
    logits = peaked_logits([4, 5, 6, 7])
    sampler = Sampler(torch.device("cpu"))
    assert verify(sampler, logits, make_request(temperature=0.0), draft) == expected


def test_a_sampled_request_draws_each_token_as_without_drafts() -> None:
    """Same seed, same logits: verifying a draft gives the tokens plain one-by-one sampling
    gives, as far as the draft agrees, and spends the generator the same way."""
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1))
    plain_sampler = Sampler(torch.device("cpu"))
    plain_request = make_request(temperature=0.7, seed=123)
    plain = [plain_sampler.sample(logits[i:i + 1], [plain_request])[0] for i in range(6)]
    for num_agreeing in range(6):
        draft = plain[:num_agreeing] + [(plain[num_agreeing] + 1) % VOCAB]
        draft = draft[:5]
        sampler = Sampler(torch.device("cpu"))
        request = make_request(temperature=0.7, seed=123)
        tokens = verify(sampler, logits[:len(draft) + 1], request, draft)
        assert tokens == plain[:len(tokens)]
        assert len(tokens) == min(num_agreeing, 5) + 1
        # the generator is where plain sampling's would be after as many tokens
        rest = [sampler.sample(logits[i:i + 1], [request])[0] for i in range(len(tokens), 6)]
        assert tokens + rest == plain


# --- the scheduler: drafts run once, rejected KV is rolled back -------------------------------

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


def make_scheduler(num_blocks: int = 16, budget: int = 64) -> Scheduler:
    return ProcessingScheduler(KVCacheManager(num_blocks, BLOCK_SIZE), max_num_seqs=4,
                               max_num_batched_tokens=budget, max_model_len=256,
                               eos_token_ids=[2])


def add(scheduler: Scheduler, request_id: str, prompt: list[int], max_tokens: int = 32) -> Request:
    request = Request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                      max_output_tokens=max_tokens)
    scheduler.add_request(request)
    return request


def step(scheduler: Scheduler, sampled: dict[str, list[int]]) -> SchedulerOutput:
    out = scheduler.schedule()
    scheduler.update_from_output(out, sampled)
    scheduler.kv_cache.pool.check_integrity()
    return out


def held_blocks(scheduler: Scheduler, request: Request) -> list[int]:
    return scheduler.kv_cache.block_table(request.request_id)


def test_rejected_drafts_are_rolled_back_and_never_hashed() -> None:
    scheduler = make_scheduler()
    pool = scheduler.kv_cache.pool
    request = add(scheduler, "a", list(range(10, 16)))  # 6 tokens: blocks 0 (full) and 1
    step(scheduler, {"a": [30]})
    assert request.num_computed_tokens == 6 and held_blocks(scheduler, request) == [0, 1]

    request.spec_token_ids = [31, 32, 33, 34, 35]  # 7 + 5 = 12 tokens: blocks 1, 2 and 3
    out = scheduler.schedule()
    (item,) = out.scheduled
    assert item.token_ids == [30, 31, 32, 33, 34, 35] and item.num_draft_tokens == 5
    assert item.start_position == 6 and item.block_table == [0, 1, 2]
    assert request.num_computed_tokens == 6
    # The model agrees with 31 only, and says 40 where the draft said 32.
    scheduler.update_from_output(out, {"a": [31, 40]})
    assert request.output_token_ids == [30, 31, 40]
    assert request.num_computed_tokens == 8  # 30 and 31 have KV; 40 is computed next step
    # Block 2 held only rejected tokens' KV: it is free again (and reused first); block 1 holds
    # 14, 15, 30, 31 (all accepted) and is hashed; nothing past it is.
    assert held_blocks(scheduler, request) == [0, 1]
    assert pool.ref_cnt(2) == 0 and pool.block_hash(2) is None
    assert pool.block_hash(1) == hash_blocks(request.all_token_ids[:8], BLOCK_SIZE,
                                             scheduler.kv_cache.extra_key)[1]
    pool.check_integrity()

    out = step(scheduler, {"a": [41]})  # no drafts now: a plain decode of 40
    assert [(s.start_position, s.token_ids) for s in out.scheduled] == [(8, [40])]
    assert held_blocks(scheduler, request) == [0, 1, 2]


def test_all_drafts_accepted_advance_as_many_steps_at_once() -> None:
    scheduler = make_scheduler()
    request = add(scheduler, "a", list(range(10, 15)))
    step(scheduler, {"a": [30]})
    request.spec_token_ids = [31, 32, 33]
    step(scheduler, {"a": [31, 32, 33, 34]})
    assert request.output_token_ids == [30, 31, 32, 33, 34]
    assert request.num_computed_tokens == 9 and len(held_blocks(scheduler, request)) == 3
    assert request.spec_token_ids == []  # a draft runs once


def test_a_stop_inside_the_accepted_tokens_ends_the_request_there() -> None:
    scheduler = make_scheduler()
    pool = scheduler.kv_cache.pool
    request = add(scheduler, "a", list(range(10, 15)), max_tokens=3)
    step(scheduler, {"a": [30]})
    request.spec_token_ids = [2, 31]  # token 2 is EOS
    step(scheduler, {"a": [2, 31, 32]})
    assert request.output_token_ids == [30, 2] and request.status.value == "stop"
    assert pool.num_free == pool.num_blocks

    request = add(scheduler, "b", list(range(50, 55)), max_tokens=3)
    step(scheduler, {"b": [30]})
    request.spec_token_ids = [31]
    step(scheduler, {"b": [31, 32]})  # max_tokens=3 is reached by the bonus token
    assert request.output_token_ids == [30, 31, 32] and request.status.value == "length"


def test_drafts_use_only_the_budget_left_after_every_running_request_decodes() -> None:
    scheduler = make_scheduler(num_blocks=8, budget=5)
    a = add(scheduler, "a", [10, 11])
    b = add(scheduler, "b", [20, 21])
    step(scheduler, {"a": [30], "b": [40]})
    a.spec_token_ids = [31, 32, 33, 34, 35, 36]
    b.spec_token_ids = [41]
    out = scheduler.schedule()
    # a's decode + 3 drafts, then b's decode: the budget of 5 leaves no room for b's draft.
    assert [(s.request_id, len(s.token_ids), s.num_draft_tokens) for s in out.scheduled] == [
        ("a", 4, 3), ("b", 1, 0)]
    assert held_blocks(scheduler, a) == [0, 2]
    scheduler.update_from_output(out, {"a": [41], "b": [42]})
    assert held_blocks(scheduler, a) == [0] and scheduler.kv_cache.num_free_blocks == 6
    assert a.spec_token_ids == b.spec_token_ids == []


def test_drafts_never_take_a_block_that_a_running_request_needs() -> None:
    scheduler = make_scheduler(num_blocks=3)
    a = add(scheduler, "a", [10, 11])
    b = add(scheduler, "b", [20, 21, 22, 23])  # its next token starts a new block
    step(scheduler, {"a": [30], "b": [40]})
    assert scheduler.kv_cache.num_free_blocks == 1
    a.spec_token_ids = [31, 32, 33, 34]  # would need that last free block
    out = step(scheduler, {"a": [31], "b": [41]})
    assert [s.num_draft_tokens for s in out.scheduled] == [0, 0] and not out.preempted_ids
    assert held_blocks(scheduler, b) == [1, 2]


def test_drafts_stop_while_the_batch_is_compute_bound_or_drafts_keep_failing() -> None:
    config = SpeculativeConfig(num_tokens=3, ngram_max=2, ngram_min=1, max_num_seqs=2)
    speculator = NgramSpeculator(config)
    requests = [make_request(f"r{i}", temperature=0.0) for i in range(3)]
    for request in requests:
        request.all_token_ids += [1, 2]  # ... 1 2 3 1 2: the draft is [3, 1, 2]
        request.num_computed_tokens = request.num_tokens - 1
    speculator.propose(requests, num_waiting=0)  # three running, at most two may draft
    assert [r.spec_token_ids for r in requests] == [[], [], []]
    speculator.propose(requests[:2], num_waiting=1)
    assert [r.spec_token_ids for r in requests] == [[], [], []]
    speculator.propose(requests[:2], num_waiting=0)
    assert [r.spec_token_ids for r in requests[:2]] == [[3, 1, 2], [3, 1, 2]]

    # r0's drafts are rejected outright each time: it sits out 1, 2, 4 steps before drafting
    # again; r1's first draft token is accepted, so it drafts every step.
    sampler = Sampler(torch.device("cpu"))
    drafted_steps: list[int] = []
    for step_index in range(12):
        drafts = {r.request_id: r.spec_token_ids for r in requests[:2] if r.spec_token_ids}
        if "r0" in drafts:
            drafted_steps.append(step_index)
        logits = torch.cat([peaked_logits([9] * (len(drafts.get(r.request_id, [])) + 1))
                            if r.request_id == "r0" else
                            peaked_logits([3, 7] + [0] * (len(drafts.get(r.request_id, [])) - 1))
                            for r in requests[:2]])
        for r in requests[:2]:
            r.spec_token_ids = []
        tokens = speculator.sample(sampler, logits, requests[:2], drafts)
        assert tokens["r1"] == [3, 7]
        speculator.propose(requests[:2], num_waiting=0)
    assert drafted_steps == [0, 2, 5, 10]
    assert speculator.stats.num_drafts == 4 + 12
    assert speculator.stats.num_accepted_tokens == 12
    assert requests[1].spec_token_ids == [3, 1]  # one accepted: the next draft is 1 + 1 long


def test_a_draft_accepted_whole_doubles_the_next_one_up_to_the_limit() -> None:
    speculator = NgramSpeculator(SpeculativeConfig(num_tokens=6, ngram_max=1, ngram_min=1))
    request = make_request(temperature=0.0)
    request.all_token_ids = list(range(10, 30)) + [10]  # the draft continues 11, 12, 13 ...
    request.num_computed_tokens = request.num_tokens - 1
    sampler = Sampler(torch.device("cpu"))
    lengths = []
    for _ in range(4):
        speculator.propose([request], num_waiting=0)
        draft = request.spec_token_ids
        lengths.append(len(draft))
        request.spec_token_ids = []
        tokens = speculator.sample(sampler, peaked_logits(draft + [draft[-1] + 1]), [request],
                                   {"r": draft})
        assert tokens["r"] == draft + [draft[-1] + 1]
        request.all_token_ids = list(range(10, 30)) + [10]  # the same point again
    assert lengths == [6, 6, 6, 6]
    speculator.sample(sampler, peaked_logits([11, 40, 0, 0, 0, 0, 0]), [request],
                      {"r": [11, 12, 13, 14, 15, 16]})  # two of six accepted ... once
    speculator.propose([request], num_waiting=0)
    assert request.spec_token_ids == [11, 12]
    request.spec_token_ids = []
    speculator.sample(sampler, peaked_logits([11, 12, 0]), [request], {"r": [11, 12]})
    speculator.propose([request], num_waiting=0)
    assert request.spec_token_ids == [11, 12, 13, 14]  # accepted whole: twice as long
