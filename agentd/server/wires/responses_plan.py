"""``to_plan`` for the Responses API: a validated ``ResponsesRequest`` (and the stored response
it continues, if any) becomes the internal ``Plan`` and the ``Response`` shell its reply fills.

Invariants: runs in a worker thread (templating and tokenising never block the event loop);
raises only ``RequestValidationError`` (rendered in the route's shape). ``input`` (a string or a
list of ``message``, ``function_call`` and ``function_call_output`` items) becomes OpenAI-shaped
chat messages for the templates; every item, part, tool and field agentd cannot honour is a 400
naming it (by its ``param`` path) before anything reaches the engine. With a previous response
the prompt is its stored token ids followed by the new items only (``continuation_ids``, never a
re-render), so the whole earlier conversation is a prefix-cache hit by construction, and its
instructions are those it started with — new, different instructions join the new items as a
system message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from agentd.engine.async_engine import AsyncEngine
from agentd.engine.request import EngineRequest, RetentionRequest
from agentd.engine.sampling_params import SamplingParams
from agentd.server.errors import RequestValidationError as Invalid
from agentd.server.response_store import StoredResponse
from agentd.server.wires.cache_control import OPENAI_BREAKPOINT_TTLS, openai_retention, parse_ttl
from agentd.server.wires.checks import check_max_tokens, check_range
from agentd.server.wires.constraints import Constraint, json_constraint, tool_constraint
from agentd.server.wires.plan import Plan
from agentd.server.wires.prompts import breakpoint_len, continuation_ids, render_ids
from agentd.server.wires.responses_types import Response, ResponsesRequest
from agentd.server.wires.serving import new_request_id
from agentd.server.wires.tool_calls import ToolMode
from agentd.server.wires.tools import ToolSet, responses_tools
from agentd.structured.params import StructuredOutputsParams


@dataclass(frozen=True)
class ResponsesJob:
    plan: Plan
    shell: Response  # the reply, before output and usage
    instructions: str | None  # what the conversation's prompt holds (for continuations)


def plan_responses(req: ResponsesRequest, engine: AsyncEngine, model: str, created: int,
                   previous: StoredResponse | None, keep: bool) -> ResponsesJob:
    """Validate ``req`` and build its prompt; ``keep``: the response will be stored."""
    tool_set = check_fields(req)
    max_tokens = req.max_output_tokens
    if max_tokens is not None:
        check_max_tokens(max_tokens, "max_output_tokens", engine.max_model_len)
    check_range(req.temperature, "temperature", 0.0, 2.0)
    check_range(req.top_p, "top_p", 0.0, 1.0, low_open=True)
    instructions = req.instructions
    if previous is not None and instructions == previous.instructions:
        instructions = None  # already in the stored prompt
    parsed = parse_input(req, instructions, frozenset(
        c["id"] for c in previous.function_calls) if previous else frozenset())
    tools, choice = tool_set.tools, tool_set.tool_choice
    tokenizer = engine.tokenizer
    if previous is None:
        prompt_ids = render_ids(tokenizer, parsed.messages, tools, choice, "input")
    else:
        last_turn: dict[str, Any] = {"role": "assistant", "content": "."}
        if previous.function_calls:
            last_turn["tool_calls"] = previous.function_calls
        prompt_ids = continuation_ids(tokenizer, previous.token_ids, parsed.messages, tools,
                                      choice, last_turn, engine.eos_token_ids)
    constraint = _text_format(req)
    if tool_set.on:
        constraint = tool_constraint(tools or [], choice, tool_set.parallel, constraint)
    params = SamplingParams(max_tokens=max_tokens,
                            temperature=1.0 if req.temperature is None else req.temperature,
                            top_p=1.0 if req.top_p is None else req.top_p,
                            ignore_eos=req.ignore_eos)
    if constraint is not None:
        params.structured_outputs = constraint.params
    request_id = new_request_id("resp").replace("-", "_")
    retention = _retention(req, parsed, previous is None, tokenizer, tools, choice, prompt_ids)
    plan = Plan(model=model, created=created,
                request=EngineRequest(prompt_ids, params, request_id, req.cache_salt,
                                      retention=retention, keep_tail=keep),
                tool_mode=ToolMode.PARSE if tool_set.on else ToolMode.OFF,
                constraint=constraint, prompt_cache_key=req.prompt_cache_key,
                prompt_param="input", max_tokens_param="max_output_tokens")
    shell = Response(
        id=request_id, created_at=created, model=model, status="in_progress", output=[],
        instructions=req.instructions, max_output_tokens=max_tokens,
        metadata=dict(req.metadata or {}), parallel_tool_calls=tool_set.parallel is True,
        previous_response_id=req.previous_response_id, prompt_cache_key=req.prompt_cache_key,
        store=keep, temperature=params.temperature, top_p=params.top_p,
        text={"format": _format_echo(req)}, tool_choice=_choice_echo(req.tool_choice),
        tools=list(req.tools or []), user=req.user)
    kept_instructions = previous.instructions if previous is not None and \
        instructions is None else req.instructions
    return ResponsesJob(plan, shell, kept_instructions)


def _text_format(req: ResponsesRequest) -> Constraint | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint(StructuredOutputsParams(json_object=True), "text.format")
    if fmt.type != "json_schema":
        raise Invalid("text.format.type must be text, json_object or "
                                     f"json_schema, got {fmt.type!r}", "text.format.type")
    if fmt.schema is None:
        raise Invalid('text.format of type "json_schema" needs a schema',
                                     "text.format.schema")
    return json_constraint(fmt.schema, "text.format", bool(fmt.strict))


def _retention(req: ResponsesRequest, parsed: ParsedInput, whole: bool, tokenizer: Any,
               tools: Any, choice: Any, prompt_ids: list[int]) -> RetentionRequest | None:
    """``prompt_cache_options`` / ``prompt_cache_retention`` (``openai_retention``); an explicit
    breakpoint without them keeps the prefix up to the last one for its own TTL."""
    num_explicit = 0
    if parsed.breakpoints:
        index, part, _ = parsed.breakpoints[-1]
        num_explicit = len(prompt_ids)  # a continuation's breakpoints: its whole prompt
        if whole:
            num_explicit = breakpoint_len(tokenizer, parsed.messages, tools, choice, prompt_ids,
                                          (index, part))
    asked = openai_retention(req.prompt_cache_retention, req.prompt_cache_options,
                             len(prompt_ids), num_explicit)
    if asked is None and parsed.breakpoints and req.prompt_cache_retention is None:
        ttl_s = parsed.breakpoints[-1][2]
        return RetentionRequest(num_explicit, ttl_s or OPENAI_BREAKPOINT_TTLS["30m"])
    return asked


def _format_echo(req: ResponsesRequest) -> dict[str, Any]:
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return {"type": "text"}
    echo: dict[str, Any] = {"type": fmt.type}
    for name in ("name", "schema", "strict", "description"):
        if (value := getattr(fmt, name)) is not None:
            echo[name] = value
    return echo


def _choice_echo(tool_choice: Any) -> str | dict[str, Any]:
    return "auto" if tool_choice is None else tool_choice


# Fields OpenAI defines that agentd does not serve: a 400 naming each when set.
_UNSUPPORTED = {"background": "background responses", "conversation": "the Conversations API",
                "prompt": "prompt templates", "max_tool_calls": "max_tool_calls",
                "top_logprobs": "logprobs", "reasoning": "reasoning (this is not a reasoning "
                "model; effort \"none\" is accepted)"}


_ROLES = ("user", "assistant", "system", "developer")


_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass(frozen=True)
class ParsedInput:
    """``input`` as chat messages, where each cache breakpoint sits, and the calls it holds."""

    messages: list[dict[str, Any]]
    breakpoints: list[tuple[int, int, float | None]]  # (message, part, ttl_s or None)
    call_ids: frozenset[str]


def check_fields(req: ResponsesRequest) -> ToolSet:
    """Refuse what agentd cannot honour; return the function tools."""
    for name, what in _UNSUPPORTED.items():
        value = getattr(req, name)
        if value not in (None, False, 0, {}) and not (name == "reasoning" and all(
                v in (None, "none") for v in value.values())):
            raise Invalid(f"{name}: {what} is not supported by agentd; omit {name}", name)
    if req.input is None or req.input == [] or req.input == "":
        raise Invalid("input is required: a string or a non-empty list of items", "input")
    if req.truncation not in (None, "disabled", "auto"):
        raise Invalid(f"truncation must be 'disabled' or 'auto', got {req.truncation!r}",
                      "truncation")
    # reasoning items never appear here, so asking for their encrypted content asks for nothing
    if refused := [i for i in req.include or [] if i != "reasoning.encrypted_content"]:
        raise Invalid(f"include: {', '.join(map(repr, refused))} cannot be included by agentd; "
                      "omit include or send []", "include")
    _check_cache_fields(req)
    return responses_tools(req.tools, req.tool_choice, req.parallel_tool_calls)


def _check_cache_fields(req: ResponsesRequest) -> None:
    openai_retention(req.prompt_cache_retention, req.prompt_cache_options, 1)  # 400s only
    if req.prompt_cache_options is not None and req.prompt_cache_options.prewarm:
        raise Invalid("prompt_cache_options.prewarm is not supported yet; omit it",
                      "prompt_cache_options.prewarm")


def parse_input(req: ResponsesRequest, instructions: str | None,
                known_call_ids: frozenset[str] = frozenset()) -> ParsedInput:
    """``input`` as chat messages (``instructions`` first, as a system message)."""
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    assert items is not None
    messages: list[dict[str, Any]] = []
    breakpoints: list[tuple[int, int, float | None]] = []
    call_ids = set(known_call_ids)
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise Invalid(f"{where} must be an object (an input item)", where)
        kind = item.get("type", "message")
        if kind == "message":
            message, marks = _message(item, where)
            breakpoints += [(len(messages), part, ttl) for part, ttl in marks]
            messages.append(message)
        elif kind == "function_call":
            call = _convert(item, _FunctionCall, where)
            call_ids.add(call.call_id)
            _add_call(messages, {"id": call.call_id, "type": "function",
                                 "function": {"name": call.name, "arguments": call.arguments}})
        elif kind == "function_call_output":
            output = _convert(item, _FunctionCallOutput, where)
            if output.call_id not in call_ids:
                raise Invalid(f"{where}.call_id: no function_call with call_id "
                              f"{output.call_id!r} precedes this output", f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": output.call_id,
                             "content": _text(output.output, f"{where}.output")[0]})
        else:
            raise Invalid(f"{where}.type {kind!r} is not supported: agentd takes message, "
                          "function_call and function_call_output items", f"{where}.type")
    return ParsedInput(messages, breakpoints, frozenset(call_ids))


class _Message(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any]]
    type: str = "message"
    id: str | None = None
    status: str | None = None


class _FunctionCall(msgspec.Struct, kw_only=True):
    call_id: str
    name: str
    arguments: str
    type: str = "function_call"
    id: str | None = None
    status: str | None = None


class _FunctionCallOutput(msgspec.Struct, kw_only=True):
    call_id: str
    output: str | list[dict[str, Any]]
    type: str = "function_call_output"
    id: str | None = None
    status: str | None = None


def _convert(item: dict[str, Any], kind: type[Any], where: str) -> Any:
    try:
        return msgspec.convert(item, kind)
    except msgspec.ValidationError as exc:
        raise Invalid(f"{where}: {exc}", where) from exc


def _message(item: dict[str, Any], where: str
             ) -> tuple[dict[str, Any], list[tuple[int, float | None]]]:
    message = _convert(item, _Message, where)
    if message.role not in _ROLES:
        raise Invalid(f"{where}.role must be one of {', '.join(_ROLES)}, got {message.role!r}",
                      f"{where}.role")
    text, marks = _text(message.content, f"{where}.content")
    return {"role": message.role, "content": text}, marks


def _text(content: str | list[dict[str, Any]], where: str
          ) -> tuple[str | list[dict[str, Any]], list[tuple[int, float | None]]]:
    """Text parts as chat text parts, and the parts that carry a ``prompt_cache_breakpoint``."""
    if isinstance(content, str):
        return content, []
    parts: list[dict[str, Any]] = []
    marks: list[tuple[int, float | None]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise Invalid(f"{where}[{j}] must be a text part (input_text or output_text with a "
                          f"text); {kind!r} parts are not supported", f"{where}[{j}]")
        parts.append({"type": "text", "text": part["text"]})
        if (mark := part.get("prompt_cache_breakpoint")) is not None:
            marks.append((j, _breakpoint_ttl(mark, f"{where}[{j}].prompt_cache_breakpoint")))
    return parts, marks


def _breakpoint_ttl(mark: Any, where: str) -> float | None:
    if not isinstance(mark, dict) or mark.get("mode") != "explicit":
        raise Invalid(f'{where} must be {{"mode": "explicit", "ttl": ...}}', where)
    ttl = mark.get("ttl")
    return None if ttl is None else parse_ttl(ttl, dict(OPENAI_BREAKPOINT_TTLS), f"{where}.ttl")


def _add_call(messages: list[dict[str, Any]], call: dict[str, Any]) -> None:
    """A function_call joins the assistant turn before it, or opens one."""
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
        return
    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
