"""The OpenAI Responses API request (``POST /v1/responses``) and its translation into a plan.

Invariants: ``input`` (a string or a list of ``message``, ``function_call`` and
``function_call_output`` items) becomes OpenAI-shaped chat messages for the chat route's
templates; every item, part, tool and field agentd cannot honour is a 400 naming it (by its
``param`` path) before anything reaches the engine. With ``previous_response_id`` the prompt is
the stored response's exact token ids followed by the new items only (never a re-render), so
the whole earlier conversation is a prefix-cache hit by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from agentd.server.errors import RequestValidationError as Invalid
from agentd.server.retention import OPENAI_BREAKPOINT_TTLS, openai_retention, parse_ttl
from agentd.server.wires.openai_types import PromptCacheOptions
from agentd.server.wires.tools import ToolSet, responses_tools

# Fields OpenAI defines that agentd does not serve: a 400 naming each when set.
_UNSUPPORTED = {"background": "background responses", "conversation": "the Conversations API",
                "prompt": "prompt templates", "max_tool_calls": "max_tool_calls",
                "top_logprobs": "logprobs", "reasoning": "reasoning (this is not a reasoning "
                "model; effort \"none\" is accepted)"}
_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")


class TextFormat(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    input: str | list[dict[str, Any]] | None = None
    model: str | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    truncation: str | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    reasoning: dict[str, Any] | None = None
    cache_salt: str | None = None  # vLLM extension, as on chat
    ignore_eos: bool = False  # vLLM extension, as on chat


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
