"""Run the app under uvicorn on a socket the caller has already bound.

Invariants: the listening socket exists before the model starts loading, so a port in use fails
at once and ``/health`` answers (503) during the load; the return value is the process's exit
status: 0 after ``POST /admin/shutdown`` or SIGINT/SIGTERM, 1 when the model failed to load.
Stopping — by ``POST /admin/shutdown`` or a signal — gives in-flight requests
``shutdown_grace_s`` to finish, then aborts them, each with a reply. Stopping while the model
loads does not wait for the load: the server exits, and :func:`exit_process` ends the process
without running interpreter teardown under the loading thread, which ends the load with it. A
connection that has not sent a request's whole headers within ``read_timeout_s`` of its first
byte (or of connecting) is answered 408 and closed, so clients that trickle headers cannot hold
connections forever (the body's own timeout is ``agentd.server.web_guard``'s).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import NoReturn

import h11
import msgspec
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from agentd.config import EngineConfig
from agentd.server.app import create_app
from agentd.server.errors import error_body
from agentd.server.settings import ServerSettings
from agentd.server.state import LOADER_THREAD_NAME

logger = logging.getLogger("agentd.server")


class _ExitStatus:
    """Lets the app stop uvicorn (from any thread) and remembers why."""

    def __init__(self) -> None:
        self.server: uvicorn.Server | None = None
        self.code = 0

    def __call__(self, code: int) -> None:
        self.code = max(self.code, code)
        if self.server is not None:
            self.server.should_exit = True  # uvicorn polls this flag; safe from any thread


class _NoDelayH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with TCP_NODELAY on every connection.

    asyncio sets TCP_NODELAY only on sockets whose proto says IPPROTO_TCP, and sockets accepted
    from the listener ``agentd start`` binds itself say 0. uvicorn writes a response's headers
    and body separately; on a kept-alive connection Nagle's
    algorithm held the body until the client's delayed ACK of the headers arrived, adding ~40 ms
    to every request after a connection's first (measured on loopback: headers at 85 ms, body at
    126-132 ms; with this, both at ~85 ms). SSE chunks are small writes too.
    """

    def connection_made(self, transport) -> None:  # type: ignore[no-untyped-def]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        super().connection_made(transport)


class _TimedH11(_NoDelayH11):
    """Closes a connection (after a 408) whose request headers are not whole within
    ``header_timeout_s`` of its first byte, or of connecting when it sends nothing. uvicorn
    itself times out only idle kept-alive connections, and any byte restarts that clock."""

    header_timeout_s = 30.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[no-untyped-def]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # a request has begun: its headers have a deadline
        elif self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        body = msgspec.json.encode(error_body(
            f"the request headers did not arrive within {self.header_timeout_s:g} s "
            "(--read-timeout)", code="request_timeout"))
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json"
                             b"\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(body), body))
        self.transport.close()


def http_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol with TCP_NODELAY and a header read timeout."""
    return type("AgentdH11", (_TimedH11,), {"header_timeout_s": header_timeout_s})


class _Server(uvicorn.Server):
    """uvicorn, with SIGINT/SIGTERM taking the same graceful path as ``POST /admin/shutdown``
    (requests still running near the end of the grace period are aborted with a reply) and
    ending the same way: ``serve`` returns the exit status. (uvicorn would raise the signal
    again once shut down, which killed the process before ``agentd start`` removed its pid
    file and daemon.json.)"""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_signal = on_signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        getattr(self, "_captured_signals", []).clear()  # not raised again after the shutdown
        self._on_signal()


def serve(config: EngineConfig, settings: ServerSettings, sock: socket.socket, *,
          log_level: str = "info", access_log: bool = True) -> int:
    """Serve until asked to stop; returns the exit status.

    Args:
        config: the engine configuration; the model is loaded after the server starts.
        settings: HTTP-side settings.
        sock: a bound, listening TCP socket.
        log_level: uvicorn's log level (debug, info, warning, error).
        access_log: log one line per request.
    """
    exit_status = _ExitStatus()
    app = create_app(config, settings=settings, request_exit=exit_status)
    uv_config = uvicorn.Config(
        app, log_level=log_level, access_log=access_log, lifespan="on",
        timeout_graceful_shutdown=max(int(round(settings.shutdown_grace_s)), 1),
        timeout_keep_alive=5, http=http_protocol(settings.read_timeout_s),
    )
    if access_log:  # after uvicorn.Config, which configures uvicorn's loggers
        logging.getLogger("uvicorn.access").addFilter(_no_health_polls_while_loading)
    server = _Server(uv_config, on_signal=app.state.agentd.begin_shutdown)
    exit_status.server = server
    host, port = sock.getsockname()[:2]
    logger.info("agentd listening on http://%s:%d", _url_host(host), port)
    server.run(sockets=[sock])
    if not server.started and exit_status.code == 0:
        return 1
    return exit_status.code


def exit_process(status: int) -> NoReturn:
    """End the daemon's process with ``status`` once :func:`serve` has returned.

    A model load still running in its thread (the daemon was stopped while loading) is never
    joined, and the interpreter must not be torn down under it (torch mid-load aborted the
    process that way): the process then ends at once, logs flushed, and the load with it.
    """
    if any(t.name == LOADER_THREAD_NAME and t.is_alive() for t in threading.enumerate()):
        logger.info("exiting during the model load (status %d)", status)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


def _no_health_polls_while_loading(record: logging.LogRecord) -> bool:
    """Drop ``GET /health`` 503 lines: `agentd start --detach` (and any supervisor) polls five
    times a second while the model loads, which filled agentd.log with hundreds of them."""
    args = record.args
    return not (isinstance(args, tuple) and len(args) == 5 and args[2] == "/health"
                and args[4] == 503)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
