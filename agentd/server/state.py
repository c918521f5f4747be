"""What a running server holds: its settings, the engine once it is loaded, its pins and metrics.

Invariants: handlers reach the engine only through ``ServerState.require_engine()``, which answers
503 while the model loads, after a failed load and during shutdown, so no handler ever sees a
half-built engine. Pins registered before a restart are restored (from their KV in the block
store, or recomputed) before the engine is published, so ``/health`` turns 200 only once they
hit. The server shuts down only an engine it loaded itself; an engine passed in by the caller is
started if needed and left running for its owner. (Settings: :mod:`agentd.server.settings`; keys and
tenants: :mod:`agentd.server.auth`.)
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
from litestar import Request
from litestar.datastructures import State

from agentd.config import EngineConfig
from agentd.server import ignored_fields
from agentd.server.errors import APIError
from agentd.server.ignored_fields import UNKNOWN, Ignored, IgnoredLog
from agentd.server.key_stats import KeyStats
from agentd.server.local_token import new_token, write_token
from agentd.server.metrics import EngineSnapshot, ServerMetrics
from agentd.server.response_store import ResponseStore
from agentd.server.settings import ServerSettings

if TYPE_CHECKING:
    from agentd.engine.async_engine import AsyncEngine
    from agentd.pins.service import PinService
    from agentd.server.prompt_history import PromptHistory

logger = logging.getLogger("agentd.server")
_ENGINE_STOP_TIMEOUT_S = 300.0
LOADER_THREAD_NAME = "agentd-loader"


def ready_summary(engine: AsyncEngine) -> str:
    """What ``agentd start`` says once ready: the load time, memory, context and KV pool."""
    from agentd.engine.kv_sizing import format_bytes, proc_status_bytes

    plan = engine.kv_plan
    rss, peak = proc_status_bytes("VmRSS"), proc_status_bytes("VmHWM")
    parts = [f"model {engine.model_name}"
             + ("" if engine.load_s is None else f" loaded in {engine.load_s:.1f} s"),
             f"RSS {format_bytes(rss)} (peak {format_bytes(peak)})" if rss and peak else
             "RSS unknown",
             f"context {plan.max_model_len:,} tokens"
             + (f" (capped: {plan.cap_reason})" if plan.cap_reason else ""),
             f"KV {plan.dtype}, pool {plan.num_tokens:,} tokens = {format_bytes(plan.num_bytes)} "
             "(resident as it fills)"]
    return "; ".join(parts)


class ServerState:
    """The engine's lifecycle as the server sees it: loading → ready (or failed) → closing."""

    def __init__(self, config: EngineConfig, settings: ServerSettings,
                 engine: AsyncEngine | None,
                 request_exit: Callable[[int], None] | None) -> None:
        self.config = config
        self.settings = settings
        self.engine = engine
        self.owns_engine = engine is None
        self.pins: PinService | None = None
        self.prompt_history: PromptHistory | None = None  # near misses by prompt_cache_key
        self.load_error: str | None = None
        self.closing = False
        self.started_s = time.monotonic()
        self.created = int(time.time())
        self.pid = os.getpid()
        self.request_exit: Callable[[int], None] = request_exit or (lambda code: None)
        self.metrics = ServerMetrics(self._stats_snapshot)
        self.ignored_log = IgnoredLog()  # fields accepted and not acted on: logged once
        self.key_stats = KeyStats()  # by prompt_cache_key
        self.responses = ResponseStore(settings.response_store_size,
                                       settings.response_store_ttl_s, self.release_tails)
        self.cli_token = new_token()  # lets `agentd stop` shut down a daemon without keys
        self._loader: threading.Thread | None = None
        self._load_abandoned = False
        self._abort_timer: threading.Timer | None = None
        self._close_lock = threading.Lock()

    # --- lifecycle -------------------------------------------------------------------------
    def begin(self) -> None:
        """Start the given engine, or load one in a background thread (``/health`` says 503)."""
        if self.settings.state_dir is not None:
            write_token(self.settings.state_dir, self.cli_token)
        if self.engine is not None:
            self.engine.start()
            self.pins = self._pin_service(self.engine)
            return
        self._loader = threading.Thread(target=self._load, name=LOADER_THREAD_NAME, daemon=True)
        self._loader.start()

    def _load(self) -> None:
        from agentd.engine.async_engine import AsyncEngine

        logger.info("loading model %s", self.config.model or "(default)")
        try:
            engine = AsyncEngine.from_config(self.config)
        except Exception as exc:  # every load failure is reported as one line, then we exit
            self.load_error = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            logger.error("could not load the model: %s", self.load_error)
            from agentd.engine.kv_sizing import format_bytes, proc_status_bytes

            rss, peak = proc_status_bytes("VmRSS"), proc_status_bytes("VmHWM")
            if rss and peak:  # what the attempt cost this process, children apart
                logger.info("this process at the failed load: RSS %s (peak %s)",
                            format_bytes(rss), format_bytes(peak))
            self.request_exit(1)
            return
        if self.closing:  # stopped during the load: nothing will serve this engine
            engine.shutdown()
            return
        engine.start()
        pins = self._pin_service(engine)
        asyncio.run(self.restore_pins(pins))  # a private loop: pins hit before we say ready
        with self._close_lock:  # published under the lock: close() stops it, or this does
            if self.closing:
                engine.shutdown()
                return
            self.pins = pins
            self.engine = engine
        logger.info("ready: %s", ready_summary(engine))

    def _pin_service(self, engine: AsyncEngine) -> PinService:
        from agentd.pins.service import PinService

        return PinService(engine, self.settings.state_dir)

    async def restore_pins(self, pins: PinService) -> None:
        """Re-pin what ``pins.json`` lists; log each pin's restore vs its first prefill."""
        started = time.monotonic()
        try:
            report = await pins.restore_all()
        except Exception:  # serve without the saved pins rather than never turn ready
            logger.exception("could not restore the saved pins")
            return
        for entry in report:
            if "error" in entry:
                continue
            logger.info("pin %s: %d tokens restored by %s in %.3f s (its prefill took %s)",
                        entry["name"], entry["num_tokens"], entry["source"], entry["elapsed_s"],
                        "?" if entry.get("prefill_s") is None else f"{entry['prefill_s']:.3f} s")
        if report:
            logger.info("restored %d of %d pins in %.3f s",
                        sum("error" not in e for e in report), len(report),
                        time.monotonic() - started)

    async def expire_pins_forever(self, period_s: float = 1.0) -> None:
        """Forget (in pins.json too) pins whose TTL lapsed, and retry a write of pins.json that
        failed; runs for the app's lifetime."""
        while True:
            await asyncio.sleep(period_s)
            engine, pins = self.engine, self.pins
            if engine is None or pins is None or self.closing:
                continue
            if engine.pin_summary().expired or pins.registry_behind:
                try:
                    await pins.sync_expired()
                except Exception:  # a dead engine is reported by /health, not here
                    logger.debug("could not sync expired pins", exc_info=True)

    def begin_shutdown(self) -> None:
        """Ask the server to exit; requests still running after the grace period are aborted.

        uvicorn stops taking connections and waits for open ones; aborting our own requests
        before its timeout lets every stream end cleanly (finish_reason "abort", [DONE]) and
        every other request get a reply, instead of being cut off with uvicorn's plain-text 500.
        Signals (SIGINT/SIGTERM) come here too (see ``agentd.server.serve``).
        """
        self.request_exit(0)
        if self.owns_engine and self._abort_timer is None:
            grace_s = self.settings.shutdown_grace_s
            self._abort_timer = threading.Timer(grace_s - _abort_margin_s(grace_s), self.close)
            self._abort_timer.daemon = True
            self._abort_timer.start()

    def close(self) -> None:
        """Abort what is still running and stop the engine (idempotent, any thread). A model
        load still running is not waited for: it may never end (a file that blocks, a model
        larger than the machine), and the process that stops while loading ends without it
        (``agentd.server.serve.exit_process``); the loader drops what it built if it ends."""
        self.closing = True
        with self._close_lock:
            if self.engine is None and self._loader is not None and self._loader.is_alive():
                if not self._load_abandoned:
                    logger.warning("stopping while the model is still loading: the load is "
                                   "abandoned and the process exits without waiting for it")
                self._load_abandoned = True
                return
            if self.engine is not None and self.owns_engine:
                grace_s = self.settings.shutdown_grace_s
                self.engine.shutdown(grace_s, drain_s=_abort_margin_s(grace_s) / 2)
                if not self.engine.wait_stopped(0.0):
                    logger.info("waiting for the engine's current step to end before exiting")
                    self.engine.wait_stopped(_ENGINE_STOP_TIMEOUT_S)

    def arrived(self, scope: Any) -> None:
        """The request of ``scope`` was submitted (or failed): it no longer counts as arriving
        (idempotent)."""
        engine = scope.get("state", {}).pop(_ARRIVING, None)
        if engine is not None:
            engine.arriving -= 1

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

    def require_pins(self) -> PinService:
        self.require_engine()
        assert self.pins is not None  # set before the engine is published
        return self.pins

    async def accept(self, request: Request[Any, Any, Any],
                     data: msgspec.Struct) -> tuple[AsyncEngine, str]:
        """What a completion route does first: the engine (503 while there is none), the served
        model's name, and what the body holds that nothing here acts on noted (its unknown
        top-level fields; another model's name)."""
        engine = self.require_engine()
        unknown = ignored_fields.unknown_fields(await request.body(), type(data))
        ignored_fields.note(request, [Ignored(name, UNKNOWN) for name in unknown])
        model = getattr(data, "model", None)
        if model and model not in (engine.model_name, self.config.model):
            # Harnesses name their own vendors' models (claude-opus-..., gpt-...); one model is
            # served here, whatever a request calls it, as llama-server does.
            ignored_fields.note(request, [Ignored("model", f"{model!r} is served by "
                                                  f"{engine.model_name!r}, the one model here")])
        return engine, engine.model_name

    def observe_prompt(self, tenant: str | None, key: str | None,
                       token_ids: list[int]) -> None:
        """Look for a cache-buster between this prompt and its group's recent ones, in a worker
        thread (call it after submitting: it never delays the request)."""
        engine = self.require_engine()
        if self.prompt_history is None:
            from agentd.server.prompt_history import PromptHistory

            self.prompt_history = PromptHistory(engine.tokenizer)
        future = asyncio.get_running_loop().run_in_executor(
            None, self.prompt_history.observe, tenant, key, token_ids)
        future.add_done_callback(_log_failure)

    def max_in_flight(self, engine: AsyncEngine) -> int:
        """Requests that may be in flight at once: a full batch plus ``max_queue`` waiting."""
        return engine.max_num_seqs + self.settings.max_queue

    def release_tails(self, request_ids: list[str]) -> None:
        """Stored responses dropped: their engine tails go too."""
        engine = self.engine
        if engine is not None and request_ids:
            engine.release_tails(request_ids)

    def _stats_snapshot(self) -> EngineSnapshot | None:
        engine = self.engine
        if engine is None:
            return None
        return EngineSnapshot(engine.model_name, engine.stats(), engine.pin_summary())


def _log_failure(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.warning("near-miss check failed", exc_info=future.exception())


def _abort_margin_s(grace_s: float) -> float:
    """How long before uvicorn's own shutdown timeout our requests are aborted: half of it for
    the engine to end its current step, half for the handlers to send their replies."""
    return min(2.0, grace_s / 2)


_SUBMITTING_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses",
                               "/v1/messages"})
_ARRIVING = "agentd_arriving"


def count_arrivals(app: Any, *, server: ServerState) -> Any:
    """ASGI middleware: from the moment a completion request reaches the app until the handler
    has submitted it (or failed), it counts in the engine's ``arriving``, so an idle engine can
    hold its first step for requests fired together (see ``AsyncEngine._coalesce``)."""

    async def middleware(scope: Any, receive: Any, send: Any) -> None:
        engine = server.engine
        if (engine is None or scope["type"] != "http" or scope.get("method") != "POST"
                or scope.get("path") not in _SUBMITTING_PATHS):
            await app(scope, receive, send)
            return
        engine.arriving += 1
        scope.setdefault("state", {})[_ARRIVING] = engine
        try:
            await app(scope, receive, send)
        finally:
            server.arrived(scope)

    return middleware


def server_of(state: State) -> ServerState:
    """The app's ``ServerState`` (handlers take Litestar's ``state``)."""
    return state.agentd
