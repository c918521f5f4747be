"""What memory a new KV pool may take on its device at start, and which limit says so.

Invariant: on the CPU the figure is the least of what the kernel can hand out without swapping
(``MemAvailable``), what the process's cgroup still allows at every level up to the root (its
memory limit less its working set: usage less inactive page cache, as container runtimes count
it), and the address space ``ulimit -v`` leaves (a pool maps its whole size at once, written or
not); on a GPU it is the device's free memory. Each figure names its source, which the messages
that quote it repeat. None: no figure could be read.
"""

from __future__ import annotations

import resource
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch

UNLIMITED_BYTES = 2**60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


@dataclass(frozen=True)
class FreeMemory:
    """Bytes a new pool may take, and the limit they come from (for messages)."""

    num_bytes: int
    source: str  # "MemAvailable", "cgroup memory limit", "ulimit -v", "free memory of cuda:0"
    mapped_included: bool = False  # memory-mapped weights already count against it (ulimit -v)


MemoryProbe = Callable[[torch.device], FreeMemory | None]


def free_memory(device: torch.device) -> FreeMemory | None:
    """The memory free for a new pool on ``device``: the least of the limits that apply."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return FreeMemory(int(free), f"free memory of {device}")
    figures = [f for f in (mem_available(), cgroup_headroom(), address_space_headroom())
               if f is not None]
    return min(figures, key=lambda f: f.num_bytes, default=None)


def proc_status_bytes(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (VmRSS, VmHWM, RssAnon) in bytes; None if absent."""
    return _kb_field(Path("/proc/self/status"), field)


def mem_available() -> FreeMemory | None:
    """``MemAvailable`` of ``/proc/meminfo``: what the kernel can hand out without swapping."""
    num_bytes = _kb_field(Path("/proc/meminfo"), "MemAvailable")
    return None if num_bytes is None else FreeMemory(num_bytes, "MemAvailable")


def address_space_headroom() -> FreeMemory | None:
    """The address space ``ulimit -v`` (RLIMIT_AS) leaves this process; None when unlimited."""
    limit, _ = resource.getrlimit(resource.RLIMIT_AS)
    mapped = proc_status_bytes("VmSize")
    if limit == resource.RLIM_INFINITY or mapped is None:
        return None
    return FreeMemory(max(limit - mapped, 0), "ulimit -v", mapped_included=True)


def cgroup_headroom(cgroup_file: Path = Path("/proc/self/cgroup"),
                    mount: Path = Path("/sys/fs/cgroup")) -> FreeMemory | None:
    """What this process's memory cgroups (v2 or v1) still allow, the tightest level's; None
    when no level has a limit (or none can be read)."""
    try:
        lines = cgroup_file.read_text().splitlines()
    except OSError:
        return None
    headrooms: list[int] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # the v2 hierarchy
            files = (mount, "memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            files = (mount / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes",
                     "total_inactive_file")
        else:
            continue
        for directory in _levels(files[0], path):
            headroom = _headroom(directory, *files[1:])
            if headroom is not None:
                headrooms.append(headroom)
    return FreeMemory(min(headrooms), "cgroup memory limit") if headrooms else None


def _levels(mount: Path, path: str) -> list[Path]:
    """The cgroup's directory and its ancestors' under ``mount`` that exist (in a container the
    mount's root is often the container's own cgroup, whatever the path says)."""
    parts = PurePosixPath(path).relative_to("/").parts if path.startswith("/") else ()
    levels = [mount.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
    return [level for level in levels if level.is_dir()]


def _headroom(directory: Path, limit_name: str, usage_name: str, inactive_key: str
              ) -> int | None:
    """A level's limit less its working set; None without a limit (or a readable usage)."""
    try:
        limit_text = (directory / limit_name).read_text().strip()
        if limit_text == "max" or int(limit_text) >= UNLIMITED_BYTES:
            return None
        usage = int((directory / usage_name).read_text())
    except (OSError, ValueError):
        return None
    return max(int(limit_text) - max(usage - _stat(directory, inactive_key), 0), 0)


def _stat(directory: Path, key: str) -> int:
    """A counter of the level's ``memory.stat``; 0 when absent."""
    try:
        for line in (directory / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        return 0
    return 0


def _kb_field(path: Path, field: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
