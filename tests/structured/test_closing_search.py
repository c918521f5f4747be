"""The closing search on real grammars and the real SmolLM2 tokenizer: from a state part way
through an output, the way it finds is accepted by the grammar (walked by a real xgrammar
matcher of the model's vocabulary) and ends it, it is the shortest where the shortest is plain,
and its estimate is the way's length in tokens."""

from __future__ import annotations

import json
import string

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from agentd.structured.closing import ClosingSearch, Vocab
from agentd.structured.compiler import GrammarCompiler
from agentd.structured.params import FunctionSpec, StructuredOutputsParams, ToolCallsSpec

EOS = 2
WHEN = {"type": "object", "required": ["query", "range"], "properties": {
    "query": {"type": "string"}, "step": {"type": "string"},
    "range": {"type": "object", "required": ["start", "end"], "properties": {
        "start": {"type": "string", "format": "date-time"},
        "end": {"type": "string", "format": "date-time"}}}}}
CALL = StructuredOutputsParams(tool_calls=ToolCallsSpec((FunctionSpec.build("q", WHEN),),
                                                        "required", parallel=False))


def of(schema: dict) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema)


def field(schema: dict) -> StructuredOutputsParams:
    return of({"type": "object", "properties": {"v": schema}, "required": ["v"]})


@pytest.fixture(scope="module")
def compiler(default_model_dir) -> GrammarCompiler:
    return GrammarCompiler(AutoTokenizer.from_pretrained(default_model_dir), 49152, [EOS])


@pytest.fixture(scope="module")
def search(compiler: GrammarCompiler) -> ClosingSearch:
    return ClosingSearch(Vocab(compiler.decoded_vocab(), 49152))


def way_out(search: ClosingSearch, compiler: GrammarCompiler, params: StructuredOutputsParams,
            written: str) -> bytes:
    """The way found from ``written``, checked to be accepted and to end the output."""
    grammar = compiler.compile(params)
    shadow = search.shadow(grammar)
    assert shadow.accept_string(written)
    found = search.search(shadow, grammar)
    assert found is not None
    matcher = xgr.GrammarMatcher(grammar)
    assert matcher.accept_string(written + found.text.decode())
    assert matcher.accept_token(EOS)  # the output may end there
    assert found.num_tokens == search.vocab.num_tokens(found.text) + 1
    return found.text


@pytest.mark.parametrize(("params", "written", "expected"), [
    (field({"type": "string"}), '{"v": "looping looping', b'"}'),
    (of({"type": "object"}), '{"a": [{"b": {"c": "x', b'"}}]}'),  # depths that look alike
    (field({"type": "string", "format": "date-time"}), '{"v": "2023-02-03T14:42:28.3229128',
     b'Z"}'),
    (field({"type": "string", "format": "uri"}), '{"v": "https://example.com/a/b', b'"}'),
    (field({"type": "string", "format": "hostname"}), '{"v": "api.example', b'"}'),
    (field({"type": "string", "format": "email"}), '{"v": "john.smith', b'@z"}'),
    (field({"type": "string", "format": "ipv4"}), '{"v": "10.', b'0.0.0"}'),  # octets alike
    (field({"type": "string", "minLength": 5}), '{"v": "ab', b'~~~"}'),  # a hidden count
    (field({"type": "string", "pattern": "^[a-z]+-[0-9]{3,}$"}), '{"v": "abc-1', b'99"}'),
    (field({"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}),
     '{"v": [[1, 2], [3', b']]}'),
    (field({"type": "object", "additionalProperties": {"type": "string"}}),
     '{"v": {"k": "x", "other', b'": ""}}'),
    (StructuredOutputsParams(regex="[a-z]+@[a-z]+\\.(com|org)"), "", b"z@z.com"),
])
def test_shortest_ways_out(search: ClosingSearch, compiler: GrammarCompiler,
                           params: StructuredOutputsParams, written: str,
                           expected: bytes) -> None:
    assert way_out(search, compiler, params, written) == expected


@pytest.mark.parametrize("written", [
    "", '<tool_call>\n{"name": "q", "arguments": {"query": "rate(x[5m])',
    '<tool_call>\n{"name": "q", "arguments": {"query": "", "range": {"end": "2023-0',
])
def test_a_call_is_closed_with_every_required_key(search: ClosingSearch,
                                                  compiler: GrammarCompiler,
                                                  written: str) -> None:
    text = (written + way_out(search, compiler, CALL, written).decode())
    body = text.split("<tool_call>\n", 1)[1].split("\n</tool_call>", 1)[0]
    arguments = json.loads(body)["arguments"]
    assert set(arguments) == {"query", "range"}  # the optional "step" is left out
    assert set(arguments["range"]) == {"start", "end"}


def test_content_is_what_keeps_the_way_open(search: ClosingSearch,
                                            compiler: GrammarCompiler) -> None:
    grammar = compiler.compile(field({"type": "string", "format": "date-time"}))
    for written, content, other in [('{"v": "2023-02-03T14:42:28.32', b"0123456789", b"Z+-\""),
                                    ('{"v": "2023', b"", b"0123456789-")]:
        shadow = search.shadow(grammar)
        assert shadow.accept_string(written)
        found = search.search(shadow, grammar)
        assert found is not None
        assert all(found.content >> b & 1 for b in content)
        assert not any(found.content >> b & 1 for b in other)


def test_the_way_from_the_start_is_kept_per_grammar(search: ClosingSearch,
                                                    compiler: GrammarCompiler) -> None:
    grammar = compiler.compile(CALL)
    first = search.search(search.shadow(grammar), grammar, at_start=True)
    num_searches = search.num_searches
    assert search.search(search.shadow(grammar), grammar, at_start=True) is first
    assert search.num_searches == num_searches


@pytest.mark.parametrize("workload", ["coding_agent", "support_agent", "research_agent"])
def test_every_packaged_tool_has_a_way_out_from_inside_its_first_string(
        search: ClosingSearch, compiler: GrammarCompiler, workload: str) -> None:
    """A named call to each packaged tool, stopped inside the first string it opens (where a
    small model loops), has a way out. create_return's keys, sorted, put an optional string
    first, and a search that told states apart by every forced text on its way ran out of
    states there (the model then wrote digits until max_tokens)."""
    from importlib import resources

    data = json.loads(resources.files("agentd.workloads").joinpath(f"{workload}.json")
                      .read_text())
    for tool in data["tools"]:
        function = FunctionSpec.build(tool["function"]["name"], tool["function"]["parameters"])
        params = StructuredOutputsParams(tool_calls=ToolCallsSpec((function,), "required",
                                                                  parallel=False))
        grammar = compiler.compile(params)
        matcher, written = xgr.GrammarMatcher(grammar), ""
        while not (written.endswith(('": "', '["')) and '"arguments": {' in written):
            step = matcher.find_jump_forward_string() or next(
                c for c in '",]}1' + string.ascii_lowercase if matcher.fork().accept_string(c))
            assert matcher.accept_string(step) and len(written) < 400
            written += step
        for content in ("", "12345678"):  # (where the string takes any text)
            if matcher.fork().accept_string(content):
                way = way_out(search, compiler, params, written + content)
                assert way.endswith(b"</tool_call>")
