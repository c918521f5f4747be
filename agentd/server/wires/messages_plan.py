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

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from agentd.chat import plain_text_ids
from agentd.engine.async_engine import AsyncEngine
from agentd.engine.request import EngineRequest, RetentionRequest
from agentd.engine.sampling_params import SamplingParams
from agentd.server.errors import RequestValidationError as Invalid
from agentd.server.ignored_fields import Ignored
from agentd.server.wires.cache_control import ANTHROPIC_TTLS, parse_ttl
from agentd.server.wires.checks import ANTHROPIC_TOO_LONG, check_max_tokens, check_range
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
    try:
        ids = render_ids(engine.tokenizer, conv.messages, tools.tools, tools.tool_choice,
                         "messages")
    except Invalid:
        if not any(m["role"] == "system" for m in conv.messages[1:]):
            raise
        conv = _fold_system(conv)  # a template that takes system text at the top only
        ids = render_ids(engine.tokenizer, conv.messages, tools.tools, tools.tool_choice,
                         "messages")
    if conv.prefill:
        ids += plain_text_ids(engine.tokenizer, conv.prefill)
    return conv, ids


def _fold_system(conv: Conversation) -> Conversation:
    """``conv`` with its later system messages folded into the first one's text, in their
    order (the cache breakpoints on them move with their text)."""
    first = conv.messages[0] if conv.messages[0]["role"] == "system" else None
    parts = _parts(first["content"]) if first else []
    kept: list[dict[str, Any]] = []
    moved: dict[int, int] = {}  # old message index -> new index (or -(1 + part offset))
    for i, message in enumerate(conv.messages):
        if message is first:
            moved[i] = 0
        elif message["role"] == "system":
            moved[i] = -(1 + len(parts))
            parts += _parts(message["content"])
        else:
            moved[i] = len(kept) + 1
            kept.append(message)
    breakpoints = [(i if i == TOOLS_CUT else moved[i] if moved[i] >= 0 else 0,
                    part if i == TOOLS_CUT or moved[i] >= 0 else part - moved[i] - 1, ttl)
                   for i, part, ttl in conv.breakpoints]
    note = Ignored("messages[].role", "system messages after the first turn: this model's "
                   "template takes system text at the top only, so they were folded into it, "
                   "in order")
    return dataclasses.replace(conv, messages=[{"role": "system", "content": parts}, *kept],
                               breakpoints=breakpoints, ignored=[*conv.ignored, note])


def _parts(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def plan_messages(req: MessagesRequest, engine: AsyncEngine, model: str,
                  created: int) -> MessagesJob:
    if req.max_tokens is None:
        raise Invalid("max_tokens: Field required", "max_tokens")
    if req.max_tokens != 0:
        check_max_tokens(req.max_tokens, "max_tokens")
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
                user_id=_user_id(req.metadata), too_long=ANTHROPIC_TOO_LONG,
                ignored=tuple(conv.ignored), keepalive=PING)
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


_REFUSED_BLOCKS = {"image": "images", "document": "documents", "search_result": "search results",
                   "server_tool_use": "server tools", "web_search_tool_result": "server tools"}
# The model's own reasoning from earlier turns, sent back as the API asks: no template here
# renders it, so it leaves the prompt (a model that does not think never wrote any).
_THINKING_BLOCKS = ("thinking", "redacted_thinking")
_THINKING_TYPES = ("disabled", "enabled", "adaptive")
PING = b'event: ping\ndata: {"type": "ping"}\n\n'  # Anthropic's keep-alive event
_EFFORTS = ("low", "medium", "high", "xhigh", "max")
NO_THINKING = "this model has no thinking template: it answers without thinking"


@dataclass
class Conversation:
    """The request as chat messages, where its cache breakpoints sit, and any prefill."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: ToolSet = field(default_factory=lambda: ToolSet(None, None, None))
    # (chat message index or TOOLS_CUT, part index, ttl_s); the last one counts
    breakpoints: list[tuple[int, int, float]] = field(default_factory=list)
    prefill: str | None = None
    whole_ttl_s: float | None = None  # top-level cache_control: the whole prompt
    ignored: list[Ignored] = field(default_factory=list)  # accepted, and a no-op here


def cache_ttl(mark: Any, where: str) -> float:
    """A ``cache_control`` mark's TTL in seconds; a 400 for anything but Anthropic's shape."""
    if not isinstance(mark, dict) or mark.get("type") != "ephemeral":
        raise Invalid(f'{where}.type must be "ephemeral", got '
                      f"{mark.get('type') if isinstance(mark, dict) else mark!r}", f"{where}.type")
    ttl_s = parse_ttl(mark.get("ttl", "5m"), dict(ANTHROPIC_TTLS), f"{where}.ttl")
    assert ttl_s is not None
    return ttl_s


BILLING_PREFIX = "x-anthropic-billing-header:"
BILLING_WHY = ("Claude Code's billing line, for Anthropic's API: left out of the prompt (its "
               "per-prompt hash would make every prompt miss the cache)")


def parse_conversation(req: MessagesRequest) -> Conversation:
    """Everything but sampling: checked and converted (a 400 for the first thing wrong)."""
    for name, what in _UNSUPPORTED.items():
        if getattr(req, name) is not None:
            raise Invalid(f"{name}: {what} are not supported by agentd; omit {name}", name)
    if not req.messages:
        raise Invalid("messages: at least one message is required", "messages")
    conv = Conversation(tools=anthropic_tools(req.tools, req.tool_choice))
    conv.ignored += _thinking(req.thinking) + _effort(req.output_config)
    if req.context_management is not None:
        conv.ignored.append(Ignored("context_management", "nothing to clear: no thinking is "
                                    "kept, and the prompt is the client's to trim"))
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


def _thinking(thinking: dict[str, Any] | None) -> list[Ignored]:
    """Extended thinking asked of a model without a thinking template: answered without it."""
    if thinking is None:
        return []
    kind = thinking.get("type")
    if kind not in _THINKING_TYPES:
        raise Invalid(f"thinking.type must be one of {', '.join(_THINKING_TYPES)}, got {kind!r}",
                      "thinking.type")
    budget = thinking.get("budget_tokens")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool)):
        raise Invalid(f"thinking.budget_tokens must be an integer, got {budget!r}",
                      "thinking.budget_tokens")
    return [] if kind == "disabled" else [Ignored("thinking", NO_THINKING)]


def _effort(config: dict[str, Any] | None) -> list[Ignored]:
    effort = (config or {}).get("effort")
    if effort is None:
        return []
    if effort not in _EFFORTS:
        raise Invalid(f"output_config.effort must be one of {', '.join(_EFFORTS)}, got "
                      f"{effort!r}", "output_config.effort")
    return [Ignored("output_config.effort", "one effort here: the model's own")]


def _system(conv: Conversation, system: str | list[dict[str, Any]], where: str = "system") -> None:
    """System text, at the top or where a message of role ``system`` put it; Claude Code's
    billing line (``x-anthropic-billing-header: ...``, a per-prompt hash for Anthropic's API,
    not text for the model) is left out, so that no two prompts differ in their first block."""
    if isinstance(system, str):
        if system.startswith(BILLING_PREFIX):
            conv.ignored.append(Ignored(where, BILLING_WHY))
            system = system.partition("\n")[2]
        conv.messages.append({"role": "system", "content": system})
        return
    if not isinstance(system, list):
        raise Invalid(f"{where} must be a string or text blocks", where)
    index = len(conv.messages)
    parts = []
    for j, block in enumerate(system):
        part, ttl = _text_block(block, f"{where}.{j}")
        if part["text"].startswith(BILLING_PREFIX):
            conv.ignored.append(Ignored(f"{where}.{j}", BILLING_WHY))
        else:
            parts.append((part, ttl))
    if not parts:
        return
    conv.breakpoints += [(index, j, ttl) for j, (_, ttl) in enumerate(parts) if ttl is not None]
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
    if role not in ("user", "assistant", "system"):
        raise Invalid(f"{where}.role must be \"user\", \"assistant\" or \"system\", got "
                      f"{role!r}", f"{where}.role")
    if content is None:
        raise Invalid(f"{where}.content: Field required", f"{where}.content")
    if role == "system":  # mid-conversation system text, rendered where it was sent
        _system(conv, content, f"{where}.content")
        return set()
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
        if kind in _THINKING_BLOCKS:
            conv.ignored.append(Ignored(f"{where}.{j}", NO_THINKING))
            continue
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
