"""The OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

Invariant: handlers only validate, call the engine client and shape the reply; everything about
prompts and replies lives in the wires (``wires.chat_plan`` / ``wires.chat_reply``,
``wires.completions_plan`` / ``wires.completions_reply``), and planning runs in a worker thread
(``wires.intake``: a long prompt never stalls the event loop). A non-streamed request whose client
disconnects is aborted like a streamed one. Requests are submitted before the
reply starts, so a full queue is a 503 with ``Retry-After`` for streams too.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import Annotated, Any

from litestar import Controller, Request, get, post
from litestar.datastructures import State
from litestar.openapi import ResponseSpec
from litestar.params import Body
from litestar.response import Stream

from agentd.server.auth import require_api_key
from agentd.server.errors import ErrorResponse
from agentd.server.state import server_of
from agentd.server.wires.chat_plan import plan_chat
from agentd.server.wires.chat_reply import complete_chat, stream_chat
from agentd.server.wires.chat_types import ChatCompletion, ChatCompletionRequest
from agentd.server.wires.completions_plan import plan_completion
from agentd.server.wires.completions_reply import complete_text, stream_text
from agentd.server.wires.completions_types import Completion, CompletionRequest
from agentd.server.wires.intake import check_chat_size, check_completion_size
from agentd.server.wires.openai_types import ModelCard, ModelList
from agentd.server.wires.plan import answer

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
        engine, model = await server.accept(request, data)
        check_chat_size(data, engine.tokenizer, engine.max_model_len)
        plan = await asyncio.to_thread(plan_chat, data, engine, model, int(time.time()))
        return await answer(request, server, plan, data.stream, partial(stream_chat, plan),
                            partial(complete_chat, plan))

    @post("/completions", status_code=200, summary="Create a text completion",
          description=_STREAM_NOTE, responses=ERROR_RESPONSES)
    async def completions(self, request: Request[Any, Any, Any], data: CompletionBody,
                          state: State) -> Completion | Stream:
        server = server_of(state)
        engine, model = await server.accept(request, data)
        check_completion_size(data, engine.tokenizer, engine.max_model_len)
        job = await asyncio.to_thread(plan_completion, data, engine, model, int(time.time()))
        return await answer(request, server, job.plan, data.stream, partial(stream_text, job),
                            partial(complete_text, job))

    @get("/models", summary="List the served model")
    async def models(self, state: State) -> ModelList:
        server = server_of(state)
        engine = server.require_engine()
        card = ModelCard(id=engine.model_name, created=server.created,
                         max_model_len=engine.max_model_len,
                         max_output_tokens=server.settings.max_output_tokens)
        return ModelList(data=[card])
