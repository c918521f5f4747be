"""Constrained outputs always end: a tiny random Llama (the real SmolLM2 tokenizer) at temperature
1, 20 seeds per schema batched through one engine (50 in ``-m full``), with ``max_tokens`` a few
tokens past what the closing estimate says the shortest output needs. Every output must parse
and validate with the ``jsonschema`` library, formats checked where it can check them; without
closing, the same setup runs out of tokens."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from agentd.engine.request import EngineRequest
from agentd.engine.sampling_params import SamplingParams
from agentd.llm import LLM
from agentd.structured.params import FunctionSpec, StructuredOutputsParams, ToolCallsSpec

NUM_SEEDS = 50  # the batch the engine is sized for; -m full samples this many per schema
NUM_CI_SEEDS = 20  # CI: ~80 s of its time at 50
FEW = 8  # tokens past the estimate: the request is held from its first token
LOOSE = 32  # ... or it writes freely first (opening items and keys) and is held later
NUM_LOOSE_SEEDS = 10
FORMATS = ("date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid",
           "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer")
CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER


def one_field(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"v": schema}, "required": ["v"],
            "additionalProperties": False}


SCHEMAS: dict[str, dict[str, Any]] = {
    **{f"format {f}": one_field({"type": "string", "format": f}) for f in FORMATS},
    "pattern": one_field({"type": "string", "pattern": "^[a-z]+(-[a-z0-9]+)*\\.[a-z]{2,}$"}),
    "nested objects": {"type": "object", "required": ["a"], "properties": {"a": {
        "type": "object", "required": ["b", "n"], "properties": {
            "b": {"type": "object", "required": ["c"], "properties": {"c": {"type": "string"}}},
            "n": {"type": "number"}}}}},
    "arrays": {"type": "object", "required": ["rows"], "properties": {"rows": {
        "type": "array", "minItems": 1, "items": {
            "type": "array", "items": {"type": "object", "required": ["k"], "properties": {
                "k": {"type": "string"}, "w": {"type": "integer"}}}}}}},
    "open object": {"type": "object", "additionalProperties": {"type": "string"}},
    "any json": {"type": "object"},
}


def run(llm: LLM, prompt: list[int], params: list[SamplingParams]) -> list[tuple[str, str]]:
    """Step the engine over one request per params; each one's (text, finish reason)."""
    engine = llm.engine
    ids = [engine.add_request(EngineRequest(prompt, p)) for p in params]
    texts: dict[str, list[str]] = {rid: [] for rid in ids}
    reasons: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            texts[delta.request_id].append(delta.text)
            if delta.finish_reason is not None:
                reasons[delta.request_id] = delta.finish_reason
    return [("".join(texts[rid]), reasons[rid]) for rid in ids]


def estimate(llm: LLM, params: StructuredOutputsParams) -> int:
    """What the closing search says the shortest output takes, stop token included."""
    structured = llm.engine.structured
    structured.add("estimate", llm.engine.grammars.compile(params))
    try:
        cost = structured.cost_to_close("estimate")
    finally:
        structured.remove("estimate")
    assert cost is not None
    return cost


def sampled(params: StructuredOutputsParams, max_tokens: int,
            num_seeds: int = NUM_SEEDS) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                           structured_outputs=params) for seed in range(num_seeds)]


@pytest.fixture(scope="module")
def llm(tiny_model_factory) -> LLM:
    return LLM(str(tiny_model_factory("llama")), device="cpu", kv_cache_memory_bytes=64 * 2**20,
               max_num_seqs=NUM_SEEDS)


@pytest.fixture(scope="module")
def prompt(llm: LLM) -> list[int]:
    return llm.tokenizer("Fill in the form:").input_ids


@pytest.mark.parametrize(("extra", "num_seeds"), [
    (FEW, NUM_CI_SEEDS), (LOOSE, NUM_LOOSE_SEEDS),
    pytest.param(FEW, NUM_SEEDS, marks=pytest.mark.full)])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_outputs_end_parse_and_validate(llm: LLM, prompt: list[int], name: str,
                                        extra: int, num_seeds: int) -> None:
    schema = SCHEMAS[name]
    params = StructuredOutputsParams(json=schema)
    max_tokens = estimate(llm, params) + extra
    for text, reason in run(llm, prompt, sampled(params, max_tokens, num_seeds)):
        assert reason == "stop", (name, text)
        jsonschema.validate(json.loads(text), schema, format_checker=CHECKER)


def test_named_call_with_date_times_ends(llm: LLM, prompt: list[int]) -> None:
    """The issue's call: a tool whose arguments hold date-times, called by name."""
    from agentd.tool_parser import parse_tool_calls

    schema = {"type": "object", "required": ["query", "time_range"], "properties": {
        "query": {"type": "string"}, "step": {"type": "string"},
        "time_range": {"type": "object", "required": ["start", "end"], "properties": {
            "start": {"type": "string", "format": "date-time"},
            "end": {"type": "string", "format": "date-time"}}}}}
    params = StructuredOutputsParams(tool_calls=ToolCallsSpec(
        (FunctionSpec.build("query_prometheus", schema),), "required", parallel=False))
    max_tokens = estimate(llm, params) + FEW
    for text, reason in run(llm, prompt, sampled(params, max_tokens, NUM_LOOSE_SEEDS)):
        assert reason == "stop", text
        (call,) = parse_tool_calls(text).tool_calls
        jsonschema.validate(json.loads(call.arguments_json), schema, format_checker=CHECKER)


def test_without_closing_the_same_requests_run_out(llm: LLM, prompt: list[int],
                                                   monkeypatch) -> None:
    """The control: never held, the same requests end with "length" and output that does not
    parse (a string, a URL or a fraction written until the budget is gone)."""
    from agentd.structured.matchers import StructuredOutputs

    failures = []
    for name in ("format date-time", "format uri"):
        params = StructuredOutputsParams(json=SCHEMAS[name])
        max_tokens = estimate(llm, params) + FEW
        monkeypatch.setattr(StructuredOutputs, "needs_closing", lambda self, rid, budget: False)
        outs = run(llm, prompt, sampled(params, max_tokens))
        monkeypatch.undo()
        failures += [text for text, reason in outs if reason == "length" and not parses(text)]
    assert failures


def parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


LOOP_LINES = ("The file has been rewritten.", "All tests passed.", "Done.", "ok",
              "The build is green.", "Saved to disk.")


LOOP_EXTRA = 40  # tokens past the estimate: the loops start well before the guard


def test_greedy_loops_with_speculation_end() -> None:
    """The default model asked to repeat a line inside a JSON string loops at temperature 0,
    and prompt lookup drafts the loop: up to 9 tokens a step are accepted. A step must not
    carry a request past where it is held (its drafts stop short of the guard); without that,
    one of these outputs was closed a token too late on this model and ended with "length"."""
    llm = LLM(max_num_seqs=4)
    schema = one_field({"type": "string"})
    params = StructuredOutputsParams(json=schema)
    max_tokens = estimate(llm, params) + LOOP_EXTRA
    for line in LOOP_LINES:
        messages = [{"role": "user", "content": f"Write the sentence '{line}' fifty times, as "
                                                "JSON with the key v."}]
        (out,) = llm.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                   structured_outputs=params))
        assert out.finish_reason == "stop", (line, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    assert llm.engine.stats().spec.num_accepted_tokens > 0  # the drafts did ride


def test_drafts_stop_short_of_the_guard(llm: LLM) -> None:
    """``draft_room``: all the budget allows while far from the end, never past the guard's
    start (the last known cost, its margin and the guard), and nothing once held."""
    from agentd.structured.matchers import CLOSING_MARGIN, GUARD_TOKENS, MARGIN_PER_TOKEN

    structured = llm.engine.structured
    params = StructuredOutputsParams(json=one_field({"type": "string"}))
    structured.add("r", llm.engine.grammars.compile(params))
    try:
        cost = structured.cost_to_close("r")
        assert cost is not None
        guard_start = cost + CLOSING_MARGIN + int(MARGIN_PER_TOKEN * cost) + GUARD_TOKENS
        assert not structured.needs_closing("r", 1000)  # learns the cost
        assert structured.draft_room("r", 1000) == 1000 - 1 - guard_start
        assert structured.draft_room("r", guard_start + 4) == 3  # 3 drafts + 1: guard_start left
        assert structured.draft_room("r", guard_start) == 0
        assert structured.needs_closing("r", guard_start)
        assert structured.draft_room("r", guard_start) == 0
    finally:
        structured.remove("r")
