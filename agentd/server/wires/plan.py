"""The one internal request every wire builds, and how a plan is started on the engine.

Invariants: a plan is complete before the engine sees it (prompt token ids, sampling params,
output constraint, tool mode, cache salt, retention request), so the routes differ only in how
they parse and how they answer; a plan is started the same way for every wire — its constraint
compiled off the event loop (a 400 naming the field when it cannot be), submitted with the
tenant's cache salt (503 + ``Retry-After`` when the queue is full) — and its finish is recorded
in the server's metrics and, when it names a ``prompt_cache_key``, in that key's stats.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from agentd.outputs import StreamDelta
from agentd.sampling_params import SamplingParams
from agentd.server.constraints import Constraint, compile_constraint
from agentd.server.retention import RetentionRequest
from agentd.server.serving import effective_cache_salt, submit
from agentd.server.state import ServerState, cache_tenant
from agentd.server.tool_calls import ToolMode

if TYPE_CHECKING:
    from litestar import Request

    from agentd.async_engine import RequestStream

OnFinish = Callable[[StreamDelta, str], None]


@dataclass(frozen=True)
class Plan:
    """Everything needed to run one request and shape its reply, whatever its wire."""

    request_id: str
    model: str
    created: int
    prompt_token_ids: list[int]
    params: SamplingParams
    tool_mode: ToolMode
    constraint: Constraint | None
    cache_salt: str | None = None
    include_usage: bool = False
    prompt_cache_key: str | None = None
    retention: RetentionRequest | None = None
    keep_tail: bool = False  # a stored response: keep its last partial block for continuations


@dataclass(frozen=True)
class Started:
    deltas: RequestStream
    on_finish: OnFinish


class Startable(Protocol):
    """What ``start`` reads of a plan (a ``Plan``, or the text completions' own)."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    params: SamplingParams
    constraint: Constraint | None
    cache_salt: str | None
    prompt_cache_key: str | None
    keep_tail: bool
    retention: RetentionRequest | None


async def start(request: Request[Any, Any, Any], server: ServerState,
                plan: Startable) -> Started:
    """Compile the plan's constraint, submit it, and say how to record its finish."""
    engine = server.require_engine()
    grammar = await compile_constraint(engine, plan.constraint)
    tenant = cache_tenant(request)
    deltas = submit(engine, plan.prompt_token_ids, plan.params, plan.request_id,
                    effective_cache_salt(tenant, plan.cache_salt),
                    server.max_in_flight(engine), grammar, keep_tail=plan.keep_tail,
                    retention=plan.retention, owner=tenant)
    server.arrived(request.scope)
    server.observe_prompt(tenant, plan.prompt_cache_key, plan.prompt_token_ids)
    return Started(deltas, partial(_finished, server, plan.model, tenant, plan.prompt_cache_key))


def _finished(server: ServerState, model: str, tenant: str | None, key: str | None,
              last: StreamDelta, finish_reason: str) -> None:
    server.metrics.observe_finished(model, last, finish_reason)
    if key is not None:
        server.key_stats.record(tenant, key, last)
