"""Constrained requests in the engine, on a tiny random Llama with the real SmolLM2 tokenizer:
outputs valid whatever the weights, unconstrained neighbours untouched, jump-forward, and the
dead-end error. Schemas are finite so random weights finish them."""

from __future__ import annotations

import json

import jsonschema
import pytest

from agentd.engine.request import EngineRequest
from agentd.engine.sampling_params import SamplingParams
from agentd.llm import LLM
from agentd.structured.jump_forward import plan_jump
from agentd.structured.params import FunctionSpec, StructuredOutputsParams, ToolCallsSpec

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["mode", "ok", "tags"],
          "properties": {"mode": {"enum": ["fast", "careful", "balanced"]},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "maxItems": 2,
                                  "items": {"enum": ["io", "cpu"]}}}}
JSON = StructuredOutputsParams(json=SCHEMA)
LEVEL = {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}}, "required": ["level"],
         "additionalProperties": False}
CALLS = StructuredOutputsParams(tool_calls=ToolCallsSpec(
    (FunctionSpec.build("set_volume_level", LEVEL), FunctionSpec.build("get_mode", SCHEMA)),
    "required", parallel=False))


def make_llm(tiny_model_factory, **engine_args) -> LLM:
    return LLM(str(tiny_model_factory("llama")), device="cpu", kv_cache_memory_bytes=16 * 2**20,
               **engine_args)


@pytest.fixture(scope="module")
def llm(tiny_model_factory) -> LLM:
    return make_llm(tiny_model_factory)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    texts = ["The quick brown fox jumps over", "def fibonacci(n):", "In 1492, Columbus",
             "Dear team, the deploy is"]
    return [llm.tokenizer(t).input_ids for t in texts]


def greedy(max_tokens: int = 48, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def run(llm: LLM, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    """Step the engine over ``requests`` together; each one's output token ids."""
    engine = llm.engine
    ids = [engine.add_request(EngineRequest(prompt, params)) for prompt, params in requests]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
    return [tokens[rid] for rid in ids]


def test_unconstrained_tokens_do_not_change_beside_constrained_ones(
        llm: LLM, prompts: list[list[int]]) -> None:
    plain = greedy(ignore_eos=True)
    alone = run(llm, [(p, plain) for p in prompts[:2]])
    mixed = run(llm, [(p, plain) for p in prompts[:2]] +
                [(p, greedy(structured_outputs=JSON)) for p in prompts[2:]])
    assert mixed[:2] == alone
    assert all(mixed[2:]) and not llm.engine.structured  # they ran; their matchers are gone


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_outputs_validate_whatever_the_weights(llm: LLM, prompts: list[list[int]],
                                                    temperature: float) -> None:
    params = SamplingParams(temperature=temperature, max_tokens=64, seed=7,
                            structured_outputs=JSON)
    for out in llm.generate(prompts, params):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_tool_calls_parse_and_validate(llm: LLM, prompts: list[list[int]]) -> None:
    from agentd.tool_parser import parse_tool_calls

    for out in llm.generate(prompts, greedy(max_tokens=96, structured_outputs=CALLS)):
        parsed = parse_tool_calls(out.text)
        assert out.finish_reason == "stop" and parsed.content == ""
        (call,) = parsed.tool_calls
        schema = LEVEL if call.name == "set_volume_level" else SCHEMA
        jsonschema.validate(json.loads(call.arguments_json), schema)


def test_jump_forward_skips_steps_and_keeps_outputs_valid(tiny_model_factory,
                                                          prompts: list[list[int]]) -> None:
    results = {}
    for jump in (True, False):
        llm = make_llm(tiny_model_factory, jump_forward=jump)
        outs = llm.generate(prompts, greedy(max_tokens=96, structured_outputs=CALLS))
        stats = llm.engine.stats()
        results[jump] = (outs, stats.totals.num_steps, stats.num_jump_forward_tokens)
        for out in outs:
            assert out.finish_reason == "stop" and out.text.startswith("<tool_call>\n{\"name\"")
    (_, steps_jf, forced), (_, steps_plain, none) = results[True], results[False]
    assert none == 0 and forced > 0
    assert steps_jf < steps_plain


@pytest.mark.parametrize(("output", "forced_text", "num_replaced"), [
    ('<tool_call>\n{"name": "', 'get_weather", "arguments": {"city": ', 0),
    ('<tool_call>\n{"name": "set_vol', 'ume_level", "arguments": {"level": ', 1),
    ('{"a": 1, "b": [', '"x"]}', 1),  # '[' + '"x' is one token, '["'
])
def test_jumps_keep_the_tokenizers_own_tokens(llm: LLM, output: str, forced_text: str,
                                              num_replaced: int) -> None:
    tokenizer = llm.tokenizer
    output_ids = tokenizer(output, add_special_tokens=False).input_ids
    jump = plan_jump(tokenizer, output_ids, forced_text)
    assert jump is not None and jump.num_replaced == num_replaced
    after = output_ids[:len(output_ids) - num_replaced] + jump.token_ids
    text = tokenizer.decode(after)
    assert text.startswith(output) and (output + forced_text).startswith(text)
    assert tokenizer(text, add_special_tokens=False).input_ids == after  # the tokenizer's own
    assert len(after) < len(tokenizer(output + forced_text, add_special_tokens=False).input_ids)


def test_no_jump_that_would_re_split_older_tokens(llm: LLM) -> None:
    tokenizer = llm.tokenizer
    ids = tokenizer("Hello wor", add_special_tokens=False).input_ids + \
        tokenizer("l", add_special_tokens=False).input_ids
    assert plan_jump(tokenizer, ids, "d and more words") is None
    assert plan_jump(tokenizer, ids, "") is None


def test_a_grammar_dead_end_ends_the_request_with_an_error(llm: LLM,
                                                           prompts: list[list[int]]) -> None:
    engine = llm.engine
    grammar = engine.grammars.compile(StructuredOutputsParams(choice=["yes", "no"]))
    rid = engine.add_request(EngineRequest(prompts[0], greedy(), grammar=grammar))
    matcher = engine.structured._requests[rid].matcher
    for token_id in llm.tokenizer("yes", add_special_tokens=False).input_ids + [2]:
        assert matcher.accept_token(token_id)  # complete and terminated: nothing is legal now
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    (last,) = [d for d in deltas if d.request_id == rid and d.finished]
    assert last.error_code == "grammar_dead_end" and "no further token" in last.error
    assert rid not in engine.structured
    assert engine.kv_cache.pool.num_used == 0


def test_offline_chat_with_tools_is_constrained(llm: LLM) -> None:
    from agentd.tool_parser import parse_tool_calls

    tools = [{"type": "function", "function": {"name": "set_volume_level", "parameters": LEVEL}}]
    user = [{"role": "user", "content": "Louder, please."}]
    (out,) = llm.chat(user, greedy(max_tokens=64), tools=tools, tool_choice="required")
    (call,) = parse_tool_calls(out.text).tool_calls
    assert call.name == "set_volume_level"
    jsonschema.validate(json.loads(call.arguments_json), LEVEL)
    with pytest.raises(ValueError, match="not in tools"):
        llm.chat(user, greedy(), tools=tools,
                 tool_choice={"type": "function", "function": {"name": "nope"}})


def test_a_verbatim_loop_loses_its_next_token(llm: LLM) -> None:
    """In a free string, the token that would go round a loop once more is masked out; the
    rest of the grammar's mask stays."""
    import torch

    from agentd.structured.matchers import StructuredOutputs

    engine = llm.engine
    grammar = engine.grammars.compile(StructuredOutputsParams(
        json={"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}))
    prefix = llm.tokenizer('{"s": "', add_special_tokens=False).input_ids
    cycle = llm.tokenizer("ab-cd-", add_special_tokens=False).input_ids
    output = prefix + cycle * (40 // len(cycle) + 1)
    masks = {}
    for looping in (False, True):
        structured = StructuredOutputs(engine.loaded.model.dims.vocab_size)
        structured.add("r", grammar)
        assert all(structured.accept("r", t) for t in output)
        logits = torch.zeros(1, structured.vocab_size)
        assert structured.apply(logits, ["r"], outputs={"r": output} if looping else None) == []
        masks[looping] = torch.isfinite(logits[0])
    assert masks[False][cycle[0]] and not masks[True][cycle[0]]
    assert (masks[False] & ~masks[True]).sum() == 1  # nothing else was taken away


OPEN_ENDED = {"type": "object", "additionalProperties": False, "required": ["note", "path"],
              "properties": {"note": {"type": "string"}, "path": {"type": "string"},
                             "extra": {"type": "array", "items": {"type": "string"}}}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_open_ended_json_closes_within_max_tokens(llm: LLM, prompts: list[list[int]],
                                                  temperature: float) -> None:
    """Unbounded strings: random weights would write them until max_tokens and leave JSON that
    does not parse; near the budget the structure is closed instead."""
    params = StructuredOutputsParams(json=OPEN_ENDED)
    for max_tokens in (24, 64):
        outs = llm.generate(prompts, SamplingParams(temperature=temperature, seed=3,
                                                    max_tokens=max_tokens,
                                                    structured_outputs=params))
        for out in outs:
            assert out.finish_reason == "stop", out.text
            assert len(out.token_ids) <= max_tokens
            jsonschema.validate(json.loads(out.text), OPEN_ENDED)
    calls = StructuredOutputsParams(tool_calls=ToolCallsSpec(
        (FunctionSpec.build("write_note", OPEN_ENDED),), "required", parallel=True))
    for out in llm.generate(prompts, SamplingParams(temperature=temperature, seed=3,
                                                    max_tokens=80, structured_outputs=calls)):
        assert out.finish_reason == "stop", out.text
        body = out.text.split("<tool_call>\n", 1)[1].split("\n</tool_call>", 1)[0]
        jsonschema.validate(json.loads(body)["arguments"], OPEN_ENDED)


def test_without_closing_open_ended_json_runs_out(llm: LLM, prompts: list[list[int]],
                                                  monkeypatch) -> None:
    """The check above can fail: never closing, random weights do hit max_tokens."""
    from agentd.structured.matchers import StructuredOutputs

    monkeypatch.setattr(StructuredOutputs, "needs_closing", lambda self, rid, budget: False)
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, seed=3, max_tokens=24,
                                                structured_outputs=StructuredOutputsParams(
                                                    json=OPEN_ENDED)))
    assert any(out.finish_reason == "length" for out in outs)


def test_a_finished_grammar_is_asked_not_fed(llm: LLM, capfd) -> None:
    """A matcher that has terminated refuses the next token without being fed it: feeding it
    made xgrammar log "matcher has terminated ... trying to accept new token" (13 times in one
    Codex session)."""
    from agentd.structured.matchers import StructuredOutputs

    engine = llm.engine
    grammar = engine.grammars.compile(StructuredOutputsParams(choice=["yes"]))
    outputs = StructuredOutputs(engine.vocab_size)
    outputs.add("r", grammar)
    for token_id in [*llm.tokenizer("yes", add_special_tokens=False).input_ids,
                     *engine.loaded.eos_token_ids[:1]]:
        assert outputs.accept("r", token_id)
    capfd.readouterr()
    assert outputs.is_terminated("r")
    assert not outputs.accept("r", llm.tokenizer(" no").input_ids[0])
    captured = capfd.readouterr()
    assert "terminated" not in captured.err + captured.out
