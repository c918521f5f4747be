"""Constraint params and their compilation, on the real SmolLM2 tokenizer: what a compiled
grammar accepts and rejects (walked token by token, as the engine walks it), the strict-mode
schema, the cache, and the errors for constraints that cannot compile."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from agentd.structured.compiler import GrammarCompiler
from agentd.structured.params import (
    FunctionSpec,
    GrammarError,
    StructuredOutputsParams,
    ToolCallsSpec,
    strict_schema,
)

EOS = 2
CITY = {"type": "object", "properties": {"city": {"type": "string"},
                                          "days": {"type": "integer", "minimum": 1}},
        "required": ["city"]}
WEATHER = FunctionSpec.build("get_weather", CITY)
TIME = FunctionSpec.build("get_time", {"type": "object", "properties": {}})


@pytest.fixture(scope="module")
def compiler(default_model_dir) -> GrammarCompiler:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    return GrammarCompiler(tokenizer, 49152, [EOS])


def accepts(compiler: GrammarCompiler, params: StructuredOutputsParams, text: str) -> bool:
    """Whether ``text`` followed by EOS is a complete output of the grammar, token by token."""
    matcher = xgr.GrammarMatcher(compiler.compile(params))
    ids = compiler.tokenizer(text, add_special_tokens=False).input_ids
    return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(EOS)


def calls(mode: str, *functions: FunctionSpec, parallel: bool = True,
          answer: dict | None = None) -> StructuredOutputsParams:
    spec = ToolCallsSpec(functions, mode, parallel,  # type: ignore[arg-type]
                         json.dumps(answer) if answer else None)
    return StructuredOutputsParams(tool_calls=spec)


def call(name: str, args: dict[str, Any]) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


PARIS = call("get_weather", {"city": "Paris"})
NOW = call("get_time", {})


@pytest.mark.parametrize(("text", "ok"), [
    (PARIS, True),
    (PARIS + "\n" + NOW, True),
    ("", False),  # at least one call
    ("Sure. " + PARIS, False),  # no text
    (call("get_weather", {"days": 2}), False),  # city is required
    (call("get_weather", {"city": "Oslo", "days": 0}), False),  # minimum 1
    (call("get_forecast", {"city": "Oslo"}), False),  # no such tool
    (PARIS + " done", False),  # the turn ends after the last call
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>', False),
])
def test_required_turn(compiler: GrammarCompiler, text: str, ok: bool) -> None:
    assert accepts(compiler, calls("required", WEATHER, TIME), text) is ok


def test_one_call_without_parallel_calls(compiler: GrammarCompiler) -> None:
    assert accepts(compiler, calls("required", WEATHER, TIME, parallel=False), PARIS)
    assert not accepts(compiler, calls("required", WEATHER, TIME, parallel=False),
                       PARIS + "\n" + NOW)


@pytest.mark.parametrize(("text", "ok"), [
    ("It is sunny.", True),
    ("", True),
    ("Let me check.\n" + PARIS, True),
    ("Two: " + PARIS + "\n" + NOW, True),
    ("Hmm <tool or <tool_ca are just text", True),
    ("Bad: " + call("rm_rf", {}), False),
    ("Bad: " + call("get_weather", {"town": "x"}), False),
    (PARIS + "\nAnd now some text.", False),
])
def test_auto_turn_constrains_every_call(compiler: GrammarCompiler, text: str, ok: bool) -> None:
    assert accepts(compiler, calls("auto", WEATHER, TIME), text) is ok


def test_auto_beside_a_json_answer(compiler: GrammarCompiler) -> None:
    params = calls("auto", WEATHER, answer={"type": "object",
                                            "properties": {"answer": {"type": "string"}},
                                            "required": ["answer"]})
    assert accepts(compiler, params, PARIS)
    assert accepts(compiler, params, '{"answer": "42"}')
    assert not accepts(compiler, params, "plain text")
    assert not accepts(compiler, params, "")


def test_strict_function_requires_every_property(compiler: GrammarCompiler) -> None:
    strict = FunctionSpec.build("get_weather", CITY, strict=True)
    assert not accepts(compiler, calls("required", strict), PARIS)  # days missing
    assert accepts(compiler, calls("required", strict),
                   call("get_weather", {"city": "Paris", "days": 3}))


def test_strict_schema_at_every_depth() -> None:
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "string"}}},
        "c": {"type": "array", "items": {"type": "object", "properties": {"d": {}}}},
        "properties": {"type": "string"}}}
    out = strict_schema(schema)
    assert out["required"] == ["a", "c", "properties"] and out["additionalProperties"] is False
    assert out["properties"]["a"]["required"] == ["b"]
    assert out["properties"]["c"]["items"]["required"] == ["d"]
    assert out["properties"]["properties"] == {"type": "string"}  # a property, not a keyword
    assert schema["properties"]["a"] == {"type": "object", "properties": {"b": {"type": "string"}}}


@pytest.mark.parametrize(("params", "good", "bad"), [
    (StructuredOutputsParams(json_object=True), '{"x": [1, 2]}', "[1, 2]"),
    (StructuredOutputsParams(json=CITY), '{"city": "Rome", "days": 2}', '{"days": 2}'),
    (StructuredOutputsParams(json=json.dumps(CITY)), '{"city": "Rome"}', '{"city": 3}'),
    (StructuredOutputsParams(regex=r"[A-Z]{3}-\d{2}"), "ABC-12", "AB-12"),
    (StructuredOutputsParams(choice=["yes", "no", 'say "hi"\n']), 'say "hi"\n', "maybe"),
    (StructuredOutputsParams(grammar='root ::= "a" ("b" | "c")*'), "abcb", "abd"),
])
def test_formats(compiler: GrammarCompiler, params: StructuredOutputsParams, good: str,
                 bad: str) -> None:
    assert accepts(compiler, params, good)
    assert not accepts(compiler, params, bad)


def test_compact_json_unless_any_whitespace(compiler: GrammarCompiler) -> None:
    spaced = '{\n  "city": "Rome"\n}'
    assert not accepts(compiler, StructuredOutputsParams(json=CITY), spaced)
    assert accepts(compiler, StructuredOutputsParams(json=CITY, any_whitespace=True), spaced)


def test_same_tools_compile_once(default_model_dir) -> None:
    compiler = GrammarCompiler(AutoTokenizer.from_pretrained(default_model_dir), 49152, [EOS])
    text = resources.files("agentd.workloads").joinpath("coding_agent.json").read_text()
    tools = json.loads(text)["tools"]

    def spec(order: list[dict]) -> StructuredOutputsParams:
        fns = tuple(FunctionSpec.build(t["function"]["name"], t["function"]["parameters"])
                    for t in order)
        return StructuredOutputsParams(tool_calls=ToolCallsSpec(fns, "auto"))

    first = compiler.compile(spec(tools))
    reordered_keys = [json.loads(json.dumps(t, sort_keys=True)) for t in tools]
    assert compiler.compile(spec(reordered_keys)) is first
    assert (compiler.num_compiled, compiler.num_cache_hits) == (1, 1)
    compiler.compile(spec(tools[:3]))
    assert compiler.num_compiled == 2


@pytest.mark.parametrize(("params", "reason"), [
    (StructuredOutputsParams(json={"type": "object", "properties": {
        "a": {"$ref": "#/$defs/missing"}}}), "missing"),
    (StructuredOutputsParams(json={"type": "frob"}), "frob"),
    (StructuredOutputsParams(regex="(unclosed"), "parenthesis"),
    (StructuredOutputsParams(grammar="root ::= nope"), "nope"),
    (StructuredOutputsParams(grammar='start ::= "a"'), "root"),
    (calls("required", FunctionSpec.build("f", {"type": "object", "properties": {
        "a": {"$ref": "#/nowhere"}}})), "function 'f'"),
])
def test_uncompilable_constraints_say_why(compiler: GrammarCompiler,
                                          params: StructuredOutputsParams, reason: str) -> None:
    before = compiler.num_compiled
    with pytest.raises(GrammarError, match=reason):
        compiler.compile(params)
    assert compiler.num_compiled == before  # nothing cached


@pytest.mark.parametrize("fields", [
    {}, {"json": {}, "regex": "a"}, {"choice": []}, {"choice": ["a", ""]}, {"json": "{bad"},
])
def test_params_name_exactly_one_constraint(fields: dict) -> None:
    with pytest.raises(ValueError):
        StructuredOutputsParams(**fields)


def test_key_is_canonical() -> None:
    a = StructuredOutputsParams(json={"b": 1, "a": {"d": 2, "c": 3}})
    b = StructuredOutputsParams(json='{"a": {"c": 3, "d": 2}, "b": 1}')
    assert a.key == b.key
    assert a.key != StructuredOutputsParams(json={"b": 1}).key
    assert calls("auto", WEATHER).key != calls("required", WEATHER).key


def test_numbers_are_bounded(compiler: GrammarCompiler) -> None:
    """16 digits before the point and 15 after at most: a looping model cannot write a number
    until max_tokens."""
    params = StructuredOutputsParams(json={"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}}, "required": ["n", "x"]})
    assert accepts(compiler, params, '{"n": ' + "9" * 16 + ', "x": 1.' + "5" * 15 + "}")
    assert not accepts(compiler, params, '{"n": ' + "9" * 17 + ', "x": 1.5}')
    assert not accepts(compiler, params, '{"n": 1, "x": 1.' + "5" * 16 + "}")
    tools = calls("required", FunctionSpec.build("f", {"type": "object", "properties": {
        "n": {"type": "integer"}}}))
    assert not accepts(compiler, tools, call("f", {"n": int("1" + "0" * 16)}))


def test_loop_tokens_are_those_that_would_repeat_a_long_run() -> None:
    from agentd.structured.repetition import MIN_REPEAT, loop_tokens

    assert loop_tokens([7] * (MIN_REPEAT + 1)) == {7}
    assert loop_tokens([7] * MIN_REPEAT) == set()
    cycle = [1, 2, 3, 4, 5]
    looping = [9, 9] + cycle * 8
    assert loop_tokens(looping) == {1}  # the token that goes round again
    assert loop_tokens(looping[:-2]) == {4}
    assert loop_tokens(list(range(100))) == set()
    run = list(range(50, 50 + MIN_REPEAT))
    assert loop_tokens(run + [1] + run + [2] + run) == {1, 2}  # every earlier follower
    assert loop_tokens(run[1:] + [0] + run) == set()  # one token short of a repeat


@pytest.mark.parametrize("token_id", [0, 5, 31, 32, 63, 95])
def test_loop_ban_clears_exactly_that_bit_of_a_full_word(token_id: int) -> None:
    """The bitmask is int32: a word with bit 31 set is negative, and clearing any of its bits
    must leave the other 31 set (the failure seen: bit 31 cleared in Python's unbounded ints
    gave a value below int32's range and failed the whole engine step)."""
    import xgrammar as xgr

    from agentd.structured.matchers import _ban_loop
    from agentd.structured.repetition import MIN_REPEAT

    vocab = 96
    row = xgr.allocate_token_bitmask(1, vocab)[0]  # all allowed: every word is -1
    _ban_loop(row, [token_id] * (MIN_REPEAT + 1))
    allowed = [(int(row[t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
    assert allowed == [int(t != token_id) for t in range(vocab)]
