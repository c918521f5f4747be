"""A JSON schema as the grammar compiler reads it: its subschemas by JSON pointer, local
``$ref``s resolved, and the limits on its size.

Invariant: every walk here is iterative and visits each node (a subschema, named by the JSON
pointer where it is defined) once, so a schema of any shape costs time linear in its size: a
recursive ``$ref`` is an edge back to a node, never an expansion, and no nesting depth can
exhaust Python's stack.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

# xgrammar's compile time grows with the cube of the nesting depth (objects nested 64 deep
# compile in 0.13 s, 128 in 1.5 s, 256 in 11 s) and Python's json.dumps fails near 500
# levels; real schemas nest a few levels (OpenAI's strict mode allows 10).
MAX_SCHEMA_DEPTH = 64  # levels of JSON nesting
# Compile time grows faster than linearly with size: 8,000 enum strings take 3.3 s, 4,000
# required properties 3 s, and optional properties cost most (512 in one object 0.65 s, 1,000
# 5.3 s). These bounds keep one compile within a few seconds on a 2-core machine.
MAX_SCHEMA_VALUES = 16384  # JSON values in the whole schema (objects, arrays, strings, numbers)
MAX_OBJECT_PROPERTIES = 512  # properties one object schema lists

_MAPS = ("properties", "patternProperties")
_ONES = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items",
         "unevaluatedItems")
_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")


def child(pointer: str, *keys: str | int) -> str:
    """The JSON pointer of ``pointer``'s member ``keys`` (``~`` and ``/`` escaped)."""
    for key in keys:
        pointer += "/" + str(key).replace("~", "~0").replace("/", "~1")
    return pointer


def resolve(root: Any, ref: Any) -> tuple[str, Any] | None:
    """The node a local ``$ref`` (``#`` or ``#/...``) names, with its pointer; None for any
    other reference or one that names nothing."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    node, pointer = root, "#"
    for part in ref[2:].split("/") if ref != "#" else ():
        key = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
        pointer = child(pointer, key)
    return pointer, node


def subschemas(schema: Any, pointer: str) -> Iterator[tuple[str, str, Any]]:
    """(keyword, pointer, subschema) of the subschemas the grammar is built from (``$ref``
    aside); keywords the grammar ignores (``not``, ``if``...) are not descended into."""
    if not isinstance(schema, dict):
        return
    for key in _MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                yield key, child(pointer, key, name), sub
    for key in _ONES:
        if isinstance(schema.get(key), (dict, bool)):
            yield key, child(pointer, key), schema[key]
    for key in _LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                yield key, child(pointer, key, i), sub


def nodes(root: Any) -> dict[str, Any]:
    """Every node reachable from the root (through subschemas and local ``$ref``s) by pointer,
    in depth-first order from ``#``."""
    found: dict[str, Any] = {}
    stack: list[tuple[str, Any]] = [("#", root)]
    while stack:
        pointer, schema = stack.pop()
        if pointer in found:
            continue
        found[pointer] = schema
        following = [(p, s) for _, p, s in subschemas(schema, pointer)]
        target = resolve(root, schema.get("$ref")) if isinstance(schema, dict) else None
        if target is not None:
            following.insert(0, target)
        stack.extend(reversed(following))
    return found


def over_limits(schema: Any) -> str | None:
    """What is too big in ``schema`` (None if nothing): nesting deeper than
    ``MAX_SCHEMA_DEPTH``, more than ``MAX_SCHEMA_VALUES`` values, an object listing more than
    ``MAX_OBJECT_PROPERTIES`` properties."""
    num_values = 0
    stack: list[tuple[Any, str, int]] = [(schema, "#", 1)]
    while stack:
        value, pointer, depth = stack.pop()
        num_values += 1
        if num_values > MAX_SCHEMA_VALUES:
            return (f"it holds more than {MAX_SCHEMA_VALUES} values; split it or shorten "
                    "its enums")
        if depth > MAX_SCHEMA_DEPTH and isinstance(value, (dict, list)):
            where = pointer if len(pointer) <= 80 else pointer[:80] + "..."
            return (f"it nests deeper than {MAX_SCHEMA_DEPTH} levels (at {where}); "
                    "flatten it or name its parts in $defs")
        if isinstance(value, dict):
            properties = value.get("properties")
            if isinstance(properties, dict) and len(properties) > MAX_OBJECT_PROPERTIES:
                return (f"{child(pointer, 'properties')} lists {len(properties)} "
                        f"properties, more than {MAX_OBJECT_PROPERTIES}")
            stack.extend((v, child(pointer, k), depth + 1) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, child(pointer, i), depth + 1) for i, v in enumerate(value))
    return None
