"""``to_plan`` for the Responses API: a validated ``ResponsesRequest`` (and the stored response
it continues, if any) becomes the internal ``Plan`` and the ``Response`` shell its reply fills.

Invariants: runs in a worker thread (templating and tokenising never block the event loop);
raises only ``RequestValidationError`` (rendered in the route's shape); with a previous
response the prompt is its stored token ids plus the new items (``continuation_ids``), and its
instructions are those it started with — new, different instructions join the new items as a
system message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentd.async_engine import AsyncEngine
from agentd.request import EngineRequest, RetentionRequest
from agentd.sampling_params import SamplingParams
from agentd.server.constraints import Constraint, tool_constraint
from agentd.server.errors import RequestValidationError
from agentd.server.retention import OPENAI_BREAKPOINT_TTLS, openai_retention
from agentd.server.serving import new_request_id
from agentd.server.tool_calls import ToolMode
from agentd.server.wires.checks import check_max_tokens, check_range
from agentd.server.wires.openai_responses import ParsedInput, ResponsesRequest, check_fields
from agentd.server.wires.openai_responses import parse_input as parse_items
from agentd.server.wires.plan import Plan
from agentd.server.wires.prompts import breakpoint_len, continuation_ids, render_ids
from agentd.server.wires.response_store import StoredResponse
from agentd.server.wires.responses_types import Response
from agentd.structured.params import StructuredOutputsParams, strict_schema


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
    parsed = parse_items(req, instructions, frozenset(
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
        raise RequestValidationError("text.format.type must be text, json_object or "
                                     f"json_schema, got {fmt.type!r}", "text.format.type")
    if fmt.schema is None:
        raise RequestValidationError('text.format of type "json_schema" needs a schema',
                                     "text.format.schema")
    schema = strict_schema(fmt.schema) if fmt.strict else fmt.schema
    return Constraint(StructuredOutputsParams(json=schema), "text.format")


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
