"""The one internal request every wire builds, and how a plan is started on the engine.

Invariants: a plan is complete before the engine sees it — its ``EngineRequest`` (prompt token
ids, sampling params, retention request, the client's cache salt) plus what shapes the reply
(tool mode, output constraint, usage, the names its errors give) — so the routes differ only in
how they parse and how they answer. A plan is started the same way for every wire: its prompt
checked against the context once (a 400 naming the wire's field), its constraint compiled off the
event loop (a 400 naming the field when it cannot be), its request scoped to the caller's tenant
(cache salt and owner) and submitted whole (503 + ``Retry-After`` when the queue is full); its
finish is recorded in the server's metrics and, when it names a ``prompt_cache_key``, in that
key's stats. The Messages API's ``max_tokens: 0`` pre-warm is a plan started the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from litestar import Request, Response

from agentd.engine.outputs import StreamDelta
from agentd.engine.request import EngineRequest, RetentionRequest
from agentd.engine.sampling_params import SamplingParams
from agentd.server import ignored_fields
from agentd.server.auth import cache_tenant
from agentd.server.ignored_fields import Ignored
from agentd.server.sessions import near_miss_group, session_key
from agentd.server.wires.checks import OPENAI_TOO_LONG, fit_output
from agentd.server.wires.constraints import Constraint, compile_constraint
from agentd.server.wires.reply_events import Event, events
from agentd.server.wires.serving import (
    SSE_COMMENT,
    collect,
    effective_cache_salt,
    event_stream,
    submit,
    until_disconnect,
    with_keepalive,
)
from agentd.server.wires.tool_calls import ToolMode

if TYPE_CHECKING:

    from agentd.engine.request_stream import RequestStream
    from agentd.server.state import ServerState


@dataclass(frozen=True)
class Plan:
    """Everything needed to run one request and shape its reply, whatever its wire."""

    model: str
    created: int
    request: EngineRequest  # the client's cache salt; ``start`` scopes it to the tenant
    tool_mode: ToolMode
    constraint: Constraint | None
    include_usage: bool = False
    prompt_cache_key: str | None = None
    user_id: str | None = None  # Anthropic's metadata.user_id: the key when nothing else names one
    prompt_param: str = "messages"  # what a prompt too long for the context names
    max_tokens_param: str = "max_tokens"
    too_long: str = OPENAI_TOO_LONG  # that error's words on this wire
    ignored: tuple[Ignored, ...] = ()  # what the wire accepted and does not act on
    keepalive: bytes = SSE_COMMENT  # what a stream sends while nothing else comes

    @property
    def request_id(self) -> str:
        assert self.request.request_id is not None  # every wire names its requests
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def retention(self) -> RetentionRequest | None:
        return self.request.retention


@dataclass(frozen=True)
class Running:
    deltas: RequestStream
    events: AsyncIterator[Event]  # read once, by the reply's encoder or fold


async def start(request: Request[Any, Any, Any], server: ServerState, plan: Plan) -> Running:
    """Check the plan's prompt and fit its output cap to the context, compile its constraint,
    submit it for the caller's tenant."""
    engine = server.require_engine()
    wanted = plan.request
    params = _fitted(request, server, plan, engine.max_model_len)
    grammar = await compile_constraint(engine, plan.constraint)
    tenant = cache_tenant(request)
    key = session_key(request, plan.prompt_cache_key, plan.user_id)
    deltas = submit(engine, dataclasses.replace(
        wanted, params=params, cache_salt=effective_cache_salt(tenant, wanted.cache_salt),
        owner=tenant, grammar=grammar, session=key), server.max_in_flight(engine))
    server.arrived(request.scope)
    server.observe_prompt(tenant, near_miss_group(request, key), wanted.prompt_token_ids)
    on_finish = partial(_finished, server, plan.model, tenant, key)
    return Running(deltas, events(deltas, plan.tool_mode, on_finish))


def _fitted(request: Request[Any, Any, Any], server: ServerState, plan: Plan,
            max_model_len: int) -> SamplingParams:
    """The plan's sampling params with its output cap fitted (``fit_output``); a clamped cap
    is said as the other ignored fields are."""
    params = plan.params
    room = fit_output(len(plan.prompt_token_ids), params.max_tokens, max_model_len,
                      server.settings.max_output_tokens, plan.prompt_param, plan.too_long)
    ignored_fields.note(request, plan.ignored)
    if room.clamped and room.asked is not None:
        ignored_fields.note(request, [Ignored(
            plan.max_tokens_param, f"{room.asked} is more than the {room.max_tokens} tokens the "
            "context leaves after the prompt: clamped to them")])
    if room.max_tokens == params.max_tokens:
        return params
    return dataclasses.replace(params, max_tokens=room.max_tokens)


def reply_headers(request: Request[Any, Any, Any], server: ServerState) -> dict[str, str]:
    """What a reply says of the fields it ignored (``x-agentd-ignored``), logged once per
    client and field."""
    fields = ignored_fields.ignored(request)
    if not fields:
        return {}
    server.ignored_log.log(ignored_fields.client_name(request), request.url.path, fields)
    return {ignored_fields.HEADER: ignored_fields.header_value(fields)}


def _finished(server: ServerState, model: str, tenant: str | None, key: str | None,
              last: StreamDelta, finish_reason: str) -> None:
    server.metrics.observe_finished(model, last, finish_reason)
    if key is not None:
        server.key_stats.record(tenant, key, last)


async def answer(request: Request[Any, Any, Any], server: ServerState, plan: Plan, stream: bool,
                 streamed: Callable[[AsyncIterator[Event]], AsyncIterator[bytes]],
                 whole: Callable[[AsyncIterator[Event]], Awaitable[Any]]) -> Any:
    """Start ``plan`` and answer with its event stream encoded (``streamed``) or folded whole
    (``whole``, aborted if the client goes away first)."""
    running = await start(request, server, plan)
    headers = reply_headers(request, server)
    if stream:
        return event_stream(with_keepalive(streamed(running.events), plan.keepalive,
                                           server.settings.keepalive_s), headers)
    reply = await until_disconnect(request, whole(running.events), running.deltas)
    return Response(reply, headers=headers) if headers else reply


def prewarm_params() -> SamplingParams:
    """A prefill that generates nothing the client sees: one greedy token, dropped."""
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


async def prewarm(deltas: RequestStream) -> StreamDelta:
    """Read a pre-warm (a plan of ``prewarm_params``, started) to its end.

    Returns:
        Its last delta with no output (``num_cached_tokens``, ``num_retained_tokens`` for
        ``cache_usage``). Raises APIError as a whole reply does; a cancelled pre-warm aborts
        its prefill.
    """
    try:
        got = await collect(deltas)
    finally:
        await deltas.aclose()
    return dataclasses.replace(got.last, text="", token_ids=[], num_output_tokens=0)
