"""The session a request belongs to, as the coding agents name it, for stats and near misses.

``prompt_cache_key`` (OpenAI's field) names a conversation or agent where a client sends it;
the coding agents also name their sessions in headers: Claude Code's
``X-Claude-Code-Session-Id``, Codex's ``session-id`` and ``thread-id``, opencode's
``x-session-id``. A request's key is the first of: its ``prompt_cache_key``, a session header
(as ``<client>:<id>``, the client from its ``User-Agent``), Anthropic's ``metadata.user_id``.

Invariants: a key is at most ``MAX_KEY_CHARS`` characters; requests without any key are grouped
by client for near misses, so two agents on one tenant are never each other's cache-busters.
"""

from __future__ import annotations

from litestar import Request

from agentd.server.ignored_fields import client_name

SESSION_HEADERS = ("x-claude-code-session-id", "session-id", "session_id", "x-session-id",
                   "conversation_id", "conversation-id", "thread-id")
MAX_KEY_CHARS = 200


def client_product(request: Request) -> str:
    """``claude-cli/2.1.197`` -> ``claude-cli``."""
    return client_name(request).split("/")[0]


def session_key(request: Request, prompt_cache_key: str | None,
                user_id: str | None = None) -> str | None:
    """The key the request's figures are grouped under (None: it names none)."""
    if prompt_cache_key:
        return prompt_cache_key[:MAX_KEY_CHARS]
    for name in SESSION_HEADERS:
        value = request.headers.get(name, "").strip()
        if value:
            return f"{client_product(request)}:{value}"[:MAX_KEY_CHARS]
    return user_id[:MAX_KEY_CHARS] if user_id else None


def near_miss_group(request: Request, key: str | None) -> str:
    """The group a prompt is compared within for cache-busters: its session, else its client."""
    return key or f"client:{client_product(request)}"
