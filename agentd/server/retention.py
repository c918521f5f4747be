"""Cache control → retention, for every wire: what a request asks the daemon to keep
(``RetentionRequest``), the TTLs each wire allows, the usage it reports (``cache_usage``) and the
pre-warm (``prewarm``: Anthropic's ``max_tokens: 0``).

A wire turns its cache fields (Anthropic ``cache_control`` breakpoints, OpenAI
``prompt_cache_options`` / ``prompt_cache_breakpoint`` / ``prompt_cache_retention``) into one
``RetentionRequest`` on its plan; the engine holds those blocks like a pin with a TTL
(:mod:`agentd.retention`), in the pin budget, refreshed on every hit. Invariants: a TTL a wire
does not define is a 400 naming the field, before anything runs; ``cache_usage`` reports as
*read* the prompt tokens the request reused and as *creation* the tokens it computed and now
retains, so read + creation never exceed the prompt.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from agentd.async_engine import AsyncEngine
from agentd.outputs import StreamDelta
from agentd.retention import HoldRequest
from agentd.sampling_params import SamplingParams
from agentd.server.errors import APIError
from agentd.server.protocol import PromptCacheOptions

# The TTLs each wire defines, in seconds.
ANTHROPIC_TTLS = {"5m": 300.0, "1h": 3600.0}
OPENAI_BREAKPOINT_TTLS = {"30m": 1800.0, "12h": 43200.0}  # prompt_cache_options / breakpoints
# prompt_cache_retention: "in_memory" is the automatic prefix cache (LRU) every request gets
OPENAI_RETENTION_TTLS: dict[str, float | None] = {"in_memory": None, "24h": 86400.0}


@dataclass(frozen=True)
class RetentionRequest:
    """Hold the prompt's first ``num_tokens`` tokens for ``ttl_s`` seconds."""

    num_tokens: int
    ttl_s: float


class HasRetention(Protocol):
    """A wire's plan: whatever it is, it carries its retention request."""

    @property
    def retention(self) -> RetentionRequest | None: ...


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


def openai_retention(retention: str | None, options: PromptCacheOptions | None,
                     num_prompt_tokens: int, num_explicit_tokens: int = 0
                     ) -> RetentionRequest | None:
    """The retention an OpenAI request asks for. ``prompt_cache_retention: "24h"`` holds the
    prompt for 24 hours ("in_memory" is the LRU cache every request gets); ``prompt_cache_options``
    holds it for its ``ttl`` (30m by default) — the whole prompt in "implicit" mode, only up to
    the last explicit breakpoint (``num_explicit_tokens``) in "explicit" mode. Sending both is a
    400, as it is at OpenAI."""
    if options is not None and retention is not None:
        raise APIError(400, "send prompt_cache_options or prompt_cache_retention, not both "
                       "(prompt_cache_options.ttl supersedes prompt_cache_retention)",
                       param="prompt_cache_retention")
    if retention is not None:
        ttl_s = parse_ttl(retention, OPENAI_RETENTION_TTLS, "prompt_cache_retention")
        return None if ttl_s is None else RetentionRequest(num_prompt_tokens, ttl_s)
    if options is None:
        return None
    if options.mode not in (None, "implicit", "explicit"):
        raise APIError(400, f"prompt_cache_options.mode must be 'implicit' or 'explicit', not "
                       f"{options.mode!r}", param="prompt_cache_options.mode")
    ttl_s = parse_ttl(options.ttl or "30m", OPENAI_BREAKPOINT_TTLS, "prompt_cache_options.ttl")
    assert ttl_s is not None
    num_tokens = num_explicit_tokens if options.mode == "explicit" else num_prompt_tokens
    return RetentionRequest(num_tokens, ttl_s) if num_tokens > 0 else None


def hold_of(retention: RetentionRequest | None, owner: str | None) -> HoldRequest | None:
    """The engine's hold for a wire's retention request, owned by ``owner`` (the tenant)."""
    if retention is None or retention.num_tokens <= 0:
        return None
    return HoldRequest(retention.num_tokens, retention.ttl_s, owner)


def cache_usage(delta: StreamDelta, plan: HasRetention) -> CacheUsage:
    """Read and creation tokens of a finished request (Anthropic ``cache_read_input_tokens`` /
    ``cache_creation_input_tokens``; OpenAI ``cached_tokens`` / ``cache_write_tokens``)."""
    read = delta.num_cached_tokens
    if plan.retention is None:
        return CacheUsage(read, 0)
    return CacheUsage(read, max(0, delta.num_retained_tokens - read))


def prewarm_params() -> SamplingParams:
    """A prefill that generates nothing the client sees: one greedy token, dropped."""
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


async def prewarm(engine: AsyncEngine, prompt_token_ids: list[int],
                  retention: RetentionRequest | None, request_id: str,
                  cache_salt: str | None = None, owner: str | None = None,
                  max_in_flight: int | None = None) -> StreamDelta:
    """Prefill the prompt and retain its prefix without generating (``max_tokens: 0``).

    Returns:
        The request's last delta with no output (usage: ``num_cached_tokens``,
        ``num_retained_tokens``); raises APIError as ``submit`` does.
    """
    from agentd.server.serving import collect, submit

    deltas = submit(engine, prompt_token_ids, prewarm_params(), request_id, cache_salt,
                    max_in_flight, retention=retention, owner=owner)
    try:
        got = await collect(deltas)
    finally:
        await deltas.aclose()  # a cancelled pre-warm aborts its prefill
    return dataclasses.replace(got.last, text="", token_ids=[], num_output_tokens=0)
