"""Async front of the engine: the engine loop runs in its own thread; the event loop talks to it
through a command queue, and results come back with ``loop.call_soon_threadsafe``.

Invariant: only the engine thread touches the engine. A stream whose consumer goes away (client
disconnect, cancellation) aborts its request, so its blocks return to the pool.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from agentd.config import EngineConfig
from agentd.engine import EngineStats, LLMEngine
from agentd.outputs import StreamDelta
from agentd.pins import PinResult
from agentd.sampling_params import SamplingParams

logger = logging.getLogger("agentd")
T = TypeVar("T")
_IDLE_WAIT_S = 0.05


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._stats = engine.stats()
        self.error: BaseException | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(LLMEngine(config))

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="agentd-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort what is still running and stop the loop thread."""
        if self._thread is None:
            return
        self._commands.put(self._abort_all)
        self._stopping.set()
        self._thread.join(timeout_s)
        self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # --- requests --------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None,
                    cache_salt: str | None = None) -> AsyncIterator[StreamDelta]:
        """Queue a request and return its stream of deltas.

        Raises ValueError at once (nothing queued) for an empty or too-long prompt.
        """
        self._check_alive()
        self._validate(prompt_token_ids)
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue[StreamDelta | BaseException] = asyncio.Queue()
        self._streams[request_id] = (loop, stream)

        def add() -> None:
            try:
                self.engine.add_request(prompt_token_ids, params, request_id, cache_salt)
            except Exception as exc:  # validation raced with a config detail: report it
                self._post(request_id, exc)

        self._commands.put(add)
        return self._iterate(request_id, stream)

    def _validate(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens but this model's context "
                f"(max_model_len) is {self.max_model_len} tokens, which must also hold the output"
            )

    async def _iterate(self, request_id: str,
                       stream: asyncio.Queue) -> AsyncIterator[StreamDelta]:
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def run_pin(self, name: str, token_ids: list[int], ttl_s: float | None,
                      meta: dict[str, Any]) -> PinResult:
        """Prefill and pin a prefix; returns the engine's PinResult (raises PinError early)."""
        request_id = f"pin-{uuid.uuid4().hex}"
        stream: asyncio.Queue[StreamDelta | BaseException] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        try:
            await self.call(lambda e: e.add_pin(name, token_ids, ttl_s, meta, request_id))
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        async for _ in self._iterate(request_id, stream):
            pass
        return await self.call(lambda e: e.pin_results.pop(request_id))

    def abort(self, request_id: str) -> None:
        self._commands.put(lambda: self.engine.abort_request(request_id))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        self._check_alive()
        future: Future[T] = Future()

        def run() -> None:
            try:
                future.set_result(fn(self.engine))
            except BaseException as exc:
                future.set_exception(exc)

        self._commands.put(run)
        return await asyncio.wrap_future(future)

    def stats(self) -> EngineStats:
        """A snapshot taken by the engine thread after its latest step."""
        return self._stats

    # --- the engine thread -----------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine loop failed: {self.error!r}")

    def _post(self, request_id: str, item: StreamDelta | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, stream = target
        try:
            loop.call_soon_threadsafe(stream.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self._streams.pop(request_id, None)

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_S) if block else \
                self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _loop(self) -> None:
        engine = self.engine
        while not self._stopping.is_set() or not self._commands.empty():
            try:
                self._drain_commands(block=not engine.has_unfinished_requests())
                engine.expire_pins()
                deltas = engine.step() if engine.has_unfinished_requests() else []
                self._stats = engine.stats()  # before posting: a finished client sees its request
                for delta in deltas:
                    self._post(delta.request_id, delta)
            except Exception as exc:  # a broken step must not wedge the clients
                logger.exception("engine step failed; aborting in-flight requests")
                self._fail_all(exc)
        self._stats = engine.stats()

    def _abort_all(self) -> None:
        for request_id in list(self.engine.scheduler.requests):
            delta = self.engine.abort_request(request_id)
            if delta is not None:
                self._post(request_id, delta)

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self.engine.scheduler.requests):
            self.engine.abort_request(request_id)
            self._post(request_id, RuntimeError(f"engine step failed: {exc}"))

    def pending(self) -> dict[str, Any]:
        return {"streams": len(self._streams), "commands": self._commands.qsize()}
