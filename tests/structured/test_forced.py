"""Forced text, walked a byte at a time on the shadow matcher: the same text xgrammar's own walk
finds where that ends, and never more than ``MAX_FORCED_BYTES`` where a grammar forces text
without end (xgrammar's walk then takes memory until the process dies, so those cases run in
a child under a memory cap)."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from agentd.structured.closing import ClosingSearch, Vocab
from agentd.structured.compiler import GrammarCompiler
from agentd.structured.forced import MAX_FORCED_BYTES, whole_characters
from agentd.structured.params import FunctionSpec, StructuredOutputsParams, ToolCallsSpec

EOS = 2
CITY = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"const": "°C"}},
        "required": ["city", "unit"]}


@pytest.fixture(scope="module")
def compiler(default_model_dir) -> GrammarCompiler:
    return GrammarCompiler(AutoTokenizer.from_pretrained(default_model_dir), 49152, [EOS])


@pytest.fixture(scope="module")
def search(compiler: GrammarCompiler) -> ClosingSearch:
    return ClosingSearch(Vocab(compiler.decoded_vocab(), compiler.vocab_size))


CALLS = StructuredOutputsParams(tool_calls=ToolCallsSpec(
    (FunctionSpec.build("get_weather", CITY),), "required", False))


@pytest.mark.parametrize(("params", "written"), [
    (CALLS, ""),
    (CALLS, "<tool_call>\n{"),
    (CALLS, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo'),
    (CALLS, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"'),  # "°C" next
    (StructuredOutputsParams(json={"enum": ["é1", "è2"]}), '"'),  # only a lead byte is forced
    (StructuredOutputsParams(json={"const": "naïve café"}), ""),
    (StructuredOutputsParams(regex="[a-z]+@example\\.com"), "ab"),
    (StructuredOutputsParams(grammar='root ::= "x" "y"* "z"'), ""),
])
def test_forced_text_is_xgrammars_where_it_ends(compiler: GrammarCompiler, search: ClosingSearch,
                                                params: StructuredOutputsParams,
                                                written: str) -> None:
    grammar = compiler.compile(params)
    matcher, shadow = xgr.GrammarMatcher(grammar), search.shadow(grammar)
    assert matcher.accept_string(written) and shadow.accept_string(written)
    assert search.forced_text(shadow) == matcher.find_jump_forward_string()
    assert search.forced_text(shadow) == matcher.find_jump_forward_string()  # shadow unmoved


def test_whole_characters_only() -> None:
    assert whole_characters("a°".encode()[:-1]) == "a"
    assert whole_characters("°C".encode()[1:]) == ""
    assert whole_characters("naïve".encode()) == "naïve"


ENDLESS = r"""
import json, sys
from transformers import AutoTokenizer
from agentd.structured.compiler import GrammarCompiler
from agentd.structured.matchers import StructuredOutputs
from agentd.structured.params import StructuredOutputsParams

compiler = GrammarCompiler(AutoTokenizer.from_pretrained(sys.argv[1]), 49152, [2])
structured = StructuredOutputs(49152, compiler.decoded_vocab, [2])
for i, grammar in enumerate(sys.argv[2:]):
    structured.add(str(i), compiler.compile(StructuredOutputsParams(grammar=grammar)))
    forced = structured.forced_text(str(i))
    print(json.dumps({"forced": forced, "cost": structured.cost_to_close(str(i))}), flush=True)
"""
ENDLESS_GRAMMARS = {  # grammar: what it forces from its start
    'root ::= "a" root': "a" * MAX_FORCED_BYTES,  # no finite sentence at all
    'root ::= "{" item "}"\nitem ::= "[" item "]"': "{" + "[" * (MAX_FORCED_BYTES - 1),
}


def test_forced_text_is_bounded_where_a_grammar_never_ends(default_model_dir,
                                                           run_capped) -> None:
    """Jump-forward asks for the forced text after every step and the closing search near the
    budget; neither may run on without end (xgrammar's walk grew the child to its cap)."""
    done = run_capped(ENDLESS, str(default_model_dir), *ENDLESS_GRAMMARS)
    assert done.returncode == 0, done.stderr[-2000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["forced"] for r in results] == list(ENDLESS_GRAMMARS.values())
    assert [r["cost"] for r in results] == [None, None]  # no way to the end, and it says so
