"""Schemas with no finite instance, the size limits, and what the compiler makes of both: the
part named with the chain of needs that never ends, schemas that end (however they recur)
compiled as before."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from agentd.structured.compiler import GrammarCompiler
from agentd.structured.finite import no_finite_instance
from agentd.structured.params import (
    FunctionSpec,
    GrammarError,
    StructuredOutputsParams,
    ToolCallsSpec,
    strict_schema,
)
from agentd.structured.schema_tree import MAX_OBJECT_PROPERTIES, MAX_SCHEMA_DEPTH, nodes

NODE = {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}
ENDLESS = {"$defs": {"n": NODE}, "$ref": "#/$defs/n"}
CYCLE = {"$defs": {"A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/B"}},
                         "required": ["b"]},
                   "B": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}},
                         "required": ["a"]}},
         "type": "object", "properties": {"start": {"$ref": "#/$defs/A"}}}  # optional, yet


def obj(required: bool = True, **properties) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required else []}


@pytest.mark.parametrize(("schema", "message"), [
    (ENDLESS, '#/$defs/n has no finite instance: every instance needs "next" (#/$defs/n '
              'again), so none ends'),
    (CYCLE, '#/$defs/A has no finite instance: every instance needs "b" (#/$defs/B), which '
            'needs "a" (#/$defs/A again), so none ends'),
    (obj(a=False), '# has no finite instance: every instance needs "a" (#/properties/a), '
                   'which allows no value'),
    (obj(a={"anyOf": [{"$ref": "#"}, {"type": "array", "items": {"$ref": "#"},
                                      "minItems": 1}]}),
     '# has no finite instance: every instance needs "a" (#/properties/a), which has 2 '
     'alternatives, none of them finite'),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1},
     "# has no finite instance: every instance needs an item (# again)"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}},
      "$ref": "#/$defs/a"},
     "#/$defs/a has no finite instance: every instance is #/$defs/b, which is "
     "#/$defs/b/allOf/0, which is #/$defs/a again"),
    ({"type": "object", "properties": {"x": {"enum": []}}}, "#/properties/x has no finite "
                                                             "instance: it allows no value"),
    # the root has a finite instance, but the model could open the endless branch
    ({"oneOf": [{"$ref": "#/$defs/n"}, {"type": "string"}], "$defs": {"n": NODE}},
     '#/$defs/n has no finite instance: every instance needs "next"'),
])
def test_the_part_with_no_finite_instance_is_named(schema: dict, message: str) -> None:
    assert (no_finite_instance(schema) or "").startswith(message)


@pytest.mark.parametrize("schema", [
    obj(next={"anyOf": [{"$ref": "#"}, {"type": "null"}]}),  # a linked list
    {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#"}}}},
    {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"type": "array", "items": {"$ref": "#"}},  # [] ends it
    {"$defs": {"n": {**NODE, "required": []}}, "$ref": "#/$defs/n"},
    strict_schema({"type": "object", "properties": {"a": {"type": "integer"}}}),  # false: none
    {"type": "array", "prefixItems": [{"type": "integer"}], "items": False, "minItems": 1},
])
def test_schemas_that_end_pass(schema: dict) -> None:
    assert no_finite_instance(schema) is None


def test_a_recursive_ref_is_one_node() -> None:
    assert list(nodes(ENDLESS)) == ["#", "#/$defs/n", "#/$defs/n/properties/next"]


@pytest.fixture(scope="module")
def compiler(default_model_dir) -> GrammarCompiler:
    return GrammarCompiler(AutoTokenizer.from_pretrained(default_model_dir), 49152, [2])


def test_the_compiler_refuses_a_schema_with_no_finite_instance(
        compiler: GrammarCompiler) -> None:
    with pytest.raises(GrammarError, match=r"^the JSON schema: #/\$defs/n has no finite"):
        compiler.compile(StructuredOutputsParams(json=ENDLESS))
    tools = ToolCallsSpec((FunctionSpec.build("walk", {"type": "object", "properties": {
        "path": ENDLESS}, "$defs": ENDLESS["$defs"]}),), "required")
    with pytest.raises(GrammarError, match="of function 'walk': #/\\$defs/n has no finite"):
        compiler.compile(StructuredOutputsParams(tool_calls=tools))
    assert compiler.num_compiled == 0
    compiler.compile(StructuredOutputsParams(json=obj(next={"anyOf": [{"$ref": "#"},
                                                                      {"type": "null"}]})))


def nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def test_size_limits() -> None:
    StructuredOutputsParams(json=nested(MAX_SCHEMA_DEPTH))
    with pytest.raises(GrammarError, match=f"nests deeper than {MAX_SCHEMA_DEPTH} levels"):
        StructuredOutputsParams(json=nested(MAX_SCHEMA_DEPTH + 1))
    with pytest.raises(GrammarError, match="nests deeper"):  # json.dumps would recurse out
        FunctionSpec.build("f", {"type": "object", "properties": {"a": nested(5000)}})
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                             for i in range(MAX_OBJECT_PROPERTIES + 1)}}
    with pytest.raises(GrammarError, match=f"#/properties lists {MAX_OBJECT_PROPERTIES + 1}"):
        StructuredOutputsParams(json=wide)
    with pytest.raises(GrammarError, match="holds more than"):
        StructuredOutputsParams(json={"enum": list(range(20000))})
