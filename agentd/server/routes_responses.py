"""The OpenAI Responses API routes: ``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``, ``POST /v1/responses/input_tokens`` (exact counts) and
``POST /v1/responses/compact`` (the model's own summary, as a ``compaction`` item).

Invariants: as on chat, handlers validate, plan in a worker thread, start the plan and shape the
reply (``agentd.server.wires``); a response is stored (``store: true``, the default) with its
exact token ids only once it finished, for the caller's key, and a request that ends without
a reply to store releases what the engine kept for it; a stored response belongs to the API key
that made it, also with ``--shared-cache`` (which shares prefixes, not conversations): an
unknown, expired or another key's response id is a 404 naming it.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import Annotated, Any

import msgspec
from litestar import Controller, Request, delete, get, post
from litestar.datastructures import State
from litestar.params import Body, FromPath
from litestar.response import Stream

from agentd.server.auth import key_owner, require_api_key
from agentd.server.errors import APIError
from agentd.server.response_store import StoredResponse
from agentd.server.routes_openai import ERROR_RESPONSES
from agentd.server.state import ServerState, server_of
from agentd.server.wires.intake import check_chars, text_chars
from agentd.server.wires.plan import answer, start
from agentd.server.wires.responses_plan import ResponsesJob, plan_compaction, plan_responses
from agentd.server.wires.responses_reply import complete_response, stream_response
from agentd.server.wires.responses_tools import history_calls
from agentd.server.wires.responses_types import (
    DeletedResponse,
    OutputMessage,
    Response,
    ResponsesRequest,
)
from agentd.server.wires.serving import until_disconnect

_TEXT_KEYS = ("text", "content", "output", "arguments")
ResponsesBody = Annotated[ResponsesRequest, Body(description="An OpenAI Responses API request.")]


class ResponsesController(Controller):
    path = "/v1/responses"
    guards = [require_api_key]
    tags = ["OpenAI"]

    @post("", status_code=200, summary="Create a response (OpenAI Responses API)",
          description="With `stream: true` the reply is `text/event-stream` of semantic events.",
          responses=ERROR_RESPONSES)
    async def create(self, request: Request[Any, Any, Any], data: ResponsesBody,
                     state: State) -> Response | Stream:
        server = server_of(state)
        keep = data.store and server.settings.response_store_size > 0
        job = await _plan(request, server, data, plan_responses, keep=keep)
        on_stored = partial(_store, server, key_owner(request), job)
        return await answer(request, server, job.plan, data.stream,
                            partial(stream_response, job, on_stored=on_stored),
                            partial(complete_response, job, on_stored=on_stored))

    @post("/input_tokens", status_code=200, summary="Count a response's input tokens",
          description="Exact: the prompt the same body would run, from the model's tokenizer.",
          responses=ERROR_RESPONSES)
    async def input_tokens(self, request: Request[Any, Any, Any], data: ResponsesBody,
                           state: State) -> dict[str, Any]:
        server = server_of(state)
        job = await _plan(request, server, data, plan_responses, keep=False)
        return {"object": "response.input_tokens",
                "input_tokens": len(job.plan.prompt_token_ids)}

    @post("/compact", status_code=200, summary="Compact a conversation",
          description="The model sums up the conversation; the reply's output is the window "
          "that replaces it: its user messages, then a `compaction` item carrying the summary "
          "(agentd's is plain text, which the client sends back as it is).",
          responses=ERROR_RESPONSES)
    async def compact(self, request: Request[Any, Any, Any], data: ResponsesBody,
                      state: State) -> dict[str, Any]:
        server = server_of(state)
        job = await _plan(request, server, data, plan_compaction)
        running = await start(request, server, job.plan)
        summary = await until_disconnect(
            request, complete_response(job, running.events, on_stored=_no_store),
            running.deltas)
        text = "".join(part.text for item in summary.output if isinstance(item, OutputMessage)
                       for part in item.content)
        kept = [item for item in (data.input if isinstance(data.input, list) else [
            {"role": "user", "content": data.input}]) if isinstance(item, dict)
            and item.get("type", "message") == "message" and item.get("role") == "user"]
        return {"id": summary.id.replace("resp_", "cmp_", 1), "object": "response.compaction",
                "created_at": summary.created_at,
                "output": [*kept, {"type": "compaction", "id": _item_id("cmp", summary.id),
                                   "encrypted_content": text}],
                "usage": msgspec.to_builtins(summary.usage)}

    @get("/{response_id:str}", summary="Get a stored response", sync_to_thread=False)
    def get_response(self, request: Request[Any, Any, Any], response_id: FromPath[str],
                     state: State) -> Response:
        server = server_of(state)
        return _stored(server, key_owner(request), response_id, "response_id").response

    @delete("/{response_id:str}", status_code=200, summary="Delete a stored response",
            sync_to_thread=False)
    def delete_response(self, request: Request[Any, Any, Any], response_id: FromPath[str],
                        state: State) -> DeletedResponse:
        if not server_of(state).responses.delete(key_owner(request), response_id):
            raise _not_found(response_id, "response_id")
        return DeletedResponse(id=response_id)


async def _plan(request: Request[Any, Any, Any], server: ServerState, data: ResponsesRequest,
                planner: Any, **kwargs: Any) -> ResponsesJob:
    """``planner``'s job for ``data`` (a worker thread), after the checks every route does."""
    engine, model = await server.accept(request, data)
    check_chars(text_chars([data.input, data.instructions], _TEXT_KEYS), engine.tokenizer,
                engine.max_model_len, "input")
    previous = None
    if data.previous_response_id is not None:
        previous = _stored(server, key_owner(request), data.previous_response_id,
                           "previous_response_id")
    return await asyncio.to_thread(planner, data, engine, model, int(time.time()), previous,
                                   **kwargs)


def _no_store(response: Response | None, output_ids: list[int]) -> None:
    """A compaction's summary is not a response the client continues."""


def _item_id(prefix: str, source_id: str) -> str:
    return prefix + "_" + source_id.split("_", 1)[-1]


def _stored(server: ServerState, owner: str | None, response_id: str,
            param: str) -> StoredResponse:
    stored = server.responses.get(owner, response_id)
    if stored is None:
        raise _not_found(response_id, param)
    return stored


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(404, f"{param} {response_id!r}: no stored response has this id: it is "
                    "unknown, has expired (see `agentd start --response-store-ttl`), was "
                    "deleted, was made with store: false, or belongs to another API key",
                    param=param,
                    code="response_not_found")


def _store(server: ServerState, owner: str | None, job: ResponsesJob,
           response: Response | None, output_ids: list[int]) -> None:
    plan = job.plan
    if not plan.request.keep_tail:
        return
    if response is None:
        server.release_tails([plan.request_id])
        return
    calls = history_calls(job.tools, response.output)
    server.responses.put(owner, response.id, StoredResponse(
        response, plan.prompt_token_ids + output_ids, plan.request_id, job.instructions, calls))

