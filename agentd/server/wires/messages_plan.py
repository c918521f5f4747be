"""``to_plan`` for the Anthropic Messages API: a ``MessagesRequest`` becomes the internal
``Plan`` (or, for ``count_tokens``, just its prompt length).

Invariants: runs in a worker thread; raises only ``RequestValidationError`` (rendered in
Anthropic's shape by the route); the prompt is the chat route's rendering of the same
conversation, plus an assistant prefill's plain-text tokens when the last turn is the
assistant's; Anthropic's ranges hold (``temperature`` in [0, 1]), and ``max_tokens`` is
required: at least 1, or 0 to pre-warm the prompt (a plan of ``plan.prewarm_params``: its
output is dropped, nothing constrains it, and it is started like any other).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentd.async_engine import AsyncEngine
from agentd.chat import plain_text_ids
from agentd.request import EngineRequest, RetentionRequest
from agentd.sampling_params import SamplingParams
from agentd.server.constraints import Constraint, tool_constraint
from agentd.server.errors import RequestValidationError as Invalid
from agentd.server.serving import new_request_id
from agentd.server.tool_calls import ToolMode
from agentd.server.wires.anthropic_messages import (
    Conversation,
    MessagesRequest,
    parse_conversation,
)
from agentd.server.wires.checks import check_max_tokens, check_range
from agentd.server.wires.plan import Plan, prewarm_params
from agentd.server.wires.prompts import breakpoint_len, render_ids
from agentd.structured.params import StructuredOutputsParams


@dataclass(frozen=True)
class MessagesJob:
    plan: Plan
    stop_sequences: tuple[str, ...]
    prewarm: bool  # max_tokens: 0


def prompt_ids(req: MessagesRequest, engine: AsyncEngine) -> tuple[Conversation, list[int]]:
    """The conversation and its prompt token ids (what ``count_tokens`` counts)."""
    conv = parse_conversation(req)
    if not conv.messages or all(m["role"] == "system" for m in conv.messages):
        raise Invalid("messages: the conversation needs a user turn before the assistant's",
                      "messages")
    tools = conv.tools
    ids = render_ids(engine.tokenizer, conv.messages, tools.tools, tools.tool_choice,
                     "messages")
    if conv.prefill:
        ids += plain_text_ids(engine.tokenizer, conv.prefill)
    return conv, ids


def plan_messages(req: MessagesRequest, engine: AsyncEngine, model: str,
                  created: int) -> MessagesJob:
    if req.max_tokens is None:
        raise Invalid("max_tokens: Field required", "max_tokens")
    if req.max_tokens != 0:
        check_max_tokens(req.max_tokens, "max_tokens", engine.max_model_len)
    check_range(req.temperature, "temperature", 0.0, 1.0)
    check_range(req.top_p, "top_p", 0.0, 1.0, low_open=True)
    if req.top_k is not None and req.top_k < 0:
        raise Invalid(f"top_k must be >= 0, got {req.top_k}", "top_k")
    stops = tuple(req.stop_sequences or ())
    if any(not isinstance(s, str) or not s for s in stops):
        raise Invalid("stop_sequences must be non-empty strings", "stop_sequences")
    conv, ids = prompt_ids(req, engine)
    tools = conv.tools
    constraint = _output_format(req.output_config)
    if tools.on:
        constraint = tool_constraint(tools.tools or [], tools.tool_choice, tools.parallel,
                                     constraint)
    prewarm = req.max_tokens == 0
    params = prewarm_params() if prewarm else SamplingParams(
        max_tokens=req.max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k, stop=list(stops),
        ignore_eos=req.ignore_eos)
    if constraint is not None and not prewarm:  # a pre-warm generates nothing to constrain
        params.structured_outputs = constraint.params
    request = EngineRequest(ids, params, new_request_id("msg").replace("-", "_"),
                            req.cache_salt, retention=_retention(conv, engine.tokenizer, ids))
    plan = Plan(model=model, created=created, request=request,
                tool_mode=ToolMode.PARSE if tools.on else ToolMode.OFF,
                constraint=None if prewarm else constraint,
                prompt_cache_key=_user_id(req.metadata))
    return MessagesJob(plan, stops, prewarm)


def _output_format(config: dict[str, Any] | None) -> Constraint | None:
    """``output_config.format``: ``{"type": "json_schema", "schema": ...}`` constrains the
    reply's text (``effort`` is accepted and changes nothing here)."""
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(
            fmt.get("schema"), dict):
        raise Invalid('output_config.format must be {"type": "json_schema", "schema": {...}}',
                      "output_config.format")
    return Constraint(StructuredOutputsParams(json=fmt["schema"]), "output_config.format")


def _retention(conv: Conversation, tokenizer: Any, ids: list[int]) -> RetentionRequest | None:
    """Top-level ``cache_control`` keeps the whole prompt; else the last marked block's
    prefix."""
    if conv.whole_ttl_s is not None:
        return RetentionRequest(len(ids), conv.whole_ttl_s)
    if not conv.breakpoints:
        return None
    index, part, ttl_s = conv.breakpoints[-1]
    tools = conv.tools
    num_tokens = breakpoint_len(tokenizer, conv.messages, tools.tools, tools.tool_choice, ids,
                                (index, part))
    return RetentionRequest(num_tokens, ttl_s)


def _user_id(metadata: dict[str, Any] | None) -> str | None:
    """Anthropic's ``metadata.user_id`` names the agent or conversation, as
    ``prompt_cache_key`` does on OpenAI's wire: stats by key."""
    user_id = (metadata or {}).get("user_id")
    return user_id if isinstance(user_id, str) and user_id else None
