"""Which keywords of a JSON schema the grammar enforces, and what happens to the others.

xgrammar (0.2.9) turns most of JSON Schema into grammar rules; what it cannot express it leaves
out, and the output may then break the schema. Found by compiling each keyword and feeding the
grammar an instance that breaks it (tests/structured/test_enforced.py keeps the list true).
Not enforced: ``not``; ``if``/``then``/``else``; ``dependentRequired``, ``dependentSchemas``,
``dependencies``; ``contains`` (and ``minContains``/``maxContains``); ``uniqueItems``;
``multipleOf`` but on integers; ``allOf`` of more than one schema; ``oneOf`` whose branches may
overlap (it becomes ``anyOf``); keywords beside ``$ref``, ``anyOf``, ``oneOf`` or ``allOf``;
``minLength``/``maxLength`` beside ``pattern`` or ``format``; a ``required`` name that
``properties`` does not list; an ``enum``/``const`` value not of the schema's ``type``; a
``$ref`` that is not local (``#/...``), ``$dynamicRef``, ``$recursiveRef``. A ``format`` the
grammar does not know is an annotation, as JSON Schema 2020-12 reads formats.

Invariant: with ``strict`` (the client's promise that the output must validate: OpenAI's
``strict: true``) a schema with a keyword the grammar cannot enforce is refused, naming the
keyword and where it is; without it the schema is compiled as far as the grammar goes and the
keyword is logged at warning level, once per keyword per process. Unknown formats are only
ever logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from agentd.structured.schema_tree import nodes, resolve

logger = logging.getLogger("agentd")

ENFORCED_FORMATS = frozenset((
    "date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
    "uri-reference", "uri-template", "json-pointer", "uuid"))
_NEVER = {
    "not": "the grammar cannot exclude what a schema matches",
    "if": "the grammar cannot make one part depend on another (if/then/else)",
    "dependentRequired": "the grammar cannot make one property depend on another",
    "dependentSchemas": "the grammar cannot make one property depend on another",
    "dependencies": "the grammar cannot make one property depend on another",
    "contains": "the grammar cannot require an item somewhere in an array (contains, "
                "minContains, maxContains)",
    "$dynamicRef": "only local references (#/...) are resolved",
    "$recursiveRef": "only local references (#/...) are resolved",
}
_COMBINATORS = ("$ref", "anyOf", "oneOf", "allOf")
_VALIDATION = frozenset((
    "type", "enum", "const", "properties", "required", "additionalProperties",
    "patternProperties", "propertyNames", "minProperties", "maxProperties", "items",
    "prefixItems", "minItems", "maxItems", "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "unevaluatedProperties", "unevaluatedItems", *_COMBINATORS))
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "null": (type(None),), "object": (dict,), "array": (list,)}
_warned: set[str] = set()
_NONE = object()


@dataclass(frozen=True)
class Unenforced:
    keyword: str
    pointer: str
    why: str
    annotation: bool = False  # only logged, even when strict (an unknown format)


def check_enforced(schema: Any, strict: bool) -> str | None:
    """The refusal for a strict schema with a keyword the grammar cannot enforce (None when
    there is none); without ``strict`` such keywords are logged once each instead."""
    found = unenforced(schema)
    refused = [u for u in found if strict and not u.annotation]
    if refused:
        first = refused[0]
        return (f"{first.keyword} at {first.pointer} cannot be enforced: {first.why}; remove "
                "it, or send the schema without strict to have it compiled as far as the "
                "grammar goes")
    for item in found:
        if item.keyword not in _warned:
            _warned.add(item.keyword)
            logger.warning("JSON schema keyword %s (at %s) is not enforced: %s; the output may "
                           "break it (logged once per keyword)", item.keyword, item.pointer,
                           item.why)
    return None


def unenforced(schema: Any) -> list[Unenforced]:
    """Every keyword of the schema's reachable nodes that the grammar does not enforce."""
    found: list[Unenforced] = []
    for pointer, node in nodes(schema).items():
        if isinstance(node, dict):
            found.extend(_in_node(node, pointer, schema))
    return found


def _in_node(node: dict[str, Any], pointer: str, root: Any) -> list[Unenforced]:
    found = [Unenforced(key, pointer, why) for key, why in _NEVER.items()
             if key in node and (key != "if" or "then" in node or "else" in node)]
    if node.get("uniqueItems") is True:
        found.append(Unenforced("uniqueItems", pointer,
                                "the grammar cannot compare an array's items with each other"))
    if "multipleOf" in node and node.get("type") != "integer":
        found.append(Unenforced("multipleOf", pointer, "it is enforced on integers only"))
    found.extend(_beside_combinator(node, pointer, root))
    found.extend(_required_unlisted(node, pointer))
    found.extend(_values_of_other_types(node, pointer))
    for bound in ("minLength", "maxLength"):
        beside = next((k for k in ("pattern", "format") if k in node), None)
        if bound in node and beside is not None:
            found.append(Unenforced(bound, pointer, f"the grammar ignores it beside {beside}"))
    ref = node.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        found.append(Unenforced("$ref", pointer, f"only local references (#/...) are "
                                f"resolved, not {ref!r}"))
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt not in ENFORCED_FORMATS:
        found.append(Unenforced("format", pointer, f"the grammar does not know format {fmt!r} "
                                "and treats it as an annotation", annotation=True))
    return found


def _beside_combinator(node: dict[str, Any], pointer: str, root: Any) -> list[Unenforced]:
    """Keywords the grammar drops beside ``$ref``/``anyOf``/``oneOf``/``allOf`` (the first of
    them present is the one it follows), and the combinators it cannot enforce."""
    combinator = next((k for k in _COMBINATORS if k in node), None)
    if combinator is None:
        return []
    # (additionalProperties: false beside them is what the grammar does for every object)
    found = [Unenforced(key, pointer, f"the grammar ignores it beside {combinator}; move it "
                        "into each branch or the referenced schema")
             for key in node if key in _VALIDATION and key != combinator
             and not (key == "type" and _within(node["type"], _branch_types(node, root)))
             and not (key == "additionalProperties" and node[key] is False)]
    members = node.get(combinator)
    if combinator == "allOf" and isinstance(members, list) and len(members) > 1:
        found.append(Unenforced("allOf", pointer, "the grammar follows allOf of one schema "
                                "only; merge its members into one"))
    if combinator == "oneOf" and isinstance(members, list) and not _disjoint(members, root):
        found.append(Unenforced("oneOf", pointer, "its branches may overlap and the grammar "
                                "enforces it as anyOf; give each branch its own type or a "
                                "required property with its own const, or use anyOf"))
    return found


def _required_unlisted(node: dict[str, Any], pointer: str) -> list[Unenforced]:
    required, properties = node.get("required"), node.get("properties")
    if not isinstance(required, list):
        return []
    listed = properties if isinstance(properties, dict) else {}
    missing = [name for name in required if isinstance(name, str) and name not in listed]
    if not missing:
        return []
    return [Unenforced("required", pointer, f"it names {missing[0]!r}, which properties does "
                       "not list, and the grammar leaves it out; list it under properties")]


def _values_of_other_types(node: dict[str, Any], pointer: str) -> list[Unenforced]:
    kinds = _type_list(node.get("type"))
    if kinds is None:
        return []
    values = ([node["const"]] if "const" in node else []) + (
        node["enum"] if isinstance(node.get("enum"), list) else [])
    odd = next((v for v in values if not _is_of(v, kinds)), _NONE)
    if odd is _NONE:
        return []
    keyword = "const" if "const" in node and not _is_of(node["const"], kinds) else "enum"
    return [Unenforced(keyword, pointer, f"its value {odd!r} is not of type "
                       f"{'/'.join(kinds)}, and the grammar writes it anyway")]


def _type_list(kind: Any) -> list[str] | None:
    if isinstance(kind, str) and kind in _JSON_TYPES:
        return [kind]
    if isinstance(kind, list) and kind and all(k in _JSON_TYPES for k in kind):
        return list(kind)
    return None


def _is_of(value: Any, kinds: list[str]) -> bool:
    for kind in kinds:
        if kind == "integer" and isinstance(value, float) and value.is_integer():
            return True
        if isinstance(value, _JSON_TYPES[kind]) and not (
                isinstance(value, bool) and kind in ("integer", "number")):
            return True
    return False


def _declared(schema: Any, root: Any) -> Any:
    """``schema`` with its ``$ref``s followed (a few hops: a cycle answers what it reached)."""
    for _ in range(8):
        target = resolve(root, schema.get("$ref")) if isinstance(schema, dict) else None
        if target is None:
            break
        schema = target[1]
    return schema


def _branch_types(node: dict[str, Any], root: Any) -> set[str] | None:
    """The types the branches (or the referenced schema) declare; None if one declares none."""
    combinator = next(k for k in _COMBINATORS if k in node)
    branches = [{"$ref": node["$ref"]}] if combinator == "$ref" else node[combinator]
    kinds: set[str] = set()
    for branch in branches if isinstance(branches, list) else []:
        declared = _declared(branch, root)
        declared_kinds = _type_list(declared.get("type")) if isinstance(declared, dict) else None
        if declared_kinds is None:
            return None
        kinds.update(declared_kinds)
    return kinds


def _within(kind: Any, branch_kinds: set[str] | None) -> bool:
    sibling = _type_list(kind)
    if sibling is None or branch_kinds is None:
        return False
    allowed = set(sibling) | ({"integer"} if "number" in sibling else set())
    return branch_kinds <= allowed


def _disjoint(branches: list[Any], root: Any) -> bool:
    """Whether no value can match two branches: pairwise distinct types, or objects with one
    required property whose const/enum values differ (a discriminator)."""
    declared = [_declared(b, root) for b in branches]
    if not all(isinstance(d, dict) for d in declared):
        return False
    kinds = [_type_list(d.get("type")) for d in declared]
    if all(k is not None for k in kinds):
        flat = [k for ks in kinds for k in ks]  # type: ignore[union-attr]
        if len(flat) == len(set(flat)) and not {"integer", "number"} <= set(flat):
            return True
    return any(_discriminates(declared, name) for name in _required_of(declared[0]))


def _required_of(schema: dict[str, Any]) -> list[str]:
    required = schema.get("required")
    return [n for n in required if isinstance(n, str)] if isinstance(required, list) else []


def _discriminates(branches: list[dict[str, Any]], name: str) -> bool:
    seen: set[str] = set()
    for branch in branches:
        prop = (branch.get("properties") or {}).get(name)
        if name not in _required_of(branch) or not isinstance(prop, dict):
            return False
        values = [prop["const"]] if "const" in prop else prop.get("enum")
        if not isinstance(values, list) or not values:
            return False
        keys = {repr(v) for v in values}
        if keys & seen:
            return False
        seen |= keys
    return True
