"""``to_plan`` for the Anthropic Messages API: a ``MessagesRequest`` becomes the internal
``Plan`` (or, for ``count_tokens``, just its prompt length).

Invariants: runs in a worker thread; raises only ``RequestValidationError`` (rendered in
Anthropic's shape by the route). ``system`` (a string or text blocks) and ``messages``
(user/assistant turns of ``text``, ``tool_use`` and ``tool_result`` blocks) become the chat
route's messages: a user turn's ``tool_result`` blocks become tool messages, each answering a
``tool_use`` of the assistant turn right before it (else a 400); an assistant turn's
``tool_use`` blocks become its tool calls. A final assistant turn of text is a prefill the reply
continues (its plain-text tokens follow the rendered prompt). Every block type, tool kind and
field agentd cannot honour is a 400 naming it (Anthropic's ``messages.0.content.1`` paths).
``cache_control`` marks (``{"type": "ephemeral", "ttl": "5m" | "1h"}``) on system, tool and
message blocks, and at the top level, are validated and the last one becomes the plan's
retention request. Anthropic's ranges hold (``temperature`` in [0, 1]), and ``max_tokens`` is
required: at least 1, or 0 to pre-warm the prompt (a plan of ``plan.prewarm_params``: its
output is dropped, nothing constrains it, and it is started like any other).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from agentd.chat import plain_text_ids
from agentd.engine.async_engine import AsyncEngine
from agentd.engine.request import EngineRequest, RetentionRequest
from agentd.engine.sampling_params import SamplingParams
from agentd.server.errors import RequestValidationError as Invalid
from agentd.server.wires.cache_control import ANTHROPIC_TTLS, parse_ttl
from agentd.server.wires.checks import check_max_tokens, check_range
from agentd.server.wires.constraints import Constraint, json_constraint, tool_constraint
from agentd.server.wires.messages_types import MessagesRequest
from agentd.server.wires.plan import Plan, prewarm_params
from agentd.server.wires.prompts import TOOLS_CUT, breakpoint_len, render_ids
from agentd.server.wires.serving import new_request_id
from agentd.server.wires.tool_calls import ToolMode
from agentd.server.wires.tools import ToolSet, anthropic_tools


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
    return json_constraint(fmt["schema"], "output_config.format")


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


_UNSUPPORTED = {"container": "code-execution containers", "mcp_servers": "MCP servers"}


_REFUSED_BLOCKS = {"image": "images", "document": "documents", "thinking": "thinking blocks",
                   "redacted_thinking": "thinking blocks", "search_result": "search results",
                   "server_tool_use": "server tools", "web_search_tool_result": "server tools"}


@dataclass
class Conversation:
    """The request as chat messages, where its cache breakpoints sit, and any prefill."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: ToolSet = field(default_factory=lambda: ToolSet(None, None, None))
    # (chat message index or TOOLS_CUT, part index, ttl_s); the last one counts
    breakpoints: list[tuple[int, int, float]] = field(default_factory=list)
    prefill: str | None = None
    whole_ttl_s: float | None = None  # top-level cache_control: the whole prompt


def cache_ttl(mark: Any, where: str) -> float:
    """A ``cache_control`` mark's TTL in seconds; a 400 for anything but Anthropic's shape."""
    if not isinstance(mark, dict) or mark.get("type") != "ephemeral":
        raise Invalid(f'{where}.type must be "ephemeral", got '
                      f"{mark.get('type') if isinstance(mark, dict) else mark!r}", f"{where}.type")
    ttl_s = parse_ttl(mark.get("ttl", "5m"), dict(ANTHROPIC_TTLS), f"{where}.ttl")
    assert ttl_s is not None
    return ttl_s


def parse_conversation(req: MessagesRequest) -> Conversation:
    """Everything but sampling: checked and converted (a 400 for the first thing wrong)."""
    for name, what in _UNSUPPORTED.items():
        if getattr(req, name) is not None:
            raise Invalid(f"{name}: {what} are not supported by agentd; omit {name}", name)
    if req.thinking is not None and req.thinking.get("type") != "disabled":
        raise Invalid("thinking: extended thinking is not supported by this model; omit it or "
                      'send {"type": "disabled"}', "thinking")
    if not req.messages:
        raise Invalid("messages: at least one message is required", "messages")
    conv = Conversation(tools=anthropic_tools(req.tools, req.tool_choice))
    for i, tool in enumerate(req.tools or []):
        if "cache_control" in tool and tool["cache_control"] is not None:
            conv.breakpoints.append((TOOLS_CUT, 0, cache_ttl(tool["cache_control"],
                                                             f"tools.{i}.cache_control")))
    if req.system is not None:
        _system(conv, req.system)
    previous_calls: set[str] = set()
    for i, message in enumerate(req.messages):
        previous_calls = _message(conv, message, f"messages.{i}", previous_calls,
                                  last=i == len(req.messages) - 1)
    if req.cache_control is not None:
        conv.whole_ttl_s = cache_ttl(req.cache_control, "cache_control")
    return conv


def _system(conv: Conversation, system: str | list[dict[str, Any]]) -> None:
    if isinstance(system, str):
        conv.messages.append({"role": "system", "content": system})
        return
    parts = [_text_block(block, f"system.{j}") for j, block in enumerate(system)]
    conv.breakpoints += [(0, j, ttl) for j, (_, ttl) in enumerate(parts) if ttl is not None]
    conv.messages.append({"role": "system", "content": [p for p, _ in parts]})


def _text_block(block: Any, where: str) -> tuple[dict[str, Any], float | None]:
    if not isinstance(block, dict) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise Invalid(f"{where}.type must be \"text\" here, got {kind!r}", f"{where}.type")
    if not isinstance(block.get("text"), str):
        raise Invalid(f"{where}.text: Field required (a string)", f"{where}.text")
    ttl = None
    if block.get("cache_control") is not None:
        ttl = cache_ttl(block["cache_control"], f"{where}.cache_control")
    return {"type": "text", "text": block["text"]}, ttl


def _message(conv: Conversation, message: Any, where: str, previous_calls: set[str],
             last: bool) -> set[str]:
    """Add one turn; returns the tool_use ids it holds (what the next turn may answer)."""
    if not isinstance(message, dict):
        raise Invalid(f"{where} must be an object with role and content", where)
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant"):
        hint = " (put system text in the top-level system field)" if role == "system" else ""
        raise Invalid(f"{where}.role must be \"user\" or \"assistant\", got {role!r}{hint}",
                      f"{where}.role")
    if content is None:
        raise Invalid(f"{where}.content: Field required", f"{where}.content")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(blocks, list):
        raise Invalid(f"{where}.content must be a string or a list of blocks", f"{where}.content")
    if role == "assistant":
        return _assistant(conv, blocks, f"{where}.content", last)
    _user(conv, blocks, f"{where}.content", previous_calls)
    return set()


def _user(conv: Conversation, blocks: list[Any], where: str, previous_calls: set[str]) -> None:
    texts: list[tuple[dict[str, Any], float | None]] = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            conv.messages.append(_tool_result(conv, block, f"{where}.{j}", previous_calls))
        elif kind in ("tool_use",):
            raise Invalid(f"{where}.{j}: tool_use blocks belong in assistant turns",
                          f"{where}.{j}.type")
        else:
            _refuse(kind, f"{where}.{j}")
            texts.append(_text_block(block, f"{where}.{j}"))
    if not texts and blocks:
        return
    if not blocks:
        raise Invalid(f"{where}: a user turn needs at least one block", where)
    conv.breakpoints += [(len(conv.messages), j, ttl) for j, (_, ttl) in enumerate(texts)
                         if ttl is not None]
    conv.messages.append({"role": "user", "content": [part for part, _ in texts]})


def _tool_result(conv: Conversation, block: dict[str, Any], where: str,
                 previous_calls: set[str]) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if call_id not in previous_calls:
        raise Invalid(f"{where}: tool_result block(s) found without a corresponding tool_use "
                      f"block with id {call_id!r} in the assistant turn right before it",
                      f"{where}.tool_use_id")
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n".join(_text_block(b, f"{where}.content.{k}")[0]["text"]
                            for k, b in enumerate(content))
    elif not isinstance(content, str):
        raise Invalid(f"{where}.content must be a string or text blocks", f"{where}.content")
    if block.get("cache_control") is not None:
        conv.breakpoints.append((len(conv.messages), 0,
                                 cache_ttl(block["cache_control"], f"{where}.cache_control")))
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _assistant(conv: Conversation, blocks: list[Any], where: str, last: bool) -> set[str]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    index = len(conv.messages)
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use":
            calls.append(_tool_use(block, f"{where}.{j}"))
        elif kind == "tool_result":
            raise Invalid(f"{where}.{j}: tool_result blocks belong in user turns",
                          f"{where}.{j}.type")
        else:
            _refuse(kind, f"{where}.{j}")
            part, ttl = _text_block(block, f"{where}.{j}")
            texts.append(part["text"])
            if ttl is not None:
                conv.breakpoints.append((index, 0, ttl))
        if kind == "tool_use" and block.get("cache_control") is not None:
            conv.breakpoints.append((index, 0, cache_ttl(block["cache_control"],
                                                          f"{where}.{j}.cache_control")))
    if last and not calls:
        conv.prefill = "".join(texts)
        return set()
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    conv.messages.append(message)
    return {call["id"] for call in calls}


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    for name in ("id", "name"):
        if not isinstance(block.get(name), str) or not block[name]:
            raise Invalid(f"{where}.{name}: Field required (a string)", f"{where}.{name}")
    if not isinstance(block.get("input"), dict):
        raise Invalid(f"{where}.input must be an object", f"{where}.input")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"])}}


def _refuse(kind: Any, where: str) -> None:
    if kind in _REFUSED_BLOCKS:
        raise Invalid(f"{where}: {kind} blocks ({_REFUSED_BLOCKS[kind]}) are not supported by "
                      "agentd", f"{where}.type")
    if kind != "text":
        raise Invalid(f"{where}.type: unknown content block type {kind!r}; agentd takes text, "
                      "tool_use and tool_result blocks", f"{where}.type")
