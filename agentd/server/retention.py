"""Explicit cache control as the wires hand it over: "keep the first ``num_tokens`` tokens of
this prompt for ``ttl_s`` seconds", and the cache figures a reply reports.

The wires (Anthropic ``cache_control``, OpenAI ``prompt_cache_options`` /
``prompt_cache_breakpoint`` / ``prompt_cache_retention``) parse and validate those fields and
put one ``RetentionRequest`` on the plan; what is done with it — holding the blocks like a pin
with a TTL, refreshed on a hit, inside the pin budget — is implemented by the retention branch
(issue 14, item 3), which completes ``cache_usage`` and ``prewarm`` here.

Invariant: the wires never read the cache themselves; every figure they report about it comes
from ``cache_usage``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentd.outputs import StreamDelta
from agentd.server.errors import APIError

# TTL strings the wires accept, in seconds (Anthropic: 5m, 1h; OpenAI: 30m, 12h, and
# prompt_cache_retention's in-memory / 24h).
ANTHROPIC_TTLS = {"5m": 300.0, "1h": 3600.0}
OPENAI_TTLS = {"30m": 1800.0, "12h": 43200.0}
OPENAI_RETENTIONS = {"in-memory": 600.0, "in_memory": 600.0, "24h": 86400.0}


@dataclass(frozen=True)
class RetentionRequest:
    """Hold the prompt's first ``num_tokens`` tokens (its last breakpoint) for ``ttl_s``."""

    num_tokens: int
    ttl_s: float

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, not {self.num_tokens}")
        if self.ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, not {self.ttl_s}")


@dataclass(frozen=True)
class CacheUsage:
    read: int  # prompt tokens served from the cache
    creation: int  # prompt tokens this request computed and retained


def cache_usage(delta: StreamDelta, plan: Any) -> CacheUsage:
    """The cache figures of a finished request: read from the engine's cached count; creation
    is 0 until retention lands (it then counts what this request wrote into a retained
    prefix)."""
    del plan  # the retention branch reads plan.retention here
    return CacheUsage(read=delta.num_cached_tokens, creation=0)


async def prewarm(server: Any, plan: Any) -> CacheUsage:
    """``max_tokens: 0``: prefill and retain the prompt, generate nothing (the retention
    branch implements it)."""
    del server, plan
    raise APIError(501, "max_tokens: 0 (pre-warming a prefix) is not implemented yet on this "
                   "daemon; send max_tokens >= 1", param="max_tokens", code="not_implemented")
