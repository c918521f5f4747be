"""What a request asks its output to be: vLLM's ``StructuredOutputsParams`` plus tool calls.

Invariant: a params object names exactly one constraint, and its ``key`` is the same bytes for
every request that asks for the same thing (schemas canonicalised: sorted keys, fixed separators),
so compiled grammars are cached by it. Pure Python: nothing here imports the grammar engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from agentd.structured.schema_tree import over_limits

# The one tool-call format agentd's templates and parser speak (Hermes / Qwen2.5 style).
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
CALL_SEPARATOR = "\n"
# JSON is generated compact with these separators (as json.dumps writes it): free whitespace lets
# a small model loop on newlines and spaces until max_tokens.
JSON_SEPARATORS = (", ", ": ")


class GrammarError(ValueError):
    """A constraint the grammar engine cannot compile; ``param`` names the request field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def check_limits(schema: Any, what: str) -> None:
    """Raise GrammarError when ``schema`` is over ``agentd.structured.schema_tree``'s limits
    (depth, values, properties): checked before anything walks it recursively."""
    problem = over_limits(schema)
    if problem is not None:
        raise GrammarError(f"{what} is too large to compile: {problem}")


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def call_opening(name: str) -> str:
    """The text every call to ``name`` starts with (names are ``[A-Za-z0-9_-]``: no escaping)."""
    return f'{TOOL_CALL_OPEN}\n{{"name": "{name}", "arguments": '


CALL_CLOSING = "}\n" + TOOL_CALL_CLOSE


@dataclass(frozen=True)
class FunctionSpec:
    """One callable tool: its name, its parameters' JSON schema (canonical text) and strictness."""

    name: str
    parameters: str = '{"type":"object"}'
    strict: bool = False

    @classmethod
    def build(cls, name: str, parameters: dict[str, Any] | None, strict: bool = False
              ) -> FunctionSpec:
        """Raises GrammarError for a schema over ``agentd.structured.schema_tree``'s limits."""
        schema = parameters if parameters is not None else {"type": "object", "properties": {}}
        check_limits(schema, f"the parameters schema of function {name!r}")
        return cls(name, canonical_json(schema), bool(strict))

    @property
    def schema(self) -> dict[str, Any]:
        schema = json.loads(self.parameters)
        return strict_schema(schema) if self.strict else schema


@dataclass(frozen=True)
class ToolCallsSpec:
    """Which calls a turn may hold.

    ``required``: the turn is one or more calls (one when not ``parallel``), then it ends.
    ``auto``: free text, then optionally calls; once a call opens it must be valid, and after the
    last call the turn ends. With ``answer_schema`` (tools beside a JSON response format) an
    ``auto`` turn is either calls or one JSON answer valid against it. A named ``tool_choice`` is
    ``required`` over that one function with ``parallel`` off.
    """

    functions: tuple[FunctionSpec, ...]
    mode: Literal["auto", "required"] = "required"
    parallel: bool = True
    answer_schema: str | None = None  # auto only: a turn without calls is this JSON (canonical)
    answer_strict: bool = False  # the answer schema is strict (``StructuredOutputsParams``)

    def __post_init__(self) -> None:
        if not self.functions:
            raise ValueError("tool calls need at least one function")
        if self.mode not in ("auto", "required"):
            raise ValueError(f"tool call mode must be 'auto' or 'required', got {self.mode!r}")
        if self.answer_schema is not None and self.mode != "auto":
            raise ValueError("an answer schema goes with mode 'auto' only")


_KINDS = ("json", "json_object", "regex", "choice", "grammar", "tool_calls")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's names; set exactly one).

    ``json``: a JSON schema (dict or JSON text) the output must validate against.
    ``json_object``: any JSON object. ``regex``: a regular expression the whole output matches.
    ``choice``: one of these strings. ``grammar``: an EBNF grammar (xgrammar/GBNF dialect, rule
    ``root``). ``tool_calls``: agentd's tool-call turn (see ``ToolCallsSpec``).
    ``any_whitespace``: let JSON carry free whitespace (default: compact ``{"a": 1, "b": 2}``).
    ``strict``: ``json`` is strict as OpenAI's ``strict: true`` reads it: every property
    required and no others (``strict_schema``), and a keyword the grammar cannot enforce is a
    GrammarError rather than best effort (``agentd.structured.enforced``).
    A ``json`` schema over ``agentd.structured.schema_tree``'s limits is a GrammarError.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    tool_calls: ToolCallsSpec | None = None
    any_whitespace: bool = False
    strict: bool = False
    key: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        chosen = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError("structured outputs take exactly one of json, json_object, regex, "
                             f"choice, grammar or tool_calls; got {chosen or 'none'}")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except ValueError as exc:
                raise ValueError(f"the json schema is not valid JSON: {exc}") from exc
        if self.strict and self.json is None:
            raise ValueError("strict applies to a json schema only")
        if self.json is not None:
            check_limits(self.json, "the JSON schema")
            if self.strict:
                object.__setattr__(self, "json", strict_schema(self.json))
        object.__setattr__(self, "key", self._key())

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def _key(self) -> bytes:
        value: Any = getattr(self, self.kind)
        if isinstance(value, ToolCallsSpec):
            value = [value.mode, value.parallel, value.answer_schema, value.answer_strict,
                     [[f.name, f.parameters, f.strict] for f in value.functions]]
        return canonical_json([self.kind, value, self.any_whitespace, self.strict]).encode()


_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SCHEMA_ONES = ("items", "not", "if", "then", "else", "contains")


def strict_schema(schema: Any) -> Any:
    """``schema`` as OpenAI's strict mode reads it: every object's properties all required and
    no other properties allowed, at every depth (properties, items, anyOf/oneOf/allOf, $defs)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(item) for item in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_ONES:
        if key in out:
            out[key] = strict_schema(out[key])
    if isinstance(out.get("properties"), dict):
        out["required"] = list(out["properties"])
    if "properties" in out or out.get("type") == "object":
        out["additionalProperties"] = False
    return out


def tool_calls_params(tools: list[dict[str, Any]], tool_choice: Any = None,
                      parallel_tool_calls: bool | None = None,
                      answer_schema: dict[str, Any] | None = None, answer_strict: bool = False
                      ) -> StructuredOutputsParams | None:
    """The constraint for OpenAI-shaped ``tools`` and ``tool_choice`` ("auto"/None, "required",
    "none" or ``{"type": "function", "function": {"name": ...}}``); None when tools are off.

    One call per turn unless ``parallel_tool_calls`` is True (see
    ``agentd.server.wires.chat_plan`` for why). ``answer_schema``: beside a JSON response
    format, an ``auto`` turn is calls or one JSON answer (``answer_strict``: that format is
    strict; its schema is already ``strict_schema``'s).
    """
    if not tools or tool_choice == "none":
        return None
    functions = tuple(FunctionSpec.build(t["function"]["name"], t["function"].get("parameters"),
                                         bool(t["function"].get("strict")))
                      for t in tools)
    parallel = parallel_tool_calls is True
    named = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if named is not None:
        if named not in {f.name for f in functions}:
            raise ValueError(f"tool_choice names the function {named!r}, which is not in tools")
        spec = ToolCallsSpec(tuple(f for f in functions if f.name == named), "required", False)
    elif tool_choice == "required":
        spec = ToolCallsSpec(functions, "required", parallel)
    else:
        answer = None if answer_schema is None else canonical_json(answer_schema)
        spec = ToolCallsSpec(functions, "auto", parallel, answer, answer_strict)
    return StructuredOutputsParams(tool_calls=spec)
