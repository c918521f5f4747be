"""The Anthropic Messages API routes: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

Invariants: as on chat, handlers validate, plan in a worker thread, start the plan and shape the
reply (``agentd.server.wires``); every error on these routes, from the guard's 401 to a 500, is
Anthropic-shaped (``agentd.server.errors`` picks the shape by path), and ``x-api-key`` is
accepted beside ``Authorization: Bearer``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any

from litestar import Controller, Request, post
from litestar.datastructures import State
from litestar.params import Body
from litestar.response import Stream

from agentd.server.intake import check_chars, text_chars
from agentd.server.retention import prewarm
from agentd.server.serving import effective_cache_salt, event_stream, until_disconnect
from agentd.server.state import cache_tenant, require_api_key, server_of
from agentd.server.wires.anthropic_messages import MessagesRequest
from agentd.server.wires.anthropic_out import complete_message, message, stream_message, usage
from agentd.server.wires.messages_plan import plan_messages, prompt_ids
from agentd.server.wires.plan import start

MessagesBody = Annotated[MessagesRequest, Body(description="An Anthropic Messages request.")]
_TEXT_KEYS = ("text", "content", "input", "system")


class MessagesController(Controller):
    path = "/v1/messages"
    guards = [require_api_key]
    tags = ["Anthropic"]

    @post("", status_code=200, summary="Create a message (Anthropic Messages API)",
          description="With `stream: true` the reply is Anthropic's `text/event-stream`.")
    async def create(self, request: Request[Any, Any, Any], data: MessagesBody,
                     state: State) -> dict[str, Any] | Stream:
        server = server_of(state)
        engine = server.require_engine()
        model = server.check_model(data.model)
        server.unknown_fields.note(await request.body(), MessagesRequest, request.url.path)
        check_chars(text_chars([data.system, data.messages], _TEXT_KEYS), engine.tokenizer,
                    engine.max_model_len, "messages")
        job = await asyncio.to_thread(plan_messages, data, engine, model, int(time.time()))
        if job.prewarm:
            tenant = cache_tenant(request)
            plan = job.plan
            last = await prewarm(engine, plan.prompt_token_ids, plan.retention, plan.request_id,
                                 effective_cache_salt(tenant, plan.cache_salt), tenant,
                                 server.max_in_flight(engine))
            return message(job, [], "max_tokens", None, usage(job, last, output_tokens=0))
        started = await start(request, server, job.plan)
        if data.stream:
            return event_stream(stream_message(job, started.deltas, started.on_finish))
        return await until_disconnect(
            request, complete_message(job, started.deltas, started.on_finish), started.deltas)

    @post("/count_tokens", status_code=200, summary="Count a message's input tokens")
    async def count_tokens(self, request: Request[Any, Any, Any], data: MessagesBody,
                           state: State) -> dict[str, int]:
        server = server_of(state)
        engine = server.require_engine()
        server.check_model(data.model)
        server.unknown_fields.note(await request.body(), MessagesRequest, request.url.path)
        check_chars(text_chars([data.system, data.messages], _TEXT_KEYS), engine.tokenizer,
                    engine.max_model_len, "messages")
        _, ids = await asyncio.to_thread(prompt_ids, data, engine)
        return {"input_tokens": len(ids)}

