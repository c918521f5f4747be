"""What the grammar enforces, checked against xgrammar itself: for each keyword, an instance
that breaks it is refused by the compiled grammar exactly when ``agentd.structured.enforced``
says the keyword is enforced. Then what strict and best effort do with the others."""

from __future__ import annotations

import json
import logging

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from agentd.structured import enforced
from agentd.structured.compiler import GrammarCompiler
from agentd.structured.enforced import unenforced
from agentd.structured.params import (
    FunctionSpec,
    GrammarError,
    StructuredOutputsParams,
    ToolCallsSpec,
    tool_calls_params,
)

INT = {"type": "integer"}
AB = {"a": INT, "b": INT}


def obj(**fields) -> dict:
    return {"type": "object", **fields}


# (schema, a valid instance, an instance that breaks the keyword, the keyword if unenforced)
CASES = {
    "pattern": ({"type": "string", "pattern": "^a+$"}, "aa", "b", None),
    "maxLength": ({"type": "string", "maxLength": 2}, "ab", "abc", None),
    "minimum": ({"type": "integer", "minimum": 3}, 4, 1, None),
    "exclusiveMaximum": ({"type": "number", "exclusiveMaximum": 3}, 2.5, 3, None),
    "multipleOf on integers": ({"type": "integer", "multipleOf": 3}, 6, 4, None),
    "enum": ({"enum": [1, 2]}, 2, 3, None),
    "maxItems": ({"type": "array", "items": INT, "maxItems": 1}, [1], [1, 2], None),
    "additionalProperties": (obj(properties={}, additionalProperties=INT), {"a": 1},
                             {"a": "x"}, None),
    "patternProperties": (obj(patternProperties={"x.*": INT}), {"x1": 1}, {"x1": "s"}, None),
    "propertyNames": (obj(propertyNames={"maxLength": 2}, additionalProperties=True),
                      {"ab": 1}, {"abc": 1}, None),
    "unevaluatedProperties": (obj(properties={"a": INT}, unevaluatedProperties=False),
                              {"a": 1}, {"a": 1, "b": 2}, None),
    "maxProperties": (obj(additionalProperties=True, maxProperties=1), {"a": 1},
                      {"a": 1, "b": 2}, None),
    "oneOf of types": ({"oneOf": [INT, {"type": "string"}]}, 1, True, None),
    "oneOf with a discriminator": ({"oneOf": [
        obj(properties={"k": {"const": "a"}, "x": INT}, required=["k", "x"]),
        obj(properties={"k": {"const": "b"}, "y": INT}, required=["k", "y"])]},
        {"k": "a", "x": 1}, {"k": "a", "y": 1}, None),
    "allOf of one": ({"allOf": [{"type": "integer", "minimum": 3}]}, 4, 1, None),
    "format": ({"type": "string", "format": "email"}, "a@b.co", "ab", None),
    "not": ({"type": "integer", "not": {"const": 3}}, 4, 3, "not"),
    "if": (obj(properties=AB, **{"if": {"properties": {"a": {"const": 1}}},
                                 "then": {"required": ["b"]}}), {"a": 1, "b": 2}, {"a": 1},
           "if"),
    "dependentRequired": (obj(properties=AB, dependentRequired={"a": ["b"]}),
                          {"a": 1, "b": 2}, {"a": 1}, "dependentRequired"),
    "dependentSchemas": (obj(properties=AB, dependentSchemas={"a": {"required": ["b"]}}),
                         {"a": 1, "b": 2}, {"a": 1}, "dependentSchemas"),
    "contains": ({"type": "array", "items": INT, "contains": {"const": 5}}, [5], [1],
                 "contains"),
    "uniqueItems": ({"type": "array", "items": INT, "uniqueItems": True}, [1, 2], [1, 1],
                    "uniqueItems"),
    "multipleOf on numbers": ({"type": "number", "multipleOf": 0.5}, 1.5, 1.3, "multipleOf"),
    "allOf of two": ({"allOf": [obj(properties={"a": INT}, required=["a"]),
                                obj(properties={"b": INT}, required=["b"])]},
                     {"a": 1, "b": 2}, {"a": 1}, "allOf"),
    "oneOf that overlaps": ({"oneOf": [INT, {"type": "number"}]}, 1.5, 1, "oneOf"),
    "minimum beside $ref": ({"$defs": {"x": INT}, "$ref": "#/$defs/x", "minimum": 3}, 4, 1,
                            "minimum"),
    "minimum beside anyOf": ({"anyOf": [INT, {"type": "string"}], "minimum": 3}, 4, 1,
                             "minimum"),
    "minLength beside pattern": ({"type": "string", "pattern": "^a+$", "minLength": 3}, "aaa",
                                 "a", "minLength"),
    "required not listed": (obj(properties={"a": INT}, required=["b"],
                                additionalProperties=True), {"a": 1, "b": 2}, {"a": 1},
                            "required"),
    "const of another type": ({"type": "string", "enum": ["a", 1]}, "a", 1, "enum"),
    "$ref to an anchor": ({"$defs": {"a": {"$anchor": "n", "type": "integer"}}, "$ref": "#n"},
                          1, "s", "$ref"),
}


@pytest.fixture(scope="module")
def compiler(default_model_dir) -> GrammarCompiler:
    return GrammarCompiler(AutoTokenizer.from_pretrained(default_model_dir), 49152, [2])


def accepts(compiler: GrammarCompiler, schema: dict, value: object) -> bool:
    matcher = xgr.GrammarMatcher(compiler.compile(StructuredOutputsParams(json=schema)))
    return bool(matcher.accept_string(json.dumps(value))) and bool(matcher.is_completed())


@pytest.mark.parametrize("name", list(CASES))
def test_unenforced_is_what_the_grammar_lets_through(compiler: GrammarCompiler,
                                                     name: str) -> None:
    schema, valid, broken, keyword = CASES[name]
    assert accepts(compiler, schema, valid)
    assert accepts(compiler, schema, broken) is (keyword is not None)
    assert [u.keyword for u in unenforced(schema)] == ([keyword] if keyword else [])


def test_strict_refuses_the_keyword_naming_where_it_is(compiler: GrammarCompiler) -> None:
    schema = obj(properties={"n": {"type": "integer", "not": {"const": 3}}})
    with pytest.raises(GrammarError, match=r"^the JSON schema: not at #/properties/n cannot be "
                                           "enforced: the grammar cannot exclude"):
        compiler.compile(StructuredOutputsParams(json=schema, strict=True))
    function = FunctionSpec.build("f", schema, strict=True)
    with pytest.raises(GrammarError, match="function 'f': not at #/properties/n"):
        compiler.compile(StructuredOutputsParams(tool_calls=ToolCallsSpec((function,))))
    answer = tool_calls_params([{"type": "function", "function": {"name": "g"}}], "auto",
                               answer_schema=schema, answer_strict=True)
    with pytest.raises(GrammarError, match="response format's schema: not at"):
        compiler.compile(answer)


def test_strict_takes_what_the_grammar_enforces(compiler: GrammarCompiler) -> None:
    for name in ("pattern", "oneOf with a discriminator", "format", "patternProperties"):
        compiler.compile(StructuredOutputsParams(json=CASES[name][0], strict=True))
    unknown = {"type": "string", "format": "int64-string"}  # an annotation: never refused
    compiler.compile(StructuredOutputsParams(json=unknown, strict=True))


def test_best_effort_warns_once_per_keyword(compiler: GrammarCompiler, caplog,
                                            monkeypatch) -> None:
    monkeypatch.setattr(enforced, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="agentd"):
        for name in ("not", "dependentRequired", "dependentSchemas", "not"):
            schema = {**CASES[name][0], "description": "a schema not compiled before"}
            compiler.compile(StructuredOutputsParams(json=schema))
        compiler.compile(StructuredOutputsParams(json={**CASES["not"][0], "minimum": 0}))
    warned = [r.getMessage() for r in caplog.records if r.name == "agentd"]
    assert [m.split()[3] for m in warned] == ["not", "dependentRequired", "dependentSchemas"]
    assert all("is not enforced" in m and "logged once per keyword" in m for m in warned)
