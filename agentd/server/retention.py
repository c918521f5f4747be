"""Explicit cache control as the wires hand it over: "keep the first ``num_tokens`` tokens of
this prompt for ``ttl_s`` seconds", the cache figures a reply reports, and the pre-warm.

The wires (Anthropic ``cache_control``, OpenAI ``prompt_cache_options`` /
``prompt_cache_breakpoint`` / ``prompt_cache_retention``) parse and validate those fields and
put one ``RetentionRequest`` on the plan; ``submit`` hands it to the engine, which holds those
blocks like a pin with a TTL (:mod:`agentd.retention`), in the pin budget, refreshed on a hit.

Invariants: the wires never read the cache themselves; every figure they report about it comes
from ``cache_usage``: *read* is the prompt tokens the request reused, *creation* the ones it
computed and now retains, so read + creation never exceed the prompt. A TTL a wire does not
define is a 400 naming the field, before anything runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentd.outputs import StreamDelta
from agentd.sampling_params import SamplingParams
from agentd.server.errors import APIError
from agentd.server.protocol import PromptCacheOptions
from agentd.server.serving import collect, effective_cache_salt, submit
from agentd.server.state import cache_tenant

if TYPE_CHECKING:
    from litestar import Request

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


def parse_ttl(value: object, allowed: dict[str, float], param: str) -> float:
    """The seconds a wire's TTL string stands for; a 400 naming ``param`` for any other."""
    if isinstance(value, str) and value in allowed:
        return allowed[value]
    raise APIError(400, f"{param} must be one of {', '.join(map(repr, allowed))}, not "
                   f"{value!r}", param=param, code="invalid_ttl")


def openai_retention(retention: str | None, options: PromptCacheOptions | None,
                     num_prompt_tokens: int, num_explicit_tokens: int = 0
                     ) -> RetentionRequest | None:
    """The retention an OpenAI request asks for: ``prompt_cache_retention`` keeps the prompt for
    its time (in_memory: 10 minutes, 24h); ``prompt_cache_options`` for its ``ttl`` (30m by
    default) — the whole prompt in "implicit" mode, only up to the last explicit breakpoint
    (``num_explicit_tokens``) in "explicit" mode. Both at once is a 400, as at OpenAI."""
    if options is not None and retention is not None:
        raise APIError(400, "send prompt_cache_options or prompt_cache_retention, not both "
                       "(prompt_cache_options.ttl supersedes prompt_cache_retention)",
                       param="prompt_cache_retention")
    if retention is not None:
        ttl_s = parse_ttl(retention, OPENAI_RETENTIONS, "prompt_cache_retention")
        return RetentionRequest(num_prompt_tokens, ttl_s)
    if options is None:
        return None
    if options.mode not in (None, "implicit", "explicit"):
        raise APIError(400, f"prompt_cache_options.mode must be 'implicit' or 'explicit', not "
                       f"{options.mode!r}", param="prompt_cache_options.mode")
    ttl_s = parse_ttl(options.ttl or "30m", OPENAI_TTLS, "prompt_cache_options.ttl")
    num_tokens = num_explicit_tokens if options.mode == "explicit" else num_prompt_tokens
    return RetentionRequest(num_tokens, ttl_s) if num_tokens > 0 else None


def cache_usage(delta: StreamDelta, plan: Any) -> CacheUsage:
    """The cache figures of a finished request (Anthropic ``cache_read_input_tokens`` /
    ``cache_creation_input_tokens``; OpenAI ``cached_tokens`` / ``cache_write_tokens``): read
    from the engine's cached count; creation is what a request that asked to retain computed
    and now holds (0 without ``plan.retention``)."""
    read = delta.num_cached_tokens
    if getattr(plan, "retention", None) is None:
        return CacheUsage(read=read, creation=0)
    return CacheUsage(read=read, creation=max(0, delta.num_retained_tokens - read))


def prewarm_params() -> SamplingParams:
    """A prefill that generates nothing the client sees: one greedy token, dropped."""
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


async def prewarm(server: Any, plan: Any,
                  request: Request[Any, Any, Any] | None = None) -> CacheUsage:
    """``max_tokens: 0``: prefill the prompt and retain ``plan.retention`` (held for the
    tenant of ``request``, under its cache salt), generate nothing; returns the cache figures.
    Raises APIError as ``submit`` does; a cancelled pre-warm aborts its prefill."""
    engine = server.require_engine()
    tenant = cache_tenant(request) if request is not None else None
    deltas = submit(engine, plan.prompt_token_ids, prewarm_params(), plan.request_id,
                    effective_cache_salt(tenant, plan.cache_salt), server.max_in_flight(engine),
                    retention=plan.retention, owner=tenant)
    if request is not None:
        server.arrived(request.scope)
    try:
        got = await collect(deltas)
    finally:
        await deltas.aclose()
    return cache_usage(dataclasses.replace(got.last, num_output_tokens=0), plan)
