"""Peak resident memory of a process on this machine, sampled from ``/proc/<pid>/status``.

Invariant: a sampler never fails the benchmark — a process it cannot read (gone, another user's,
not Linux) just yields no figure (None). ``peak_rss_bytes`` is the highest VmRSS seen since the
last ``reset``; ``hwm_bytes`` is the lifetime high-water mark: the kernel's VmHWM (which
includes whatever the process did before the benchmark: loading the model, earlier runs), or the
highest VmRSS sampled if that is higher — Linux updates VmHWM lazily, so a short peak that is
freed again (munmap, malloc_trim) can be seen in VmRSS and never reach VmHWM. A server that runs
its model in child processes (vLLM's engine core) is measured whole: VmRSS is summed over the
pid and its descendants, and VmHWM counts only when there are none.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

SAMPLE_INTERVAL_S = 0.2


def read_status_bytes(pid: int, field: str) -> int | None:
    """A ``kB`` field of ``/proc/<pid>/status`` in bytes, or None when unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def descendants(pid: int) -> list[int]:
    """The pid's children, their children, ... (empty when unreadable)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = list(Path(f"/proc/{parent}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            found += children
            todo += children
    return found


def tree_rss_bytes(pid: int) -> int | None:
    """VmRSS of the pid plus its descendants'."""
    own = read_status_bytes(pid, "VmRSS")
    if own is None:
        return None
    return own + sum(read_status_bytes(child, "VmRSS") or 0 for child in descendants(pid))


class RssSampler:
    """Samples a pid's VmRSS every 0.2 s on a daemon thread while started."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid if pid is not None and read_status_bytes(pid, "VmRSS") else None
        self._peak: int | None = None
        self._max_seen: int | None = None  # over the sampler's life, never reset
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def self_process(cls) -> RssSampler:
        return cls(os.getpid())

    def start(self) -> None:
        if self.pid is None or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="agentd-bench-rss", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self.sample()

    def reset(self) -> None:
        self._peak = None
        self.sample()

    def sample(self) -> None:
        if self.pid is None:
            return
        rss = tree_rss_bytes(self.pid)
        if rss is not None and (self._peak is None or rss > self._peak):
            self._peak = rss
        if rss is not None and (self._max_seen is None or rss > self._max_seen):
            self._max_seen = rss

    @property
    def peak_rss_bytes(self) -> int | None:
        return self._peak

    @property
    def hwm_bytes(self) -> int | None:
        hwm = read_status_bytes(self.pid, "VmHWM") if self.pid is not None and not \
            descendants(self.pid) else None
        seen = [b for b in (hwm, self._max_seen) if b is not None]
        return max(seen) if seen else None

    def _loop(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            self.sample()
