"""The Anthropic Messages API routes: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

Invariants: as on chat, handlers validate, plan in a worker thread, start the plan and shape the
reply (``agentd.server.wires``); every error on these routes, from the guard's 401 to a 500, is
Anthropic-shaped (the controller's own exception handlers), and ``x-api-key`` is accepted beside
``Authorization: Bearer``. ``max_tokens: 0`` pre-warms: its plan is started like any other and
its reply says what the cache read and now holds.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import Annotated, Any

from litestar import Controller, Request, post
from litestar.datastructures import State
from litestar.params import Body
from litestar.response import Stream

from agentd.server.auth import require_api_key
from agentd.server.errors import anthropic_error_body, exception_handlers
from agentd.server.state import server_of
from agentd.server.wires.checks import ANTHROPIC_TOO_LONG
from agentd.server.wires.intake import check_chars, text_chars
from agentd.server.wires.messages_plan import plan_messages, prompt_ids
from agentd.server.wires.messages_reply import complete_message, prewarmed, stream_message
from agentd.server.wires.messages_types import MessagesRequest
from agentd.server.wires.plan import answer, prewarm, start

MessagesBody = Annotated[MessagesRequest, Body(description="An Anthropic Messages request.")]
_TEXT_KEYS = ("text", "content", "input", "system")


class MessagesController(Controller):
    path = "/v1/messages"
    guards = [require_api_key]
    tags = ["Anthropic"]
    exception_handlers = exception_handlers(anthropic_error_body)  # the wire's own shape

    @post("", status_code=200, summary="Create a message (Anthropic Messages API)",
          description="With `stream: true` the reply is Anthropic's `text/event-stream`.")
    async def create(self, request: Request[Any, Any, Any], data: MessagesBody,
                     state: State) -> dict[str, Any] | Stream:
        server = server_of(state)
        engine, model = await server.accept(request, data)
        check_chars(text_chars([data.system, data.messages], _TEXT_KEYS), engine.tokenizer,
                    engine.max_model_len, "messages", ANTHROPIC_TOO_LONG)
        job = await asyncio.to_thread(plan_messages, data, engine, model, int(time.time()))
        if job.prewarm:
            running = await start(request, server, job.plan)
            return prewarmed(job, await prewarm(running.deltas))
        return await answer(request, server, job.plan, data.stream,
                            partial(stream_message, job), partial(complete_message, job))

    @post("/count_tokens", status_code=200, summary="Count a message's input tokens")
    async def count_tokens(self, request: Request[Any, Any, Any], data: MessagesBody,
                           state: State) -> dict[str, int]:
        server = server_of(state)
        engine, _ = await server.accept(request, data)
        check_chars(text_chars([data.system, data.messages], _TEXT_KEYS), engine.tokenizer,
                    engine.max_model_len, "messages", ANTHROPIC_TOO_LONG)
        _, ids = await asyncio.to_thread(prompt_ids, data, engine)
        return {"input_tokens": len(ids)}
