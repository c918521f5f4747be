"""A daemon stopped while its model loads exits at once: the load is not waited for.

The model is a tiny llama directory whose ``tokenizer_config.json`` is a named pipe nobody
writes, so reading it blocks forever: a load that never ends, the worst of slow loads (a file on
a dead network mount, a header that claims more than the machine holds). ``agentd start`` serves
``/health`` (503) meanwhile; SIGTERM must end the process (exit 0, its pid file and daemon.json
gone) with a log line that says the load was abandoned. Before, the server waited up to 300 s for
the load to finish.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest


def _health(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code
    except httpx.TransportError:
        return None


@pytest.mark.slow
def test_sigterm_during_a_load_that_never_ends_exits_at_once(tiny_model_factory, daemon_process,
                                                             poll, tmp_path: Path) -> None:
    model = tmp_path / "blocking-model"
    model.mkdir()
    for item in tiny_model_factory("llama").iterdir():
        if item.name != "tokenizer_config.json":
            (model / item.name).symlink_to(item)
    os.mkfifo(model / "tokenizer_config.json")
    daemon = daemon_process(tmp_path / "state", "--model", str(model))
    daemon.start(wait=False)
    try:
        poll(lambda: _health(daemon.url), lambda status: status == 503, timeout_s=120)
        poll(daemon.log, lambda log: "loading model" in log)
        daemon.process.send_signal(signal.SIGTERM)
        code = daemon.process.wait(timeout=60)  # a bound on the wait, not a speed claim
    finally:
        daemon.kill()
    log = daemon.log()
    assert code == 0, log
    assert "stopping while the model is still loading: the load is abandoned and the process " \
           "exits without waiting for it" in log
    assert "exiting during the model load (status 0)" in log
    assert not (tmp_path / "state" / "agentd.pid").exists()
    assert not (tmp_path / "state" / "daemon.json").exists()
