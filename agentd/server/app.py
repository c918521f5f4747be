"""The Litestar application: routes, error handlers, OpenAPI, and the engine's lifespan.

Invariant: every body is decoded strictly as its route's type (``"max_tokens": "3"`` is a 400
naming the field, never 3); ``create_app`` has no side effects; the engine is loaded (in a
background thread, so ``/health`` can answer 503 meanwhile) and started when the app's lifespan
begins — its saved pins restored before it is published — and the engine the app loaded is shut
down when it ends.
Everything per-app (state, metrics registry) hangs off ``app.state.agentd``, so several apps can
live in one process.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

from litestar import Litestar, Request
from litestar.config.cors import CORSConfig
from litestar.datastructures import State
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import ScalarRenderPlugin

from agentd import __version__
from agentd.config import EngineConfig
from agentd.server.errors import anthropic_error_body, exception_handlers
from agentd.server.local_token import TOKEN_HEADER
from agentd.server.routes_admin import AdminController, health, metrics, root, version
from agentd.server.routes_anthropic import MessagesController
from agentd.server.routes_openai import OpenAIController
from agentd.server.routes_pins import PinsController
from agentd.server.routes_responses import ResponsesController
from agentd.server.settings import ServerSettings
from agentd.server.state import ServerState, count_arrivals
from agentd.server.web_guard import web_guard
from agentd.server.wires.checks import convert_request

if TYPE_CHECKING:
    from agentd.engine.async_engine import AsyncEngine

__all__ = ["ServerSettings", "create_app"]


def create_app(config: EngineConfig, *, engine: AsyncEngine | None = None,
               settings: ServerSettings | None = None,
               request_exit: Callable[[int], None] | None = None) -> Litestar:
    """Build the OpenAI-compatible app.

    Args:
        config: the engine configuration (used to load the engine when ``engine`` is None).
        engine: an already-built engine; the app starts it but leaves shutting it down to the
            caller.
        settings: HTTP-side settings (API keys, body size limit, shutdown grace, the state
            dir that keeps pins across restarts).
        request_exit: called with an exit status when the server should stop: 0 after
            ``POST /admin/shutdown``, 1 when the model fails to load. ``agentd start`` passes
            one that tells uvicorn to exit.
    Returns:
        The Litestar app.
    """
    settings = settings or ServerSettings()
    server = ServerState(config, settings, engine, request_exit)

    @asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        server.begin()
        if server.pins is not None:  # an engine given by the caller: restore before serving
            await server.restore_pins(server.pins)
        expiry = asyncio.create_task(server.expire_pins_forever())
        try:
            yield
        finally:
            expiry.cancel()
            server.responses.clear()  # an engine that outlives the app keeps no tail of ours
            await asyncio.to_thread(server.close)

    return Litestar(
        route_handlers=[OpenAIController, ResponsesController, MessagesController,
                        PinsController, AdminController, health, metrics, root, version],
        # web_guard first: a request arrives (count_arrivals) once its body is whole
        middleware=[partial(web_guard, server=server), partial(count_arrivals, server=server)],
        cors_config=_cors(settings.cors_origins),
        # OpenAI's shape, but for the wires whose controllers bring their own; a path no route
        # takes answers in the shape of the wire it is under
        exception_handlers=exception_handlers(
            unrouted={MessagesController.path: anthropic_error_body}),
        lifespan=[lifespan],
        before_request=_decode_strictly,
        state=State({"agentd": server}),
        request_max_body_size=settings.max_request_body_bytes,
        logging_config=None,  # logging belongs to the process (`agentd start`), not the app
        openapi_config=OpenAPIConfig(
            title="agentd", version=__version__, path="/docs",
            description="OpenAI-compatible local inference daemon for agents.",
            render_plugins=[ScalarRenderPlugin()],
        ),
    )


async def _decode_strictly(request: Request[Any, Any, Any]) -> None:
    """Decode a route's body as its type, strictly, before Litestar converts it leniently (its
    signature model turns ``"3"`` into 3 and ``"false"`` into False): a value of the wrong JSON
    type is a 400 naming the field, on every wire."""
    field = request.route_handler.parsed_data_field
    if field is not None:  # the JSON is parsed once: Litestar keeps it for the handler
        convert_request(await request.json(), field.annotation)


def _cors(origins: tuple[str, ...]) -> CORSConfig | None:
    """Pages of these origins may call the API (preflights answered); none by default."""
    if not origins:
        return None
    return CORSConfig(allow_origins=list(origins), allow_methods=["GET", "POST", "DELETE"],
                      allow_headers=["authorization", "content-type", "x-api-key",
                                     "anthropic-version", TOKEN_HEADER],
                      expose_headers=["retry-after"], max_age=600)
