"""What a running server holds: its settings, the engine once it is loaded, and its metrics.

Invariants: handlers reach the engine only through ``ServerState.require_engine()``, which answers
503 while the model loads, after a failed load and during shutdown, so no handler ever sees a
half-built engine. The server shuts down only an engine it loaded itself; an engine passed in by
the caller is started if needed and left running for its owner. Every /v1 and /admin route is
behind the API-key guard when keys are set; /health and /metrics stay open.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.handlers import BaseRouteHandler

from agentd.config import EngineConfig
from agentd.server.errors import APIError
from agentd.server.metrics import EngineSnapshot, ServerMetrics

if TYPE_CHECKING:
    from agentd.async_engine import AsyncEngine

logger = logging.getLogger("agentd.server")
_LOAD_JOIN_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class ServerSettings:
    """HTTP-side knobs (the engine's live in ``EngineConfig``)."""

    api_keys: tuple[str, ...] = ()
    max_request_body_bytes: int = 16 * 2**20
    shutdown_grace_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_request_body_bytes < 1024:
            raise ValueError("max_request_body_bytes must be at least 1024")
        if self.shutdown_grace_s < 0:
            raise ValueError("shutdown_grace_s must be >= 0")
        if any(not key for key in self.api_keys):
            raise ValueError("API keys must be non-empty")


class ServerState:
    """The engine's lifecycle as the server sees it: loading → ready (or failed) → closing."""

    def __init__(self, config: EngineConfig, settings: ServerSettings,
                 engine: AsyncEngine | None,
                 request_exit: Callable[[int], None] | None) -> None:
        self.config = config
        self.settings = settings
        self.engine = engine
        self.owns_engine = engine is None
        self.load_error: str | None = None
        self.closing = False
        self.started_s = time.monotonic()
        self.created = int(time.time())
        self.pid = os.getpid()
        self.request_exit: Callable[[int], None] = request_exit or (lambda code: None)
        self.metrics = ServerMetrics(self._stats_snapshot)
        self._loader: threading.Thread | None = None
        self._abort_timer: threading.Timer | None = None
        self._close_lock = threading.Lock()

    # --- lifecycle -------------------------------------------------------------------------
    def begin(self) -> None:
        """Start the given engine, or load one in a background thread (``/health`` says 503)."""
        if self.engine is not None:
            self.engine.start()
            return
        self._loader = threading.Thread(target=self._load, name="agentd-loader", daemon=True)
        self._loader.start()

    def _load(self) -> None:
        from agentd.async_engine import AsyncEngine

        logger.info("loading model %s", self.config.model or "(default)")
        try:
            engine = AsyncEngine.from_config(self.config)
        except Exception as exc:  # every load failure is reported as one line, then we exit
            self.load_error = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            logger.error("could not load the model: %s", self.load_error)
            self.request_exit(1)
            return
        if self.closing:
            return
        engine.start()
        self.engine = engine
        logger.info("ready: model %s, max_model_len %d", engine.model_name, engine.max_model_len)

    def begin_shutdown(self) -> None:
        """Ask the server to exit; requests still running after the grace period are aborted.

        uvicorn stops taking connections and waits for open ones; aborting our own requests
        just before its timeout lets every stream end cleanly (finish_reason "abort", [DONE])
        instead of being cut off.
        """
        self.request_exit(0)
        if self.owns_engine and self._abort_timer is None:
            self._abort_timer = threading.Timer(max(self.settings.shutdown_grace_s - 0.5, 0.0),
                                                self.close)
            self._abort_timer.daemon = True
            self._abort_timer.start()

    def close(self) -> None:
        """Abort what is still running and stop the engine (idempotent, any thread)."""
        self.closing = True
        with self._close_lock:
            if self._loader is not None and self._loader.is_alive():
                # Exiting while torch is mid-load aborts the process; a load is bounded: wait.
                logger.info("waiting for the model load to finish before exiting")
                self._loader.join(_LOAD_JOIN_TIMEOUT_S)
            if self.engine is not None and self.owns_engine:
                self.engine.shutdown(self.settings.shutdown_grace_s)

    # --- what handlers ask -----------------------------------------------------------------
    @property
    def status(self) -> str:
        if self.closing:
            return "stopping"
        if self.load_error is not None:
            return "error"
        return "ready" if self.engine is not None else "loading"

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started_s

    def require_engine(self) -> AsyncEngine:
        status = self.status
        if status == "ready" and self.engine is not None:
            return self.engine
        message = {
            "loading": "the model is still loading; retry shortly",
            "stopping": "the server is shutting down",
            "error": f"the model failed to load: {self.load_error}",
        }[status]
        raise APIError(503, message, code=f"model_{status}" if status != "error" else None,
                       headers={"Retry-After": "1"} if status == "loading" else None)

    def check_model(self, model: str | None) -> str:
        """The served model name; 404 if the request names another model."""
        engine = self.require_engine()
        if model and model not in (engine.model_name, self.config.model):
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                           f"{engine.model_name!r} (see GET /v1/models)", param="model",
                           code="model_not_found")
        return engine.model_name

    def _stats_snapshot(self) -> EngineSnapshot | None:
        engine = self.engine
        return None if engine is None else EngineSnapshot(engine.model_name, engine.stats())


def server_of(state: State) -> ServerState:
    """The app's ``ServerState`` (handlers take Litestar's ``state``)."""
    return state.agentd


def require_api_key(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Litestar guard: when API keys are set, ``Authorization: Bearer <key>`` must match one."""
    keys = connection.app.state.agentd.settings.api_keys
    if not keys:
        return
    scheme, _sep, token = connection.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not any(
        hmac.compare_digest(token.strip().encode(), key.encode()) for key in keys
    ):
        raise APIError(401, "missing or incorrect API key; send 'Authorization: Bearer <key>' "
                       "with a key given to `agentd start --api-key`",
                       headers={"WWW-Authenticate": "Bearer"})
