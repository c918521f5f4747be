"""A daemon in a child process, started exactly as a user starts one: for tests and benchmarks.

``SpawnedDaemon`` runs ``python -m agentd.cli start`` on a free loopback port with its own state
dir. ``start()`` waits for ``/health`` 200; after ``kill()`` (SIGKILL: no cleanup at all) or
``stop()`` (graceful), ``start()`` runs it again on the same port and state dir, so restarts
restore what the last run saved. The child sees none of the caller's ``AGENTD_*`` variables but
``AGENTD_CACHE_DIR`` (where converted models and compiled kernels are kept, which changes no
output), only ``env``: a developer's own daemon settings never leak into a measurement or a test.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from agentd.bench.rss import read_status_bytes
from agentd.server.local_token import TOKEN_HEADER, read_token


class DaemonNotReady(RuntimeError):
    """The daemon exited or did not answer in time; the message ends with its log."""


KEPT_VARIABLES = ("AGENTD_CACHE_DIR",)


def child_environ() -> dict[str, str]:
    """This process's environment without its ``AGENTD_*`` settings (but the cache dir)."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("AGENTD_") or k in KEPT_VARIABLES}


def free_port() -> int:
    """A loopback port nothing listens on (at the time of the call)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SpawnedDaemon:
    """``agentd start --port P --state-dir S ARGS`` in a child process; its output goes to
    ``log_path`` (default: ``S``'s sibling ``<name>-daemon.log``), appended by every start."""

    def __init__(self, state_dir: Path, *args: str, env: dict[str, str] | None = None,
                 ready_timeout_s: float = 300.0, log_path: Path | None = None) -> None:
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.args = args
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = child_environ()
        self.env.update(env or {})
        self.ready_timeout_s = ready_timeout_s
        self.log_path = log_path or self.state_dir.parent / f"{self.state_dir.name}-daemon.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.num_starts = 0

    def start(self, wait: bool = True) -> float:
        """Start it; with ``wait``, return once ``/health`` answers 200: the seconds that took."""
        started = time.monotonic()
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                [sys.executable, "-m", "agentd.cli", "start", "--port", str(self.port),
                 "--state-dir", str(self.state_dir), *self.args],
                stdout=log, stderr=subprocess.STDOUT, env=self.env)
        self.num_starts += 1
        if wait:
            self.wait_ready()
        return time.monotonic() - started

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise DaemonNotReady(f"the daemon exited with {code}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.kill()
        raise DaemonNotReady(f"the daemon was not ready in {self.ready_timeout_s:.0f} s:\n"
                             f"{self.log()}")

    def log(self) -> str:
        """The last 3,000 characters of its output."""
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash or the OOM killer would: nothing is saved on the way out."""
        if self.running():
            assert self.process is not None
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(30)

    def stop(self) -> int | None:
        """Graceful stop (``POST /admin/shutdown``); its exit status, None if never started."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            try:
                token = read_token(self.state_dir) or ""
                httpx.post(f"{self.url}/admin/shutdown", headers={TOKEN_HEADER: token},
                           timeout=5)
                self.process.wait(60)
            except (httpx.HTTPError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def rss_mib(self) -> float | None:
        """Its resident memory now, None when it is not running or not readable."""
        if not self.running():
            return None
        assert self.process is not None
        rss = read_status_bytes(self.process.pid, "VmRSS")
        return None if rss is None else rss / 2**20
