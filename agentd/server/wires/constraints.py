"""A request's output constraint, from whichever wire fields carry it, and its compilation.

Invariant: tools that are on (``tool_choice`` not "none") always constrain the turn — every call
that appears names one of the tools and carries arguments valid against its schema — and a
request names at most one output format (``response_format``, ``structured_outputs`` or a
``guided_*`` field). Anything that cannot become a grammar is a 400 naming the field that
carries it, raised before the request reaches the engine: a schema over the size limits, with a
part that has no finite instance, or (``strict: true``) with a keyword the grammar cannot
enforce among them (``agentd.structured``'s compiler).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentd.engine.async_engine import AsyncEngine
from agentd.server.errors import APIError, RequestValidationError
from agentd.server.wires.openai_types import ConstraintFields
from agentd.structured.params import (
    GrammarError,
    StructuredOutputsParams,
    tool_calls_params,
)

_FORMAT_TYPES = ("text", "json_object", "json_schema")


@dataclass(frozen=True)
class Constraint:
    """What a request's output must be, and which field asked for it (for errors)."""

    params: StructuredOutputsParams
    param: str


def output_format(req: ConstraintFields) -> Constraint | None:
    """The one output format ``req`` asks for, or None (plain text)."""
    found: list[Constraint] = []
    if req.response_format is not None:
        params = _response_format(req)
        if params is not None:
            found.append(Constraint(params, "response_format"))
    if req.structured_outputs is not None:
        body = req.structured_outputs
        found.append(_build("structured_outputs", json=body.json, regex=body.regex,
                            choice=body.choice, grammar=body.grammar,
                            json_object=bool(body.json_object)))
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        value = getattr(req, name)
        if value is not None:
            found.append(_build(name, **{name.removeprefix("guided_"): value}))
    if len(found) > 1:
        raise RequestValidationError(
            f"{found[0].param} and {found[1].param} both constrain the output; send one",
            found[1].param)
    return found[0] if found else None


def tool_constraint(tools: list[dict[str, Any]], tool_choice: Any,
                    parallel_tool_calls: bool | None, answer: Constraint | None) -> Constraint:
    """The turn's constraint when tools are on: calls only (required, named), or free text then
    calls (auto) — or, beside a JSON output format, calls or one JSON answer."""
    strict = answer is not None and answer.params.strict
    try:
        params = tool_calls_params(tools, tool_choice, parallel_tool_calls,
                                   _answer_schema(answer), strict)
    except GrammarError as exc:
        raise RequestValidationError(f"tools: {exc.message}", "tools") from exc
    assert params is not None  # tools are on
    return Constraint(params, "tools")


def json_constraint(schema: Any, param: str, strict: bool = False) -> Constraint:
    """The constraint of a JSON schema carried by ``param`` (strict: OpenAI's ``strict:
    true``); a 400 naming ``param`` for a schema over the size limits."""
    return _build(param, json=schema, strict=bool(strict))


async def compile_constraint(engine: AsyncEngine, constraint: Constraint | None) -> Any:
    """Compile (or fetch the cached) grammar off the event loop; a 400 naming the field when it
    cannot compile."""
    if constraint is None:
        return None
    try:
        return await engine.compile_grammar(constraint.params)
    except GrammarError as exc:
        raise APIError(400, f"{constraint.param}: {exc.message}", param=constraint.param,
                       code="invalid_grammar") from exc


def _answer_schema(answer: Constraint | None) -> dict[str, Any] | None:
    if answer is None:
        return None
    params = answer.params
    if params.kind not in ("json", "json_object"):
        raise RequestValidationError(
            f"{answer.param}: only a JSON output format can be combined with tools; "
            f"{params.kind} cannot", answer.param)
    return params.json if params.kind == "json" else {"type": "object"}  # type: ignore[return-value]


def _response_format(req: ConstraintFields) -> StructuredOutputsParams | None:
    fmt = req.response_format
    assert fmt is not None
    if fmt.type not in _FORMAT_TYPES:
        raise RequestValidationError(
            f"response_format.type must be one of {', '.join(_FORMAT_TYPES)}, got {fmt.type!r}",
            "response_format.type")
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = fmt.json_schema
    if spec is None or spec.schema is None:
        raise RequestValidationError(
            'response_format of type "json_schema" needs json_schema.schema',
            "response_format.json_schema")
    return json_constraint(spec.schema, "response_format", bool(spec.strict)).params


def _build(param: str, **fields: Any) -> Constraint:
    try:
        return Constraint(StructuredOutputsParams(**fields), param)
    except ValueError as exc:
        raise RequestValidationError(f"{param}: {exc}", param) from exc
