"""The memory a new KV pool may take, and which limit says so (``agentd.engine.free_memory``):
the least of ``MemAvailable``, the cgroup's memory limit less its working set (at every level, v2
and v1, read from a cgroup tree built here) and the address space ``ulimit -v`` leaves (set for
real, in a child process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from agentd.engine.free_memory import FreeMemory, cgroup_headroom

GiB, MiB = 2**30, 2**20


def write_level(directory: Path, files: dict[str, object]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (directory / name).write_text(f"{value}\n")


def test_a_cgroup_v2_limit_is_its_tightest_level_less_the_working_set(tmp_path) -> None:
    cgroup_file = tmp_path / "cgroup"
    cgroup_file.write_text("0::/agents.slice/agentd.service\n")
    mount = tmp_path / "sys"
    write_level(mount / "agents.slice" / "agentd.service",
                {"memory.max": 4 * GiB, "memory.current": 3 * GiB,
                 "memory.stat": f"anon {2 * GiB}\ninactive_file {GiB}"})  # 2 GiB left
    write_level(mount / "agents.slice", {"memory.max": "max", "memory.current": 3 * GiB})
    write_level(mount, {"memory.current": 9 * GiB})  # the root has no limit file
    assert cgroup_headroom(cgroup_file, mount) == FreeMemory(2 * GiB, "cgroup memory limit")
    write_level(mount / "agents.slice", {"memory.max": 3 * GiB + 512 * MiB})  # tighter above
    assert cgroup_headroom(cgroup_file, mount) == FreeMemory(512 * MiB, "cgroup memory limit")


def test_a_cgroup_v1_limit_is_read_where_the_container_mounts_its_own_cgroup(tmp_path) -> None:
    cgroup_file = tmp_path / "cgroup"
    cgroup_file.write_text("5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    mount = tmp_path / "sys"
    # in a container the memory mount's root is the container's cgroup; /docker/abc is absent
    write_level(mount / "memory", {"memory.limit_in_bytes": 2 * GiB,
                                   "memory.usage_in_bytes": GiB,
                                   "memory.stat": f"cache {GiB}\ntotal_inactive_file {GiB // 2}"})
    assert cgroup_headroom(cgroup_file, mount) == FreeMemory(GiB + GiB // 2,
                                                             "cgroup memory limit")
    write_level(mount / "memory", {"memory.limit_in_bytes": 9223372036854771712})  # no limit
    assert cgroup_headroom(cgroup_file, mount) is None
    assert cgroup_headroom(tmp_path / "no-such-file", mount) is None


_UNDER_ULIMIT = """
import resource, sys, torch
from agentd.config import EngineConfig
from agentd.engine.free_memory import free_memory, proc_status_bytes
from agentd.engine.llm_engine import LLMEngine
from agentd.llm import LLM

tiny = LLM(sys.argv[1], device="cpu", kv_cache_memory_bytes=2 * 2**20)
cap = proc_status_bytes("VmSize") + 768 * 2**20
resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
free = free_memory(torch.device("cpu"))
print(free.source, free.num_bytes <= 768 * 2**20, free.mapped_included)
config = EngineConfig(model=sys.argv[1], device="cpu", kv_cache_memory_bytes=2 * 2**30)
try:
    LLMEngine(config, loaded=tiny.engine.loaded)
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def test_an_explicit_pool_past_ulimit_v_is_refused_naming_it(tiny_model_factory) -> None:
    """``MemAvailable`` would take a 2 GiB pool; the address space left under ``ulimit -v``
    would not (numpy's own "Unable to allocate" once, at the runner's allocation)."""
    done = subprocess.run([sys.executable, "-c", _UNDER_ULIMIT, str(tiny_model_factory("llama"))],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    figure, refusal = done.stdout.splitlines()[-2:]
    assert figure == "ulimit -v True True"
    assert refusal.startswith("ValueError --kv-cache-memory asks for a KV pool of 2.0 GiB"), refusal
    assert "free (ulimit -v); lower --kv-cache-memory to at most " in refusal
