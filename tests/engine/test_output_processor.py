"""Finishing is decided in one function: ``finish_for`` turns what a step's tokens did into the
request's finish reason. Each reason is asserted here from that function alone, then once through
the output processor that feeds it."""

from __future__ import annotations

import pytest

from agentd.engine.output_processor import (
    GRAMMAR_DEAD_END,
    Finish,
    OutputFacts,
    OutputProcessor,
    finish_for,
)
from agentd.engine.request import Request, RequestStatus
from agentd.engine.sampling_params import SamplingParams

STOP = RequestStatus.FINISHED_STOPPED
LENGTH = RequestStatus.FINISHED_LENGTH
ABORT = RequestStatus.FINISHED_ABORTED


def test_nothing_that_ends_a_request_leaves_it_running() -> None:
    assert finish_for(OutputFacts()) is None


def test_an_end_of_sequence_token_stops_without_a_reason() -> None:
    assert finish_for(OutputFacts(eos=True)) == Finish(STOP)


def test_a_stop_token_stops_and_is_the_reason() -> None:
    assert finish_for(OutputFacts(stop_token=99)) == Finish(STOP, stop_reason=99)


def test_a_stop_string_stops_and_is_the_reason() -> None:
    assert finish_for(OutputFacts(stop_string="</ans>")) == Finish(STOP, stop_reason="</ans>")


def test_the_length_limit_finishes_with_length() -> None:
    assert finish_for(OutputFacts(length=True)) == Finish(LENGTH)


def test_a_complete_constraint_stops() -> None:
    assert finish_for(OutputFacts(grammar_ended=True)) == Finish(STOP)


def test_a_grammar_dead_end_aborts_with_its_error() -> None:
    finish = finish_for(OutputFacts(grammar_rejected=True, eos=True, length=True))
    assert finish == Finish(ABORT, error=GRAMMAR_DEAD_END, error_code="grammar_dead_end")


@pytest.mark.parametrize("other", [{"eos": True}, {"stop_token": 7}, {"length": True},
                                   {"grammar_ended": True}])
def test_a_stop_string_before_the_token_that_ended_the_request_wins(other: dict) -> None:
    # the tokens after the string were dropped, the one that ended the request among them
    facts = OutputFacts(stop_string="END", tokens_after_stop_string=True, **other)
    assert finish_for(facts) == Finish(STOP, stop_reason="END")


@pytest.mark.parametrize(("facts", "expected"), [
    (OutputFacts(eos=True, stop_token=2, length=True), Finish(STOP)),
    (OutputFacts(stop_token=9, length=True, stop_string="x"), Finish(STOP, stop_reason=9)),
    (OutputFacts(length=True, grammar_ended=True, stop_string="x"), Finish(LENGTH)),
    (OutputFacts(grammar_ended=True, stop_string="x"), Finish(STOP)),
])
def test_on_one_token_the_order_is_eos_stop_token_length_constraint_stop_string(
        facts: OutputFacts, expected: Finish) -> None:
    assert finish_for(facts) == expected


def make(max_tokens: int = 8, **params) -> tuple[OutputProcessor, Request]:
    processor = OutputProcessor(eos_token_ids=[2], max_model_len=64)
    request = Request("r", [10, 11, 12], SamplingParams(max_tokens=max_tokens, **params),
                      max_output_tokens=max_tokens)
    processor.add(request)
    return processor, request


@pytest.mark.parametrize(("sampled", "params", "status", "reason", "output"), [
    ([5, 2, 6], {}, STOP, None, [5, 2]),  # eos among accepted drafts: the rest is dropped
    ([5, 2], {"ignore_eos": True}, None, None, [5, 2]),
    ([5, 9, 6], {"stop_token_ids": [9]}, STOP, 9, [5, 9]),
    ([5, 6, 7], {"max_tokens": 2}, LENGTH, None, [5, 6]),
])
def test_the_processor_ends_a_request_at_the_token_that_finishes_it(
        sampled: list[int], params: dict, status: RequestStatus | None, reason: int | None,
        output: list[int]) -> None:
    processor, request = make(**params)
    processor.process([request], {"r": sampled})
    assert request.output_token_ids == output
    assert (request.status if request.status.finished else None) is status
    assert request.stop_reason == reason
    delta = processor.delta("r", finished=request.status.finished)
    assert delta.token_ids == output and delta.finish_reason == (status.value if status else None)
