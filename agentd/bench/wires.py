"""The wires ``agentd bench --api`` can speak: OpenAI chat completions (the default), the OpenAI
Responses API and the Anthropic Messages API — each a request body built from the workload's
OpenAI-shaped messages and tools, and a reader of its streamed events.

Invariant: the same conversation reaches the server on every wire (system text, turns, tool
calls and results, tools), greedy and streamed, so the wires' figures compare; a reader says
whether an event carries content (the first one is the TTFT) and reports usage in one shape:
prompt tokens (all of them), cached prompt tokens (None when the server does not say) and
output tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

APIS = ("chat", "responses", "messages")
PATHS = {"chat": "/chat/completions", "responses": "/responses", "messages": "/messages"}


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    output_tokens: int | None = None


def tools_as_text(messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with ``tools`` written at the head of the system text as agentd's own tools
    block, as agentd renders them for a chat template without tools: every server then reads
    the same prompt tokens, whatever its template does with a ``tools`` field (SmolLM2's
    drops it)."""
    from agentd.chat import prefix_system, tools_block

    if not tools:
        return messages
    out = [dict(message) for message in messages]
    prefix_system(out, tools_block(tools))
    return out


def build_body(api: str, model: str, messages: list[dict[str, Any]],
               tools: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    """A greedy, streamed request for ``api`` (agentd's extensions are added by the caller)."""
    if api == "responses":
        body = _responses(messages, tools)
        body.update(max_output_tokens=max_tokens, store=False)
    elif api == "messages":
        body = _messages(messages, tools)
        body["max_tokens"] = max_tokens
    else:
        body = {"messages": messages, "stream_options": {"include_usage": True},
                "max_tokens": max_tokens, **({"tools": tools} if tools else {})}
    return {"model": model, "temperature": 0, "stream": True, **body}


def _responses(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
    items: list[dict[str, Any]] = []
    instructions = None
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "system" and instructions is None and not items:
            instructions = content
        elif role == "tool":
            items.append({"type": "function_call_output", "call_id": message["tool_call_id"],
                          "output": content})
        else:
            if content:
                items.append({"role": role, "content": content})
            items += [{"type": "function_call", "call_id": call["id"],
                       "name": call["function"]["name"],
                       "arguments": call["function"]["arguments"]}
                      for call in message.get("tool_calls") or []]
    body: dict[str, Any] = {"input": items}
    if instructions is not None:
        body["instructions"] = instructions
    if tools:
        body["tools"] = [{"type": "function", **tool["function"]} for tool in tools]
    return body


def _messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
    turns: list[dict[str, Any]] = []
    system = None
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "system" and system is None and not turns:
            system = content
            continue
        blocks: list[dict[str, Any]] = []
        if role == "tool":
            role = "user"
            blocks.append({"type": "tool_result", "tool_use_id": message["tool_call_id"],
                           "content": content})
        elif content:
            blocks.append({"type": "text", "text": content})
        blocks += [{"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                    "input": json.loads(call["function"]["arguments"] or "{}")}
                   for call in message.get("tool_calls") or []]
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"] += blocks  # consecutive tool results: one user turn
        else:
            turns.append({"role": role, "content": blocks})
    body: dict[str, Any] = {"messages": turns}
    if system is not None:
        body["system"] = system
    if tools:
        body["tools"] = [{"name": t["function"]["name"],
                          "description": t["function"].get("description", ""),
                          "input_schema": t["function"].get("parameters") or {"type": "object"}}
                         for t in tools]
    return body


def read_event(api: str, event: dict[str, Any], usage: Usage) -> bool:
    """Update ``usage`` from one streamed event; True when it carries content or a call.
    Raises ValueError with the server's message for an error event."""
    if ("error" in event and api == "chat") or event.get("type") in ("error", "response.failed"):
        raise ValueError(str(event.get("error") or event.get("response", {}).get("error")))
    if api == "responses":
        return _read_responses(event, usage)
    if api == "messages":
        return _read_messages(event, usage)
    if event.get("usage"):
        found = event["usage"]
        usage.prompt_tokens = found.get("prompt_tokens", 0)
        usage.cached_tokens = (found.get("prompt_tokens_details") or {}).get("cached_tokens")
        usage.output_tokens = found.get("completion_tokens")
    delta = ((event.get("choices") or [{}])[0]).get("delta") or {}
    return bool(delta.get("content") or delta.get("tool_calls"))


def _read_responses(event: dict[str, Any], usage: Usage) -> bool:
    kind = event.get("type")
    if kind in ("response.completed", "response.incomplete"):
        found = event["response"].get("usage") or {}
        usage.prompt_tokens = found.get("input_tokens", 0)
        usage.cached_tokens = (found.get("input_tokens_details") or {}).get("cached_tokens")
        usage.output_tokens = found.get("output_tokens")
    return kind in ("response.output_text.delta", "response.function_call_arguments.delta") or (
        kind == "response.output_item.added" and event["item"].get("type") == "function_call")


def _read_messages(event: dict[str, Any], usage: Usage) -> bool:
    kind = event.get("type")
    found = (event.get("message") or {}).get("usage") if kind == "message_start" else \
        event.get("usage") if kind == "message_delta" else None
    if found and "input_tokens" in found:
        read = found.get("cache_read_input_tokens")
        usage.prompt_tokens = found["input_tokens"] + (read or 0) + \
            (found.get("cache_creation_input_tokens") or 0)
        usage.cached_tokens = read
    if found and "output_tokens" in found:
        usage.output_tokens = found["output_tokens"]
    return kind == "content_block_delta" or (
        kind == "content_block_start" and event["content_block"].get("type") == "tool_use")
