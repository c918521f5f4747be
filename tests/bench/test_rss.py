"""The bench's RSS sampler: peaks since a reset, and a lifetime mark never below what it saw."""

from __future__ import annotations

import os
import subprocess

from agentd.bench import rss
from agentd.bench.rss import RssSampler


def test_lifetime_mark_is_never_below_a_sampled_peak(monkeypatch) -> None:
    """Linux updates VmHWM lazily; a VmRSS sample above it must still count as the peak."""
    readings = {"VmRSS": [100, 300, 200], "VmHWM": [250]}

    def fake(pid: int, field: str) -> int:
        values = readings[field]
        return values.pop(0) if len(values) > 1 else values[0]

    monkeypatch.setattr(rss, "read_status_bytes", fake)
    # the readings are this process's alone: a pytest worker may have children (the daemon a
    # session fixture started), whose reads would take readings from the list
    monkeypatch.setattr(rss, "descendants", lambda pid: [])
    sampler = RssSampler(os.getpid())
    sampler.reset()
    sampler.sample()
    sampler.sample()
    assert sampler.peak_rss_bytes == 300
    assert sampler.hwm_bytes == 300  # VmHWM said 250
    sampler.reset()
    assert sampler.peak_rss_bytes == 200 and sampler.hwm_bytes == 300


def test_a_real_process_and_a_gone_one() -> None:
    sampler = RssSampler.self_process()
    sampler.reset()
    assert sampler.peak_rss_bytes > 10 * 2**20
    assert sampler.hwm_bytes >= sampler.peak_rss_bytes
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = RssSampler(gone.pid)
    dead.start()
    dead.stop()
    assert dead.peak_rss_bytes is None and dead.hwm_bytes is None


def test_a_server_with_child_processes_is_measured_whole() -> None:
    """vLLM runs its model in a child process: the parent's own RSS would hide it."""
    import sys
    import time

    code = "b = bytearray(64 * 2**20); import time; time.sleep(30)"
    parent = subprocess.Popen(["sh", "-c", f"{sys.executable} -c '{code}' & wait"])
    try:
        sampler = RssSampler(parent.pid)
        for _ in range(100):  # until the child has touched its 64 MiB
            sampler.sample()
            if (sampler.peak_rss_bytes or 0) > 64 * 2**20:
                break
            time.sleep(0.1)
        assert rss.read_status_bytes(parent.pid, "VmRSS") < 16 * 2**20  # the shell alone
        assert sampler.peak_rss_bytes > 64 * 2**20
        assert len(rss.descendants(parent.pid)) == 1
    finally:
        for child in rss.descendants(parent.pid):
            os.kill(child, 9)
        parent.kill()
        parent.wait()
