"""The OpenAI Chat Completions wire's adapter: a ``ChatCompletionRequest`` checked and rendered
into the internal ``Plan`` (its replies: :mod:`agentd.server.wires.chat_reply`).

Invariants: runs in a worker thread (templating and tokenising never block the event loop);
raises ``RequestValidationError`` or ``APIError`` (400, naming the field) for the first thing
wrong, before anything reaches the engine: known fields agentd does not support (``n > 1``,
logprobs, ``logit_bias``) are refused by name. Tools and formats: with tools on, the turn is
grammar-constrained (``agentd.structured``): ``required`` or a named function makes it calls only,
``auto`` lets it open with text; ``response_format`` / ``structured_outputs`` constrain the
text. A turn holds one call unless the client sends ``parallel_tool_calls: true`` (OpenAI
defaults to several): offered another call after the first, small models repeat it until
max_tokens — SmolLM2 called ``list_dir`` with the same arguments until its 120 tokens ran out —
and an agent would run each repeat. Cache fields: ``prompt_cache_retention: "24h"`` and
``prompt_cache_options`` retain the prompt (``agentd.server.wires.cache_control``);
``prompt_cache_key`` names the conversation or agent for near-miss reports and key stats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from agentd.chat import render_chat
from agentd.engine.request import EngineRequest
from agentd.engine.sampling_params import SamplingParams
from agentd.server.errors import APIError, RequestValidationError
from agentd.server.wires.cache_control import openai_retention
from agentd.server.wires.chat_types import ChatCompletionRequest, ChatMessage, ToolChoiceNamed
from agentd.server.wires.checks import (
    check_max_tokens,
    check_sampling,
    check_tools,
    stop_list,
)
from agentd.server.wires.completions_types import CompletionRequest
from agentd.server.wires.constraints import output_format, tool_constraint
from agentd.server.wires.plan import Plan
from agentd.server.wires.serving import new_request_id
from agentd.server.wires.tool_calls import ToolMode

TOOL_CHOICE_STRINGS = ("none", "auto", "required")
ROLES = ("system", "developer", "user", "assistant", "tool")


def plan_chat(req: ChatCompletionRequest, engine: Any, model: str, created: int) -> Plan:
    """Validate ``req`` and render it to token ids; raises OpenAI-shaped 400 errors."""
    validate_chat_request(req)
    inputs = to_template_inputs(req)
    try:
        rendered = render_chat(engine.tokenizer, inputs.messages, inputs.tools,
                               inputs.tool_choice)
    except Exception as exc:  # jinja raises for conversations the template refuses
        raise APIError(400, f"the chat template rejected the messages: {exc}",
                       param="messages") from exc
    tools_on = bool(inputs.tools) and inputs.tool_choice != "none"
    constraint = output_format(req)
    if tools_on:
        constraint = tool_constraint(inputs.tools or [], inputs.tool_choice,
                                     req.parallel_tool_calls, constraint)
    prompt_token_ids = list(rendered.prompt_token_ids)
    try:
        params = to_sampling_params(req, None)
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
    if constraint is not None:
        params.structured_outputs = constraint.params
    retention = openai_retention(req.prompt_cache_retention, req.prompt_cache_options,
                                 len(prompt_token_ids))
    return Plan(
        model=model, created=created,
        request=EngineRequest(prompt_token_ids, params, new_request_id("chatcmpl"),
                              req.cache_salt, retention=retention),
        tool_mode=ToolMode.PARSE if tools_on else ToolMode.OFF, constraint=constraint,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        prompt_cache_key=req.prompt_cache_key,
    )


def validate_chat_request(req: ChatCompletionRequest) -> None:
    """Raise ``RequestValidationError`` for the first thing wrong with ``req``."""
    if not req.messages:
        raise RequestValidationError("messages must contain at least one message", "messages")
    for i, message in enumerate(req.messages):
        _check_message(message, f"messages[{i}]")
    if req.max_completion_tokens is not None:
        check_max_tokens(req.max_completion_tokens, "max_completion_tokens")
    if req.logprobs:
        raise RequestValidationError(
            "logprobs is not supported; omit it or set it to false", "logprobs"
        )
    if req.top_logprobs:
        raise RequestValidationError("top_logprobs is not supported; omit it", "top_logprobs")
    check_sampling(req)
    tool_names = check_tools(req.tools or [])
    _check_tool_choice(req.tool_choice, tool_names)


def _check_message(message: ChatMessage, where: str) -> None:
    if message.role not in ROLES:
        allowed = ", ".join(ROLES)
        raise RequestValidationError(
            f"{where}.role must be one of {allowed}, got {message.role!r}", f"{where}.role"
        )
    content = message.content
    if content is None and message.role != "assistant":
        raise RequestValidationError(
            f"{where}.content is required for role {message.role!r}", f"{where}.content"
        )
    if isinstance(content, list):
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise RequestValidationError(
                    f'{where}.content[{j}] must be a text part ({{"type": "text", "text": '
                    f"...}}); got type {part.type!r}",
                    f"{where}.content[{j}]",
                )
    if message.role == "tool" and not message.tool_call_id:
        raise RequestValidationError(
            f"{where}.tool_call_id is required for a message with role 'tool'",
            f"{where}.tool_call_id",
        )
    if message.tool_calls and message.role != "assistant":
        raise RequestValidationError(
            f"{where}.tool_calls is allowed only on assistant messages", f"{where}.tool_calls"
        )
    for j, call in enumerate(message.tool_calls or []):
        if call.type != "function" or not call.function.name:
            raise RequestValidationError(
                f"{where}.tool_calls[{j}] must have type 'function' and a function name",
                f"{where}.tool_calls[{j}]",
            )


def _check_tool_choice(tool_choice: str | ToolChoiceNamed | None, tool_names: list[str]) -> None:
    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    if isinstance(tool_choice, str) and tool_choice not in TOOL_CHOICE_STRINGS:
        raise RequestValidationError(
            f"tool_choice must be one of {', '.join(TOOL_CHOICE_STRINGS)} or "
            f'{{"type": "function", "function": {{"name": ...}}}}, got {tool_choice!r}',
            "tool_choice",
        )
    if not tool_names:
        raise RequestValidationError(
            "tool_choice requires tools; pass tools or omit tool_choice", "tool_choice"
        )
    if isinstance(tool_choice, ToolChoiceNamed) and tool_choice.function.name not in tool_names:
        raise RequestValidationError(
            f"tool_choice names the function {tool_choice.function.name!r}, which is not in "
            f"tools ({', '.join(tool_names)})",
            "tool_choice",
        )


def to_sampling_params(
    req: ChatCompletionRequest | CompletionRequest, default_max_tokens: int | None
) -> SamplingParams:
    """OpenAI defaults: temperature 1, top_p 1; ``max_completion_tokens`` wins over
    ``max_tokens``; ``default_max_tokens`` applies when neither is given."""
    max_tokens = getattr(req, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = req.max_tokens
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        stop=stop_list(req.stop),
        ignore_eos=req.ignore_eos,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
    )


@dataclass(frozen=True)
class TemplateInputs:
    """A chat request as plain OpenAI-shaped dicts, ready for ``agentd.chat.render_chat``."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: str | dict[str, Any] | None


def to_template_inputs(req: ChatCompletionRequest) -> TemplateInputs:
    """Unset (None) fields are dropped, so templates that test ``'key' in message`` behave."""
    return TemplateInputs(
        messages=msgspec.to_builtins(req.messages),
        tools=msgspec.to_builtins(req.tools) if req.tools is not None else None,
        tool_choice=msgspec.to_builtins(req.tool_choice),
    )
