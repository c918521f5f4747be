"""Async front of the engine: the engine loop runs in its own thread; the event loop talks to it
through a command queue, and results come back with ``loop.call_soon_threadsafe``.

Invariant: only the engine thread touches the engine. Every request's stream ends in exactly one
of two ways: read to its last delta, or aborted — by ``aclose()``, by a cancelled read, or by
being dropped unread (even before its first read) — so its blocks always return to the pool and
its ``_streams`` entry is always removed. At most ``max_in_flight`` requests (when given) are in
flight; past that ``add_request`` refuses at once with ``EngineBusyError``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from agentd.cache import REQUEST, BlockHash, DiskKVStore, Pin, PinKey, blocks_digest
from agentd.config import EngineConfig
from agentd.engine.llm_engine import EngineStats, LLMEngine
from agentd.engine.outputs import StreamDelta
from agentd.engine.request import EngineRequest, check_prompt
from agentd.engine.request_stream import RequestStream
from agentd.pins.manager import PinSummary
from agentd.pins.pin_request import PinRequest, PinResult
from agentd.structured.params import StructuredOutputsParams

logger = logging.getLogger("agentd")
T = TypeVar("T")
_IDLE_WAIT_S = 0.05
# How long an idle engine holds its first step for requests the server is still submitting.
_COALESCE_S = 0.02


class EngineDeadError(RuntimeError):
    """The engine loop failed or was stopped: no request can be served."""


class EngineBusyError(RuntimeError):
    """Too many requests are in flight; retry later (nothing was queued)."""


@dataclass(frozen=True)
class IntegrityReport:
    """The pool's invariants checked on the engine thread, plus what still holds blocks."""

    ok: bool
    error: str | None
    num_blocks_used: int
    num_blocks_pinned: int
    num_blocks_retained: int  # held by retained prefixes (cache control) and by no pin
    num_requests: int  # requests the scheduler still knows (running or waiting)
    num_streams: int  # streams still registered on the async side
    num_hashed_blocks: int = 0  # blocks the prefix cache can hit (what KV events announced)
    hashed_blocks_digest: str = ""  # agentd.cache.blocks_digest of their hashes


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine  # touched on the engine thread only (``call``)
        # What the server may read of the engine from any thread: fixed once it is built.
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.max_num_seqs = engine.config.max_num_seqs
        self.block_size = engine.config.block_size
        self.vocab_size = engine.vocab_size
        self.eos_token_ids = engine.loaded.eos_token_ids
        self.fingerprint = engine.fingerprint
        self.kv_plan = engine.kv_plan
        self.load_s = engine.load_s
        self.compute_report = engine.loaded.compute_report
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._parked: tuple[threading.Thread, threading.Event] | None = None
        # Requests the server has accepted but not submitted yet (parsing, templating); written
        # by the event loop, read here. See _coalesce.
        self.arriving = 0
        self._stopping = threading.Event()
        self._stats = engine.stats()
        self._pin_summary = engine.pins.summary()
        self.error: BaseException | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """Load the model on the thread that will later run the engine loop (``start()``).

        Torch's OpenMP thread team belongs to the thread that first runs a parallel op; stepping
        on another thread than the one that loaded the model made every step ~20% slower here
        (warm 1,800-token prefill: 108 ms on one thread, 125-131 ms across two).
        """
        built: Future[LLMEngine] = Future()
        go = threading.Event()
        owner: list[AsyncEngine] = []

        def run() -> None:
            try:
                built.set_result(LLMEngine(config))
            except BaseException as exc:
                built.set_exception(exc)
                return
            go.wait()
            if owner and not owner[0]._stopping.is_set():
                owner[0]._loop()

        thread = threading.Thread(target=run, name="agentd-engine", daemon=True)
        thread.start()
        try:
            engine = built.result()
        except BaseException:
            thread.join()
            raise
        self = cls(engine)
        self._parked = (thread, go)
        owner.append(self)
        return self

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        if self._parked is not None:  # the thread that loaded the model runs the loop
            self._thread, go = self._parked
            self._parked = None
            go.set()
            return
        self._thread = threading.Thread(target=self._loop, name="agentd-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0, drain_s: float = 1.0) -> None:
        """Abort what is still running and stop the loop thread (any thread may call this).

        Aborts land between engine steps. Streams still open after ``drain_s`` — a long step is
        running — are ended at once with EngineDeadError, so no client outlives the shutdown.
        """
        if self._parked is not None:  # built but never started: let its thread end
            thread, go = self._parked
            self._parked = None
            self._stopping.set()
            go.set()
            thread.join(timeout_s)
        if self._thread is None:
            return
        self._commands.put(self._abort_all)
        self._stopping.set()
        self._thread.join(min(drain_s, timeout_s))
        for request_id in list(self._streams):
            self._post(request_id, EngineDeadError("the server is shutting down"))
        self._thread.join(max(timeout_s - drain_s, 0.0))
        if not self._thread.is_alive():
            self._thread = None
        # else: a long step is still running; the loop ends after it (see wait_stopped)

    def wait_stopped(self, timeout_s: float) -> bool:
        """After ``shutdown``: wait for the loop thread to end; True once it has. A process that
        exits while that thread is inside torch aborts (SIGABRT), so the daemon waits here."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            thread.join(timeout_s)
        if thread is not None and not thread.is_alive():
            self._thread = None
        return self._thread is None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # --- requests --------------------------------------------------------------------------
    def add_request(self, request: EngineRequest,
                    max_in_flight: int | None = None) -> RequestStream:
        """Queue a request and return its stream of deltas. A constrained request must bring
        its compiled ``grammar`` (``compile_grammar``), so the engine thread never compiles.

        Raises at once, with nothing queued: ValueError for a prompt ``check_prompt`` refuses,
        EngineBusyError when ``max_in_flight`` requests are in flight already, EngineDeadError
        when the engine is not running.
        """
        self._check_alive()
        check_prompt(request.prompt_token_ids, self.max_model_len, self.vocab_size)
        if request.params.structured_outputs is not None and request.grammar is None:
            raise ValueError("a constrained request needs its grammar: await compile_grammar()")
        if max_in_flight is not None and len(self._streams) >= max_in_flight:
            raise EngineBusyError(
                f"the server is busy: {len(self._streams)} requests are in flight (the limit "
                f"is {max_in_flight}); retry shortly"
            )
        stream = self._open_stream(request.request_id or f"req-{uuid.uuid4().hex}")
        request = dataclasses.replace(request, request_id=stream.request_id)

        def add() -> None:
            try:
                self.engine.add_request(request)
            except Exception as exc:  # validation raced with a config detail: report it
                self._post(stream.request_id, exc)

        self._commands.put(add)
        return stream

    async def compile_grammar(self, params: StructuredOutputsParams) -> Any:
        """Compile (or fetch from the cache) an output constraint on a worker thread, off the
        event loop and the engine thread. Raises GrammarError for one that cannot compile."""
        return await asyncio.to_thread(self.engine.grammars.compile, params)

    @property
    def num_in_flight(self) -> int:
        """Requests whose stream is open (pins being prefilled included)."""
        return len(self._streams)

    def _open_stream(self, request_id: str) -> RequestStream:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[StreamDelta | BaseException] = asyncio.Queue()
        self._streams[request_id] = (loop, queue)
        return RequestStream(request_id, queue, self._release)

    def _release(self, request_id: str, abort: bool) -> None:
        self._streams.pop(request_id, None)
        if abort:
            self.abort(request_id)

    async def run_pin(self, pin: PinRequest) -> PinResult:
        """Prefill and pin ``pin``; returns how its registration ended (raises PinError early,
        with nothing queued). Cancelled, it leaves nothing: no prefill, no pin."""
        self._check_alive()
        stream = self._open_stream(f"pin-{uuid.uuid4().hex}")
        request_id = stream.request_id
        try:
            await self.call(lambda e: e.add_pin(pin, request_id))
        except asyncio.CancelledError:
            stream._end(abort=False)
            self._commands.put(lambda: self.engine.cancel_pin(request_id, pin.key))
            raise
        except BaseException:
            stream._end(abort=False)  # add_pin refused: nothing was queued
            raise
        try:
            async for delta in stream:
                if delta.finished:
                    assert delta.pin_result is not None
                    return delta.pin_result
            raise EngineDeadError("the pin's prefill ended without a result")
        except asyncio.CancelledError:
            self._commands.put(lambda: self.engine.cancel_pin(request_id, pin.key))
            raise

    # --- pins, read and changed on the engine thread ---------------------------------------
    async def list_pins(self) -> list[Pin]:
        return await self.call(LLMEngine.list_pins)

    async def get_pin(self, key: PinKey | str) -> Pin:
        """Raises PinNotFoundError."""
        return await self.call(lambda e: e.get_pin(key))

    async def unpin(self, key: PinKey | str) -> None:
        """Raises PinNotFoundError."""
        await self.call(lambda e: e.unpin(key))

    async def take_expired_pins(self) -> list[PinKey]:
        return await self.call(LLMEngine.take_expired_pins)

    async def restore_pin(self, pin: PinRequest, payload: dict[str, Any]) -> PinResult:
        """See ``LLMEngine.restore_pin``."""
        return await self.call(lambda e: e.restore_pin(pin, payload))

    async def gather_pin_snapshot(self, key: PinKey) -> dict[str, Any]:
        """The pin's KV copied (between steps) into a buffer allocated off the engine thread,
        with what identifies it; raises PinNotFoundError."""
        shape, dtype = await self.call(lambda e: e.pin_snapshot_shape(key))
        buffer = await asyncio.to_thread(torch.zeros, shape, dtype=dtype)  # touch its pages
        return await self.call(lambda e: e.gather_pin_snapshot(key, buffer))

    def pin_store(self, state_dir: Path) -> DiskKVStore:
        """See ``LLMEngine.pin_store`` (it may open files: call it from a worker thread)."""
        return self.engine.pin_store(state_dir)

    def pin_record_keys(self, token_ids: Sequence[int], cache_salt: str | None
                        ) -> list[BlockHash]:
        """See ``LLMEngine.pin_record_keys`` (a pure function of its arguments: any thread)."""
        return self.engine.pin_record_keys(token_ids, cache_salt)

    def kv_block_layout(self) -> tuple[int, tuple[int, ...], torch.dtype]:
        """See ``LLMEngine.kv_block_layout`` (fixed at start: any thread)."""
        return self.engine.kv_block_layout()

    def abort(self, request_id: str) -> None:
        self._commands.put(lambda: self.engine.abort_request(request_id))

    def release_tails(self, request_ids: list[str]) -> None:
        """Drop the kept tails of these finished requests (their conversations are gone)."""
        self._commands.put(lambda: self.engine.tails.release_all(request_ids))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        self._check_alive()
        future: Future[T] = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return  # the caller was cancelled before its turn: skip it
            try:
                future.set_result(fn(self.engine))
            except BaseException as exc:
                future.set_exception(exc)

        self._commands.put(run)
        return await asyncio.wrap_future(future)

    def stats(self) -> EngineStats:
        """A snapshot taken by the engine thread after its latest step."""
        return self._stats

    def pin_summary(self) -> PinSummary:
        """Pins' counters and near misses, copied by the engine thread after its latest step."""
        return self._pin_summary

    # --- the engine thread -----------------------------------------------------------------
    async def check_integrity(self) -> IntegrityReport:
        """Check the pool's invariants and that every reference has an owner (a live request's
        block table or a pin), on the engine thread between steps."""

        def check(engine: LLMEngine) -> IntegrityReport:
            error = None
            try:
                _check_references(engine)
            except AssertionError as exc:
                error = str(exc) or "the block pool failed its integrity check"
            stats = engine.stats()
            hashed = engine.kv_cache.pool.hashed_blocks()
            return IntegrityReport(ok=error is None, error=error,
                                   num_blocks_used=stats.pool.num_blocks_used,
                                   num_blocks_pinned=stats.pins.num_blocks_pinned,
                                   num_blocks_retained=stats.pins.num_blocks_retained,
                                   num_requests=len(engine.scheduler.requests),
                                   num_streams=len(self._streams),
                                   num_hashed_blocks=len(hashed),
                                   hashed_blocks_digest=blocks_digest(hashed))

        return await self.call(check)

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine loop failed: {self.error!r}")
        if self._stopping.is_set():
            raise EngineDeadError("the engine is shutting down")

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

    def _coalesce(self) -> None:
        """Agents often fire requests together; the server submits them one by one (each is
        parsed and templated first), so an idle engine used to prefill the first alone and the
        rest one step later, doubling their TTFT. When nothing is running yet and the server
        is still submitting requests, wait for them (at most ``_COALESCE_S``) so that they share
        the first step. A lone request never waits: nothing else is arriving."""
        scheduler = self.engine.scheduler
        if self.arriving <= 0 or scheduler.num_running or not scheduler.num_waiting:
            return
        deadline = time.monotonic() + _COALESCE_S
        while self.arriving > 0 and time.monotonic() < deadline:
            time.sleep(0.001)
            self._drain_commands(block=False)
        self._drain_commands(block=False)

    def _loop(self) -> None:
        engine = self.engine
        while not self._stopping.is_set() or not self._commands.empty():
            try:
                self._drain_commands(block=not engine.has_unfinished_requests())
                self._coalesce()
                engine.expire_pins()
                deltas = engine.step() if engine.has_unfinished_requests() else []
                self._stats = engine.stats()  # before posting: a finished client sees its request
                self._pin_summary = engine.pins.summary(tuple(engine.expired_pins))
                for delta in deltas:
                    self._post(delta.request_id, delta)
            except Exception as exc:  # a broken step must not wedge the clients
                logger.exception("engine step failed; aborting in-flight requests")
                self._fail_all(exc)
        self._abort_all()  # whatever a late command added: nobody would run it now
        for request_id in list(self._streams):
            self._post(request_id, EngineDeadError("the engine stopped"))
        self._stats = engine.stats()
        engine.close()

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


def _check_references(engine: LLMEngine) -> None:
    """Raise AssertionError unless the pool is sound, each block's ref count equals the number
    of its holders (``kv_cache.holders``: requests' block tables, pins with their tail blocks,
    retained prefixes, kept conversation tails), and every block table
    held belongs to a request the scheduler still runs or waits on."""
    kv_cache = engine.kv_cache
    kv_cache.pool.check_integrity()
    kv_cache.holders.check()
    stale = [owner.key for owner, _ in kv_cache.holders.items()
             if owner.kind == REQUEST and owner.key not in engine.scheduler.requests]
    assert not stale, f"finished requests still hold blocks: {stale} (a leaked reference)"
