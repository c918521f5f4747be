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
from agentd.server.ignored_fields import Ignored
from agentd.server.response_store import StoredResponse
from agentd.server.wires.cache_control import OPENAI_BREAKPOINT_TTLS, openai_retention, parse_ttl
from agentd.server.wires.checks import check_max_tokens, check_range
from agentd.server.wires.constraints import Constraint, json_constraint, tool_constraint
from agentd.server.wires.plan import Plan
from agentd.server.wires.prompts import breakpoint_len, continuation_ids, render_ids
from agentd.server.wires.responses_tools import (
    ResponsesTools,
    additional_tools,
    custom_arguments,
    parse_tools,
)
from agentd.server.wires.responses_types import Response, ResponsesRequest
from agentd.server.wires.serving import new_request_id
from agentd.server.wires.tool_calls import ToolMode
from agentd.server.wires.tools import ToolSet
from agentd.structured.params import StructuredOutputsParams


@dataclass(frozen=True)
class ResponsesJob:
    plan: Plan
    shell: Response  # the reply, before output and usage
    instructions: str | None  # what the conversation's prompt holds (for continuations)
    tools: ResponsesTools = ResponsesTools(ToolSet(None, None, None))  # calls mapped back


def plan_responses(req: ResponsesRequest, engine: AsyncEngine, model: str, created: int,
                   previous: StoredResponse | None, keep: bool) -> ResponsesJob:
    """Validate ``req`` and build its prompt; ``keep``: the response will be stored."""
    notes = check_fields(req)
    tools_in = parse_tools(req.tools, additional_tools(req.input), req.tool_choice,
                           req.parallel_tool_calls)
    tool_set = tools_in.tool_set
    max_tokens = req.max_output_tokens
    if max_tokens is not None:
        check_max_tokens(max_tokens, "max_output_tokens")
    check_range(req.temperature, "temperature", 0.0, 2.0)
    check_range(req.top_p, "top_p", 0.0, 1.0, low_open=True)
    instructions = req.instructions
    if previous is not None and instructions == previous.instructions:
        instructions = None  # already in the stored prompt
    parsed = parse_input(req, instructions, frozenset(
        c["id"] for c in previous.function_calls) if previous else frozenset(), tools_in)
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
                prompt_param="input", max_tokens_param="max_output_tokens",
                ignored=(*notes, *tools_in.ignored, *parsed.ignored))
    shell = Response(
        id=request_id, created_at=created, model=model, status="in_progress", output=[],
        instructions=req.instructions, max_output_tokens=max_tokens,
        metadata=dict(req.metadata or {}), parallel_tool_calls=tool_set.parallel is True,
        previous_response_id=req.previous_response_id, prompt_cache_key=req.prompt_cache_key,
        store=keep, temperature=params.temperature, top_p=params.top_p,
        text={"format": _format_echo(req)}, tool_choice=_choice_echo(req.tool_choice),
        tools=list(req.tools or []), user=req.user, reasoning=_reasoning_echo(req.reasoning))
    kept_instructions = previous.instructions if previous is not None and \
        instructions is None else req.instructions
    return ResponsesJob(plan, shell, kept_instructions, tools_in)


# /v1/responses/compact: the conversation summed up by the model itself, as the text of a
# ``compaction`` item the client sends back in place of what it replaces.
COMPACT_PROMPT = ("Summarize the conversation above for your own later use: the task, what was "
                  "done and found (files, commands, results), decisions made, and what is left "
                  "to do. Be concise and concrete; write only the summary.")
COMPACTION_PREFIX = "Summary of the earlier conversation:\n"
COMPACT_MAX_TOKENS = 1024  # a summary longer than this is no compaction


def plan_compaction(req: ResponsesRequest, engine: AsyncEngine, model: str,
                    created: int, previous: StoredResponse | None) -> ResponsesJob:
    """The summary request of a compaction: the same conversation, no tools, then the ask."""
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else list(
        req.input or [])
    items.append({"role": "user", "content": COMPACT_PROMPT})
    cap = min(req.max_output_tokens or COMPACT_MAX_TOKENS, COMPACT_MAX_TOKENS)
    ask = msgspec.structs.replace(req, input=items, tools=None, tool_choice=None,
                                  parallel_tool_calls=None, stream=False, store=False,
                                  max_output_tokens=cap, text=None)
    return plan_responses(ask, engine, model, created, previous, keep=False)


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
                "top_logprobs": "logprobs"}
_EFFORTS = (None, "none", "minimal", "low", "medium", "high", "xhigh")
_SUMMARIES = (None, "none", "auto", "concise", "detailed")
NO_REASONING = ("this model has no reasoning template: it answers without reasoning "
                "(usage reports reasoning_tokens 0)")
# Input items only OpenAI's hosted tools and reasoning write: nothing here reads them.
_SKIPPED_ITEMS = {"reasoning": NO_REASONING, "additional_tools": None,
                  "web_search_call": "hosted tools do not run here",
                  "file_search_call": "hosted tools do not run here",
                  "image_generation_call": "hosted tools do not run here",
                  "code_interpreter_call": "hosted tools do not run here"}


_ROLES = ("user", "assistant", "system", "developer")


_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass(frozen=True)
class ParsedInput:
    """``input`` as chat messages, where each cache breakpoint sits, and the calls it holds."""

    messages: list[dict[str, Any]]
    breakpoints: list[tuple[int, int, float | None]]  # (message, part, ttl_s or None)
    call_ids: frozenset[str]
    ignored: tuple[Ignored, ...] = ()


def check_fields(req: ResponsesRequest) -> list[Ignored]:
    """Refuse what agentd cannot honour; return what it accepts and does not act on."""
    for name, what in _UNSUPPORTED.items():
        if getattr(req, name) not in (None, False, 0, {}):
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
    return _reasoning(req.reasoning)


def _reasoning(reasoning: dict[str, Any] | None) -> list[Ignored]:
    """Any effort and summary OpenAI defines: a model without a reasoning template answers
    without reasoning (a value OpenAI does not define is still a 400)."""
    if reasoning is None:
        return []
    effort, summary = reasoning.get("effort"), reasoning.get("summary")
    if effort not in _EFFORTS:
        raise Invalid(f"reasoning.effort must be one of {', '.join(map(str, _EFFORTS[1:]))}, "
                      f"got {effort!r}", "reasoning.effort")
    if summary not in _SUMMARIES:
        raise Invalid(f"reasoning.summary must be one of {', '.join(map(str, _SUMMARIES[1:]))}, "
                      f"got {summary!r}", "reasoning.summary")
    if effort in (None, "none") and summary in (None, "none"):
        return []
    return [Ignored("reasoning", NO_REASONING)]


def _reasoning_echo(reasoning: dict[str, Any] | None) -> dict[str, Any]:
    reasoning = reasoning or {}
    return {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")}


def _check_cache_fields(req: ResponsesRequest) -> None:
    openai_retention(req.prompt_cache_retention, req.prompt_cache_options, 1)  # 400s only
    if req.prompt_cache_options is not None and req.prompt_cache_options.prewarm:
        raise Invalid("prompt_cache_options.prewarm is not supported yet; omit it",
                      "prompt_cache_options.prewarm")


def parse_input(req: ResponsesRequest, instructions: str | None,
                known_call_ids: frozenset[str] = frozenset(),
                tools: ResponsesTools | None = None) -> ParsedInput:
    """``input`` as chat messages (``instructions`` first, as a system message); calls to the
    client's tools under the names the model knows them by (``tools``)."""
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    assert items is not None
    tools = tools or ResponsesTools(ToolSet(None, None, None))
    messages: list[dict[str, Any]] = []
    breakpoints: list[tuple[int, int, float | None]] = []
    ignored: list[Ignored] = []
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
        elif kind in ("function_call", "custom_tool_call"):
            call_ids.add(_history_call(messages, item, where, tools))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append(_call_output(item, where, call_ids))
        elif kind == "compaction":  # our own summary (``plan_compaction``), as the client kept it
            summary = item.get("encrypted_content")
            if not isinstance(summary, str):
                raise Invalid(f"{where}.encrypted_content must be a string", where)
            messages.append({"role": "user", "content": COMPACTION_PREFIX + summary})
        elif kind in _SKIPPED_ITEMS:
            if why := _SKIPPED_ITEMS[kind]:
                ignored.append(Ignored(f"input[] ({kind})", why))
        else:
            raise Invalid(f"{where}.type {kind!r} is not supported: agentd takes message, "
                          "function_call, custom_tool_call and their output items", f"{where}.type")
    return ParsedInput(messages, breakpoints, frozenset(call_ids), tuple(ignored))


def _history_call(messages: list[dict[str, Any]], item: dict[str, Any], where: str,
                  tools: ResponsesTools) -> str:
    """A call of an earlier turn, as the assistant's tool call; returns its call id."""
    if item["type"] == "custom_tool_call":
        custom = _convert(item, _CustomToolCall, where)
        call_id, name, arguments = custom.call_id, custom.name, custom_arguments(custom.input)
        namespace = custom.namespace
    else:
        call = _convert(item, _FunctionCall, where)
        call_id, name, arguments, namespace = call.call_id, call.name, call.arguments, \
            call.namespace
    _add_call(messages, {"id": call_id, "type": "function", "function": {
        "name": tools.flat_name(name, namespace), "arguments": arguments}})
    return call_id


def _call_output(item: dict[str, Any], where: str, call_ids: set[str]) -> dict[str, Any]:
    """A tool's result, as a tool message. Without a ``call_id`` (Codex's goal updates send
    none) it answers no call in particular."""
    output = _convert(item, _CallOutput, where)
    if output.call_id is not None and output.call_id not in call_ids:
        raise Invalid(f"{where}.call_id: no function_call with call_id {output.call_id!r} "
                      "precedes this output", f"{where}.call_id")
    message = {"role": "tool", "content": _text(output.output, f"{where}.output")[0]}
    if output.call_id is not None:
        message["tool_call_id"] = output.call_id
    return message


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
    namespace: str | None = None
    type: str = "function_call"
    id: str | None = None
    status: str | None = None


class _CustomToolCall(msgspec.Struct, kw_only=True):
    call_id: str
    name: str
    input: str
    namespace: str | None = None
    type: str = "custom_tool_call"
    id: str | None = None
    status: str | None = None


class _CallOutput(msgspec.Struct, kw_only=True):
    output: str | list[dict[str, Any]]
    call_id: str | None = None
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
