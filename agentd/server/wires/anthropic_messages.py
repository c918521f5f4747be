"""The Anthropic Messages API request (``POST /v1/messages``, ``/v1/messages/count_tokens``)
and its translation into OpenAI-shaped chat messages and a plan.

Invariants: ``system`` (a string or text blocks) and ``messages`` (user/assistant turns of
``text``, ``tool_use`` and ``tool_result`` blocks) become the chat route's messages: a user
turn's ``tool_result`` blocks become tool messages, each answering a ``tool_use`` of the
assistant turn right before it (else a 400); an assistant turn's ``tool_use`` blocks become its
tool calls. A final assistant turn of text is a prefill the reply continues. Every block type,
tool kind and field agentd cannot honour is a 400 naming it (Anthropic's ``messages.0.content.1``
paths). ``cache_control`` marks (``{"type": "ephemeral", "ttl": "5m" | "1h"}``) on system,
tool and message blocks, and at the top level, are validated and the last one becomes the
plan's retention request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import msgspec

from agentd.server.errors import RequestValidationError as Invalid
from agentd.server.retention import ANTHROPIC_TTLS, parse_ttl
from agentd.server.wires.prompts import TOOLS_CUT
from agentd.server.wires.tools import ToolSet, anthropic_tools

_UNSUPPORTED = {"container": "code-execution containers", "mcp_servers": "MCP servers"}
_REFUSED_BLOCKS = {"image": "images", "document": "documents", "thinking": "thinking blocks",
                   "redacted_thinking": "thinking blocks", "search_result": "search results",
                   "server_tool_use": "server tools", "web_search_tool_result": "server tools"}


class MessagesRequest(msgspec.Struct, kw_only=True):
    messages: list[dict[str, Any]] | None = None
    model: str | None = None
    max_tokens: int | None = None
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    stream: bool = False
    cache_control: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    service_tier: str | None = None
    container: Any = None
    mcp_servers: Any = None
    output_config: dict[str, Any] | None = None  # format: a JSON schema for the reply
    # accepted and ignored: they change nothing a local model does
    diagnostics: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    cache_salt: str | None = None  # vLLM extension, as on chat
    ignore_eos: bool = False  # vLLM extension, as on chat


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
