"""Whether every part of a JSON schema has a finite instance.

A schema whose required properties recur (``{"$defs": {"n": {"type": "object", "properties":
{"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}}, "$ref": "#/$defs/n"}``) compiles to a
grammar with no sentence that ends: the model can only write ``{"next": {"next": ...`` until
its budget runs out. Such schemas are refused, naming the part and the chain of needs that
never ends.

A node (a subschema, by the JSON pointer where it is defined) is finite when one of its
alternatives needs only finite nodes, as the grammar compiler reads the schema:

- ``true``, ``const``, a non-empty ``enum``, a scalar type: no needs;
- ``$ref``: its target (xgrammar ignores the keywords beside it);
- ``anyOf`` / ``oneOf``: one alternative per branch; ``allOf``: one needing every member;
- an object: its required properties (a required name that ``properties`` does not list is
  not in the grammar); an array: its first ``minItems`` ``prefixItems``, and ``items`` when
  ``minItems`` goes past them; a list of types: one alternative per type;
- ``false`` and an empty ``enum`` have none.

Decided as a least fixpoint (Horn clauses on a worklist: linear in the schema's size).

Invariant: a schema passes only when every node reachable from its root (through subschemas
and local ``$ref``s) is finite, not only the root: the grammar lets the model open an optional
property or an ``anyOf`` branch, and one with no finite instance would never close. A ``false``
node (no extra properties, no more items) is refused only through a node that needs it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from agentd.structured.schema_tree import child, nodes, resolve

Need = tuple[str, str]  # (what the instance needs, e.g. '"next"', or "" for a $ref; pointer)

_OBJECT_KEYS = ("properties", "required", "additionalProperties", "patternProperties",
                "minProperties", "maxProperties", "propertyNames", "unevaluatedProperties")
_ARRAY_KEYS = ("items", "prefixItems", "minItems", "maxItems", "unevaluatedItems")


def no_finite_instance(schema: Any) -> str | None:
    """Why a part of ``schema`` has no finite instance (None when every part has one)."""
    nodes_ = nodes(schema)
    graph = {pointer: _alternatives(node, pointer, schema) for pointer, node in nodes_.items()}
    finite = _finite_nodes(graph)
    # (``false`` forbids what it stands for: an extra property, an item past prefixItems; it
    # is refused only where something needs it, through that need)
    start = next((pointer for pointer, node in nodes_.items()
                  if pointer not in finite and node is not False), None)
    return None if start is None else _explain(graph, finite, start)


def _alternatives(schema: Any, pointer: str, root: Any) -> list[list[Need]]:
    """The node's alternatives, each the list of nodes it needs."""
    if isinstance(schema, bool):
        return [[]] if schema else []
    if not isinstance(schema, dict):
        return [[]]  # not a schema: the compiler refuses it with its own words
    if "$ref" in schema:
        target = resolve(root, schema["$ref"])
        return [[("", target[0])]] if target is not None else [[]]
    if "const" in schema:
        return [[]]
    if "enum" in schema:
        return [[]] if schema["enum"] != [] else []
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return [[("", child(pointer, key, i))] for i in range(len(schema[key]))]
    if isinstance(schema.get("allOf"), list):
        return [[("", child(pointer, "allOf", i)) for i in range(len(schema["allOf"]))]]
    return [_needs_of_type(schema, pointer, kind) for kind in _types(schema)]


def _types(schema: dict[str, Any]) -> list[str]:
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list) and kind:
        return [k for k in kind if isinstance(k, str)] or ["any"]
    kinds = [name for name, keys in (("object", _OBJECT_KEYS), ("array", _ARRAY_KEYS))
             if any(key in schema for key in keys)]
    return kinds or ["any"]


def _needs_of_type(schema: dict[str, Any], pointer: str, kind: str) -> list[Need]:
    if kind == "object":
        properties = schema.get("properties")
        required = schema.get("required")
        if not isinstance(properties, dict) or not isinstance(required, list):
            return []
        return [(json.dumps(name), child(pointer, "properties", name))
                for name in dict.fromkeys(n for n in required if isinstance(n, str))
                if name in properties]
    if kind == "array":
        min_items = schema.get("minItems", 0)
        min_items = min_items if isinstance(min_items, int) and min_items > 0 else 0
        prefix = schema.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        needs = [(f"item {i}", child(pointer, "prefixItems", i))
                 for i in range(min(min_items, len(prefix)))]
        if min_items > len(prefix) and isinstance(schema.get("items"), (dict, bool)):
            needs.append(("an item", child(pointer, "items")))
        return needs
    return []


def _finite_nodes(graph: dict[str, list[list[Need]]]) -> set[str]:
    """The least set of nodes closed under "an alternative whose needs are all in the set"."""
    left: dict[tuple[str, int], int] = {}
    waiting: defaultdict[str, list[tuple[str, int]]] = defaultdict(list)
    ready = []
    for pointer, alternatives in graph.items():
        for index, needs in enumerate(alternatives):
            needed = {p for _, p in needs if p in graph}
            left[pointer, index] = len(needed)
            for need in needed:
                waiting[need].append((pointer, index))
            if not needed:
                ready.append(pointer)
    finite: set[str] = set()
    while ready:
        pointer = ready.pop()
        if pointer in finite:
            continue
        finite.add(pointer)
        for parent in waiting.pop(pointer, ()):
            left[parent] -= 1
            if left[parent] == 0:
                ready.append(parent[0])
    return finite


def _explain(graph: dict[str, list[list[Need]]], finite: set[str], start: str) -> str:
    """The chain of needs from ``start`` that never ends: a cycle (told from its first node)
    or a node with no finite alternative."""
    hops: list[Need] = []
    pointer, seen, end = start, {start}, ""
    while not end:
        alternatives = graph[pointer]
        if len(alternatives) != 1:
            end = ("allows no value" if not alternatives else
                   f"has {len(alternatives)} alternatives, none of them finite")
            break
        hop = next(n for n in alternatives[0] if n[1] in graph and n[1] not in finite)
        hops.append(hop)
        pointer = hop[1]
        if pointer in seen:
            if pointer != start:
                return _explain(graph, finite, pointer)
            end = "again"
        seen.add(pointer)
    return f"{start} has no finite instance: {_chain(hops, end)}"


def _chain(hops: list[Need], end: str) -> str:
    phrases: list[list[str]] = []
    for label, pointer in hops:
        if label or not phrases or not phrases[-1][0]:
            phrases.append([label, pointer])
        else:
            phrases[-1][1] = pointer  # a $ref or allOf on the way: name where it leads
    again = " again" if end == "again" else ""
    words = [f"needs {label} ({pointer}{again if i == len(phrases) - 1 else ''})" if label
             else f"is {pointer}{again if i == len(phrases) - 1 else ''}"
             for i, (label, pointer) in enumerate(phrases)]
    if not words:
        return f"it {end}"
    text = "every instance " + ", which ".join(words)
    if again:
        return text + (", so none ends; make one need on this cycle optional (a property not "
                       'required, minItems 0) or give it an anyOf branch that ends, such as '
                       '{"type": "null"}')
    return text + f", which {end}"
