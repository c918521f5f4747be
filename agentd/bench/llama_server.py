"""llama.cpp's ``llama-server`` as a peer for the benchmarks: started on a loopback port with the
options a benchmark gives, ready once ``/health`` answers, stopped, or killed and started again
on the same port (a restart)."""

from __future__ import annotations

import signal
import subprocess
import tempfile
import time

import httpx

from agentd.bench.rss import read_status_bytes
from agentd.bench.spawn import free_port

READY_TIMEOUT_S = 600.0


class LlamaServer:
    """``binary -m gguf OPTIONS --host 127.0.0.1 --port P``, its output in a temporary log."""

    def __init__(self, binary: str, gguf: str, *options: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [binary, "-m", gguf, *options, "--host", "127.0.0.1",
                        "--port", str(self.port)]
        self.log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log",
                                               delete=False)
        self.process: subprocess.Popen | None = None

    def start(self) -> float:
        """Start it and wait for ``/health``; the seconds that took."""
        started = time.monotonic()
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT)
        while time.monotonic() - started < READY_TIMEOUT_S:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited; see {self.log.name}")
            time.sleep(0.2)
        raise RuntimeError("llama-server did not come up")

    def peak_rss_mib(self) -> float:
        assert self.process is not None
        return (read_status_bytes(self.process.pid, "VmHWM") or 0) / 2**20

    def kill(self) -> None:
        """SIGKILL, as a crash."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(60)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(60)
