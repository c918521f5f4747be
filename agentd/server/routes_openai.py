"""The OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

Invariant: handlers only validate, call the engine client and shape the reply; everything about
prompts and output parsing lives in ``serving_chat`` / ``serving_completion``, and runs in a
worker thread (``intake``: a long prompt never stalls the event loop). A non-streamed request
whose client disconnects is aborted like a streamed one. Requests are submitted before the
reply starts, so a full queue is a 503 with ``Retry-After`` for streams too.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any

from litestar import Controller, Request, get, post
from litestar.datastructures import State
from litestar.openapi import ResponseSpec
from litestar.params import Body
from litestar.response import Stream

from agentd.server.intake import check_chat_size, check_completion_size
from agentd.server.protocol import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from agentd.server.serving import event_stream, until_disconnect
from agentd.server.serving_chat import complete_chat, plan_chat, stream_chat
from agentd.server.serving_completion import complete_text, plan_completion, stream_text
from agentd.server.state import require_api_key, server_of
from agentd.server.wires.plan import start

_STREAM_NOTE = ("With `stream: true` the reply is `text/event-stream`: `data: {chunk}` events "
                "and a final `data: [DONE]`.")

ERROR_RESPONSES = {
    status: ResponseSpec(data_container=ErrorResponse, description=description)
    for status, description in (
        (400, "Bad request (OpenAI error envelope)"), (401, "Missing or wrong API key"),
        (404, "Unknown model"), (413, "Request body too large"),
        (503, "Model loading, server busy (see Retry-After) or shutting down"))}
ChatBody = Annotated[ChatCompletionRequest, Body(description="An OpenAI chat request.")]
CompletionBody = Annotated[CompletionRequest, Body(description="An OpenAI completion request.")]


class OpenAIController(Controller):
    path = "/v1"
    guards = [require_api_key]
    tags = ["OpenAI"]

    @post("/chat/completions", status_code=200, summary="Create a chat completion",
          description=_STREAM_NOTE, responses=ERROR_RESPONSES)
    async def chat_completions(self, request: Request[Any, Any, Any],
                               data: ChatBody, state: State) -> ChatCompletion | Stream:
        server = server_of(state)
        engine = server.require_engine()
        model = server.check_model(data.model)
        server.unknown_fields.note(await request.body(), ChatCompletionRequest, request.url.path)
        check_chat_size(data, engine.tokenizer, engine.max_model_len)
        plan = await asyncio.to_thread(plan_chat, data, engine, model, int(time.time()))
        started = await start(request, server, plan)
        if data.stream:
            return event_stream(stream_chat(plan, started.deltas, started.on_finish))
        return await until_disconnect(
            request, complete_chat(plan, started.deltas, started.on_finish), started.deltas)

    @post("/completions", status_code=200, summary="Create a text completion",
          description=_STREAM_NOTE, responses=ERROR_RESPONSES)
    async def completions(self, request: Request[Any, Any, Any], data: CompletionBody,
                          state: State) -> Completion | Stream:
        server = server_of(state)
        engine = server.require_engine()
        model = server.check_model(data.model)
        server.unknown_fields.note(await request.body(), CompletionRequest, request.url.path)
        check_completion_size(data, engine.tokenizer, engine.max_model_len)
        plan = await asyncio.to_thread(plan_completion, data, engine, model, int(time.time()))
        started = await start(request, server, plan)
        if data.stream:
            return event_stream(stream_text(plan, started.deltas, started.on_finish))
        return await until_disconnect(
            request, complete_text(plan, started.deltas, started.on_finish), started.deltas)

    @get("/models", summary="List the served model")
    async def models(self, state: State) -> ModelList:
        server = server_of(state)
        engine = server.require_engine()
        card = ModelCard(id=engine.model_name, created=server.created,
                         max_model_len=engine.max_model_len)
        return ModelList(data=[card])
