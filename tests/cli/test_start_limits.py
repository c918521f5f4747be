"""``agentd start`` with options larger than the machine: refused at start, in one line that
names the option and both figures (what the pool needs, what the machine has free), before
anything is allocated for it: the daemon's peak RSS stays that of a loaded tiny model.

The daemon runs in the foreground in a child process, as a user runs it, under an address-space
cap: a tree that tried to build such a pool fails the test on its MemoryError, not the machine.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

GiB = 2**30
# a tiny daemon maps ~1.2 GiB on 2 cores (more on more cores: a malloc arena and a stack a thread)
ADDRESS_SPACE_CAP_BYTES = 8 * GiB


def _cap_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_CAP_BYTES, ADDRESS_SPACE_CAP_BYTES))


def run_start(args: list[str], state_dir: Path, timeout_s: float = 300
              ) -> tuple[int, str, int]:
    """``agentd start ARGS`` in the foreground, to its exit: its status, its output and its
    peak RSS in bytes (``wait4``'s, of that one process)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("AGENTD_") or k == "AGENTD_CACHE_DIR"}
    env["AGENTD_HOME"] = str(state_dir)
    with tempfile.TemporaryFile() as out:
        process = subprocess.Popen([sys.executable, "-m", "agentd.cli", "start", *args],
                                   stdout=out, stderr=subprocess.STDOUT, env=env,
                                   preexec_fn=_cap_address_space)
        timer = threading.Timer(timeout_s, process.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(process.pid, 0)
        finally:
            timer.cancel()
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        return process.returncode, out.read().decode(errors="replace"), usage.ru_maxrss * 1024


def test_a_kv_cache_larger_than_the_machine_is_refused_before_it_is_allocated(
        tiny_model_factory, free_port, tmp_path) -> None:
    code, output, peak_rss = run_start(
        ["--model", str(tiny_model_factory("llama")), "--device", "cpu", "--port",
         str(free_port()), "--state-dir", str(tmp_path / "state"),
         "--kv-cache-memory", "64TiB"], tmp_path / "state")
    assert code == 1, output[-3000:]
    lines = [line for line in output.splitlines() if "KV pool" in line]
    assert len(lines) == 1, output[-3000:]
    line = lines[0]
    assert "--kv-cache-memory asks for a KV pool of 64.0 TiB (8,589,934,592 blocks)" in line
    # the tightest of the machine's figures: here the test's own address-space cap, or less
    assert re.search(r"[GM]iB free \((ulimit -v|MemAvailable|cgroup memory limit)\); lower "
                     r"--kv-cache-memory to at most \d", line), line
    assert peak_rss < GiB, f"peak RSS {peak_rss / GiB:.1f} GiB:\n{output[-3000:]}"
