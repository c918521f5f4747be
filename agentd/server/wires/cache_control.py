"""Explicit cache control as the wires hand it over: "keep the first ``num_tokens`` tokens of
this prompt for ``ttl_s`` seconds", the TTLs each wire defines, and the cache figures a reply
reports.

The wires (Anthropic ``cache_control``, OpenAI ``prompt_cache_options`` /
``prompt_cache_breakpoint`` / ``prompt_cache_retention``) parse and validate those fields and
put one ``RetentionRequest`` (``agentd.engine.request``) on the plan's engine request, which the
engine holds like a pin with a TTL (:mod:`agentd.engine.retention`), in the pin budget, refreshed on
a hit.

Invariants: a TTL a wire does not define is a 400 naming the field, before anything runs; the
wires never read the cache themselves: every figure they report about it comes from
``cache_usage`` — *read* is the prompt tokens a request reused, *creation* the ones it computed
and now retains, so read + creation never exceed the prompt.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from agentd.engine.outputs import StreamDelta
from agentd.engine.request import RetentionRequest
from agentd.server.errors import APIError

# The TTLs each wire defines, in seconds.
ANTHROPIC_TTLS = {"5m": 300.0, "1h": 3600.0}
OPENAI_BREAKPOINT_TTLS = {"30m": 1800.0, "12h": 43200.0}  # prompt_cache_options, breakpoints
# prompt_cache_retention: "in_memory" is the automatic prefix cache (LRU) every request gets
OPENAI_RETENTION_TTLS: dict[str, float | None] = {"in_memory": None, "24h": 86400.0}


class CacheUsage(NamedTuple):
    read: int  # prompt tokens served from the cache
    creation: int  # prompt tokens this request computed and now retains


def parse_ttl(value: object, allowed: dict[str, float | None], param: str) -> float | None:
    """The seconds a wire's TTL string stands for; a 400 naming ``param`` for any other."""
    if isinstance(value, str) and value in allowed:
        return allowed[value]
    choices = ", ".join(repr(v) for v in allowed)
    raise APIError(400, f"{param} must be one of {choices}, not {value!r}", param=param,
                   code="invalid_ttl")


def openai_retention(retention: str | None, options: Any, num_prompt_tokens: int,
                     num_explicit_tokens: int = 0) -> RetentionRequest | None:
    """What an OpenAI request asks to keep: ``prompt_cache_retention: "24h"`` the whole prompt
    for a day ("in_memory" is the LRU cache every request gets); ``prompt_cache_options`` the
    whole prompt ("implicit" mode) or the prefix up to its last explicit breakpoint
    (``num_explicit_tokens``, "explicit" mode) for its ``ttl`` (30m by default). Both: a 400."""
    if options is not None and retention is not None:
        raise APIError(400, "send prompt_cache_options or prompt_cache_retention, not both",
                       param="prompt_cache_retention")
    if retention is not None:
        ttl_s = parse_ttl(retention, OPENAI_RETENTION_TTLS, "prompt_cache_retention")
        return None if ttl_s is None else RetentionRequest(num_prompt_tokens, ttl_s)
    if options is None:
        return None
    if options.mode not in (None, "implicit", "explicit"):
        raise APIError(400, "prompt_cache_options.mode must be 'implicit' or 'explicit', not "
                       f"{options.mode!r}", param="prompt_cache_options.mode")
    ttl_s = parse_ttl(options.ttl or "30m", OPENAI_BREAKPOINT_TTLS, "prompt_cache_options.ttl")
    assert ttl_s is not None
    num_tokens = num_explicit_tokens if options.mode == "explicit" else num_prompt_tokens
    return RetentionRequest(num_tokens, ttl_s) if num_tokens > 0 else None


def cache_usage(delta: StreamDelta, plan: Any) -> CacheUsage:
    """The cache figures of a finished request (Anthropic ``cache_read_input_tokens`` /
    ``cache_creation_input_tokens``; OpenAI ``cached_tokens`` / ``cache_write_tokens``): read
    from the engine's cached count; creation is what a request that asked to retain
    (``plan.retention``) computed and now holds."""
    read = delta.num_cached_tokens
    if getattr(plan, "retention", None) is None:
        return CacheUsage(read=read, creation=0)
    return CacheUsage(read=read, creation=max(0, delta.num_retained_tokens - read))
