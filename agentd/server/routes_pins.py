"""Pins over HTTP: ``POST /v1/pins``, ``GET /v1/pins``, ``GET|DELETE /v1/pins/{name}``.

Invariants: a key reaches only its own tenant's pins (its name space; they are hashed with its
cache salt) — with one tenant, that is every pin — and an operator reaches every tenant's pins
(``?owner=<tenant id>`` names another tenant's); a pin name matches ``PIN_NAME`` in full; a
pin's tools are decoded through the same ``Tool`` Struct as a chat request's, so
the pin renders exactly the tokens real requests with those tools render; a refused pin (bad
body or longer than the context 400, name taken 409, over the pin budget 409, a registry
(``pins.json``) that cannot be written 507) changes nothing and answers the OpenAI error
envelope; a system prompt longer than the context could hold is refused by its character
count before it is rendered or tokenised, as the chat wires refuse a prompt
(``wires.intake``); ``POST`` answers only once the prefix is prefilled, its blocks pinned and
``pins.json`` written, ``DELETE`` only once ``pins.json`` is written without it.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from litestar import Controller, Request, delete, get, post
from litestar.datastructures import State
from litestar.openapi import ResponseSpec
from litestar.params import Body, FromPath, QueryParameter

from agentd.cache import PinBudgetError, PinError, PinExistsError, PinKey, PinNotFoundError
from agentd.pins.registry_file import PIN_NAME, pin_ttl_s
from agentd.pins.service import PinSpec, PinStorageError, PinTooLongError
from agentd.server.auth import cache_tenant, is_operator, require_api_key
from agentd.server.errors import APIError, ErrorResponse
from agentd.server.state import server_of
from agentd.server.wires.chat_types import Tool
from agentd.server.wires.checks import check_tools
from agentd.server.wires.intake import check_chars

_CODES = {PinExistsError: "pin_exists", PinNotFoundError: "pin_not_found",
          PinBudgetError: "pin_budget_exceeded", PinTooLongError: "context_length_exceeded",
          PinStorageError: "insufficient_storage"}
_PARAMS = {PinExistsError: "name", PinBudgetError: "name", PinTooLongError: "system"}
_ERRORS = {status: ResponseSpec(data_container=ErrorResponse, description=description)
           for status, description in (
               (400, "Bad request (OpenAI error envelope)"), (401, "Missing or wrong API key"),
               (403, "Another tenant's pins need an admin key"), (404, "No such pin"),
               (409, "Name taken, or over the pin budget"),
               (503, "Model loading or server shutting down"),
               (507, "The state dir could not be written (pins.json): nothing changed"))}


class PinCreateRequest(msgspec.Struct, kw_only=True):
    """A prefix to pin: a system prompt and, optionally, OpenAI-format tools."""

    name: str
    system: str
    tools: list[Tool] | None = None
    ttl: float | str | None = None  # seconds, or a duration such as "90s", "15m", "1h"; <= 1 year


class PinInfo(msgspec.Struct, kw_only=True):
    name: str
    owner: str | None = None  # the tenant id whose pin it is; None: server-wide
    num_tokens: int  # every token the pin serves, its tail's included
    num_blocks: int  # blocks it holds: full ones, then the partial tail block if any
    tail_tokens: int = 0  # tokens past its last full block, served from its tail block
    created: int
    ttl: float | None
    hits: int
    tokens_served: int
    idle_s: float
    num_tools: int = 0
    prefill_s: float | None = None
    restore_s: float | None = None
    object: str = "pin"


class PinCreated(PinInfo, kw_only=True):
    restored: bool = False


class PinList(msgspec.Struct, kw_only=True):
    data: list[PinInfo]
    object: str = "list"


class PinDeleted(msgspec.Struct, kw_only=True):
    name: str
    deleted: bool = True
    object: str = "pin.deleted"


CreateBody = Annotated[PinCreateRequest, Body(description="The prefix to pin.")]
OwnerParam = Annotated[str | None, QueryParameter(
    name="owner", description="Admin keys only: the tenant id whose pin this is.")]


class PinsController(Controller):
    path = "/v1/pins"
    guards = [require_api_key]
    tags = ["Pins"]

    @post("/", status_code=201, summary="Pin a system prompt (+ tools): prefill it and hold it",
          responses=_ERRORS)
    async def create(self, data: CreateBody, state: State,
                     request: Request[Any, Any, Any]) -> PinCreated:
        pins = server_of(state).require_pins()
        spec = _to_spec(data, cache_tenant(request))
        engine = pins.engine
        check_chars(len(spec.system), engine.tokenizer, engine.max_model_len, "system")
        try:
            info = await pins.add(spec)
        except PinError as exc:
            raise _pin_error(exc) from exc
        return PinCreated(**info)

    @get("/", summary="List pins", responses=_ERRORS)
    async def list_pins(self, state: State, request: Request[Any, Any, Any]) -> PinList:
        """A tenant's own pins; an admin key's list holds every tenant's."""
        pins = server_of(state).require_pins()
        listed = await pins.list(cache_tenant(request), everyone=is_operator(request))
        return PinList(data=[PinInfo(**info) for info in listed])

    @get("/{name:str}", summary="One pin", responses=_ERRORS)
    async def get_pin(self, name: FromPath[str], state: State, request: Request[Any, Any, Any],
                      owner: OwnerParam = None) -> PinInfo:
        pins = server_of(state).require_pins()
        try:
            return PinInfo(**await pins.get(_key(request, name, owner)))
        except PinError as exc:
            raise _pin_error(exc) from exc

    @delete("/{name:str}", status_code=200, summary="Unpin: its blocks become ordinary LRU",
            responses=_ERRORS)
    async def delete_pin(self, name: FromPath[str], state: State,
                         request: Request[Any, Any, Any], owner: OwnerParam = None) -> PinDeleted:
        pins = server_of(state).require_pins()
        try:
            await pins.remove(_key(request, name, owner))
        except PinError as exc:
            raise _pin_error(exc) from exc
        return PinDeleted(name=name)


def _key(request: Request[Any, Any, Any], name: str, owner: str | None) -> PinKey:
    """The pin a request names: in its own tenant's name space, or (admin keys) ``owner``'s."""
    own = cache_tenant(request)
    if owner is None or owner == own:
        return PinKey(own, name)
    if not is_operator(request):
        raise APIError(403, "only an admin key may name another tenant's pin (owner)",
                       param="owner", code="permission_denied")
    return PinKey(owner or None, name)  # owner= (empty): the server-wide pin


def _to_spec(data: PinCreateRequest, owner: str | None) -> PinSpec:
    if not PIN_NAME.fullmatch(data.name):
        raise APIError(400, "name must be 1-64 characters of a-z, A-Z, 0-9, '.', '_' or '-', "
                       f"starting with a letter or digit; got {data.name!r}", param="name")
    if not data.system.strip():
        raise APIError(400, "system must be a non-empty system prompt", param="system")
    tools = None
    if data.tools:
        check_tools(data.tools)
        tools = msgspec.to_builtins(data.tools)  # exactly what a chat request's tools become
    return PinSpec(data.name, data.system, tools, _ttl_s(data.ttl), owner=owner)


def _ttl_s(ttl: float | str | None) -> float | None:
    if ttl is None:
        return None
    try:
        return pin_ttl_s(ttl)
    except ValueError as exc:
        raise APIError(400, str(exc), param="ttl") from exc


def _pin_error(exc: PinError) -> APIError:
    return APIError(exc.status, str(exc), param=_PARAMS.get(type(exc)), code=_CODES.get(type(exc)))
