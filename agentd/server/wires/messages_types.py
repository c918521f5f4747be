"""The Anthropic Messages API's request as it decodes (``POST /v1/messages``,
``/v1/messages/count_tokens``); what each field means is ``messages_plan``'s, the reply's
shapes ``messages_reply``'s (Anthropic's replies are encoded as plain dicts).

Invariant: unknown fields are ignored; the fields named below that change nothing a local model
does are accepted and ignored.
"""

from __future__ import annotations

from typing import Any

import msgspec


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
    context_management: dict[str, Any] | None = None  # Claude Code's (clearing old thinking)
    # accepted and ignored: they change nothing a local model does
    diagnostics: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    cache_salt: str | None = None  # vLLM extension, as on chat
    ignore_eos: bool = False  # vLLM extension, as on chat
