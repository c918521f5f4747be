"""Crashes and a bad state dir never lose or corrupt a user's pins.

``kill -9`` of a real daemon (``python -m agentd.cli start``, tiny model) while a pin is being
registered, and — through the ``AGENTD_TEST_PAUSE_PIN_KV_S`` hook, which holds the daemon halfway
through writing a pin's KV into the block store — while its KV is half written: after a restart
``pins.json`` parses, it is the old registry or the new one, and every pin it lists is restored
and serves cache hits. A full (``/dev/full``) or unwritable state dir: a pin is never
acknowledged (201) nor unpinned (200) unless ``pins.json`` says so — the reply is a 507 and
nothing changes — and a pin that decays meanwhile is reported in ``/v1/stats``
(``pin_persist_error``) and leaves ``pins.json`` once it can be written.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import pytest
from litestar.testing import TestClient

from agentd.server.app import ServerSettings, create_app

LOCAL = "http://127.0.0.1"  # a Host header the daemon answers to (testserver.local is not)

BASE = "You are the base agent. Answer briefly and cite the files you read. " * 6
BIG = json.loads(resources.files("agentd.workloads").joinpath("coding_agent.json")
                 .read_text())["system"]
READY_TIMEOUT_S = 120.0


def pin(daemon: Any, name: str, system: str) -> httpx.Response:
    return httpx.post(f"{daemon.url}/v1/pins", json={"name": name, "system": system},
                      timeout=120)


def cached_tokens(daemon: Any, system: str) -> int:
    reply = httpx.post(f"{daemon.url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "system", "content": system},
                     {"role": "user", "content": "Where do I start?"}], "max_tokens": 2})
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def stop(daemon: Any) -> None:
    assert daemon.stop() == 0, daemon.log()


@pytest.fixture
def daemons(tiny_model_factory, tmp_path, daemon_process) -> Iterator[Any]:
    """Start daemons over one state dir; every one is killed at the end, whatever happens."""
    started: list[Any] = []
    model_dir = tiny_model_factory("llama")

    def start(**env: str) -> Any:
        daemon = daemon_process(tmp_path / "state", "--model", str(model_dir),
                                "--kv-cache-memory", "8MiB", "--log-level", "warning",
                                env={**env, "AGENTD_NUM_THREADS": "1"},
                                ready_timeout_s=READY_TIMEOUT_S)
        started.append(daemon)
        return daemon.start()

    yield start
    for daemon in started:
        daemon.kill()


def registry(state_dir: Path) -> list[str]:
    """The names in pins.json, which must parse as a complete registry document."""
    doc = json.loads((state_dir / "pins.json").read_text(encoding="utf-8"))
    assert doc["version"] == 1 and isinstance(doc["pins"], list)
    return [entry["name"] for entry in doc["pins"]]


def assert_every_listed_pin_serves(daemon: Any, systems: dict[str, str]) -> list[str]:
    names = registry(daemon.state_dir)
    listed = {p["name"]: p for p in httpx.get(f"{daemon.url}/v1/pins", timeout=30).json()["data"]}
    assert sorted(listed) == sorted(names), daemon.log()
    for name in names:
        assert cached_tokens(daemon, systems[name]) >= listed[name]["num_tokens"] > 0
    return names


def _pin_in_background(daemon: Any, name: str, system: str) -> threading.Thread:
    def post() -> None:
        try:
            pin(daemon, name, system)
        except httpx.HTTPError:
            pass  # the daemon was killed under it: that is the point

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
@pytest.mark.parametrize("delay_s", [0.0, 0.15])
def test_kill_during_pin_registration_keeps_old_or_new_registry(daemons, delay_s: float) -> None:
    systems = {"base": BASE, "big": BIG}
    daemon = daemons()
    assert pin(daemon, "base", BASE).status_code == 201
    thread = _pin_in_background(daemon, "big", BIG)
    time.sleep(delay_s)
    daemon.kill()
    thread.join(30)
    names = registry(daemon.state_dir)
    print(f"registry after a kill {delay_s} s into the registration: {names}")
    assert names in (["base"], ["base", "big"])
    restarted = daemons()
    assert assert_every_listed_pin_serves(restarted, systems) == names
    assert pin(restarted, "big", BIG).status_code in (201, 409)  # registering again works
    assert_every_listed_pin_serves(restarted, systems)
    stop(restarted)


@pytest.mark.slow
def test_kill_while_a_pins_kv_is_half_written(daemons) -> None:
    systems = {"base": BASE, "big": BIG}
    daemon = daemons(AGENTD_TEST_PAUSE_PIN_KV_S="60")
    store = daemon.state_dir / "kv-store"
    thread = _pin_in_background(daemon, "base", BASE)
    deadline = time.monotonic() + 60
    while not any(p.stat().st_size for p in store.glob("*/*.pin.seg")):  # it sleeps mid-write
        assert time.monotonic() < deadline, daemon.log()
        time.sleep(0.05)
    assert registry(daemon.state_dir) == ["base"]  # pins.json was committed before the KV
    (half,) = store.glob("*/*.pin.seg")
    daemon.kill()
    thread.join(30)
    restarted = daemons()
    assert assert_every_listed_pin_serves(restarted, systems) == ["base"]
    (entry,) = httpx.get(f"{restarted.url}/v1/stats").json()["pin_restore"]
    # half its records were pinned: the rest was read from the disk tier's own copies of the
    # pin's blocks where they are all there (the tail is the pin's alone), else recomputed
    assert entry["source"] == "store" or "not in the store" in entry["kv_error"], entry
    segments = list(store.glob("*/*.pin.seg"))  # the pin stored whole again, pinned...
    assert len(segments) == 1 and segments[0] != half
    assert half.with_name(half.name.replace(".pin", "")).exists()  # ... the half one demoted
    stop(restarted)
    again = daemons()  # and a clean restart restores from it
    assert assert_every_listed_pin_serves(again, systems) == ["base"]
    stop(again)


# --- a full or unwritable state dir ------------------------------------------------------------
@pytest.fixture
def state_client(tiny, tmp_path) -> Iterator[tuple[TestClient, Path]]:
    config, engine = tiny
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    app = create_app(config, engine=engine, settings=ServerSettings(state_dir=state_dir))
    with TestClient(app, base_url=LOCAL) as client:
        yield client, state_dir


def break_registry(state_dir: Path, how: str) -> str:
    """Make the next write of pins.json fail; returns what its error says. The write goes
    through ``.pins.json.<pid>.tmp``: a link there to /dev/full gives ENOSPC (a full disk; the
    failed write removes the link again), a directory there EISDIR (root ignores file modes)."""
    tmp = state_dir / f".pins.json.{os.getpid()}.tmp"
    if how == "full":
        tmp.symlink_to("/dev/full")
        return "No space left"
    tmp.mkdir()
    return "directory"


def repair_registry(state_dir: Path) -> None:
    tmp = state_dir / f".pins.json.{os.getpid()}.tmp"
    if tmp.is_symlink():
        tmp.unlink()
    elif tmp.is_dir():
        tmp.rmdir()


def registry_or_none(state_dir: Path) -> list[str]:
    return registry(state_dir) if (state_dir / "pins.json").exists() else []


@pytest.mark.parametrize("how", ["full", "unwritable"])
def test_a_pin_is_acknowledged_only_once_pins_json_holds_it(state_client, how: str,
                                                           openai_error, idle) -> None:
    """201 and 200 mean pins.json is written; when it cannot be, the reply is a 507 that names
    the file and nothing changes: no pin is added, none is removed."""
    client, state_dir = state_client
    says = break_registry(state_dir, how)
    error = openai_error(client.post("/v1/pins", json={"name": "mem", "system": BASE}), 507)
    assert error["code"] == "insufficient_storage", error
    assert says in error["message"] and str(state_dir / "pins.json") in error["message"], error
    assert "was not registered" in error["message"], error
    assert client.get("/v1/pins").json()["data"] == [] and registry_or_none(state_dir) == []
    idle(client.get, num_pinned_ok=False)  # the engine let its blocks go again
    repair_registry(state_dir)

    created = client.post("/v1/pins", json={"name": "mem", "system": BASE})
    assert created.status_code == 201, created.text
    assert registry(state_dir) == ["mem"]
    try:
        break_registry(state_dir, how)
        error = openai_error(client.delete("/v1/pins/mem"), 507)
        assert "was not unpinned" in error["message"] and says in error["message"], error
        assert registry(state_dir) == ["mem"]
        assert [p["name"] for p in client.get("/v1/pins").json()["data"]] == ["mem"]
        reply = client.post("/v1/chat/completions", json={"max_tokens": 2, "messages": [
            {"role": "system", "content": BASE}, {"role": "user", "content": "hi"}]})
        assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= \
            created.json()["num_tokens"]
    finally:
        repair_registry(state_dir)
        assert client.delete("/v1/pins/mem").status_code == 200
    assert registry(state_dir) == []
    idle(client.get, num_pinned_ok=False)


def test_a_pin_that_decays_leaves_pins_json_once_it_can_be_written(state_client, poll,
                                                                  idle) -> None:
    """A TTL that lapses while pins.json cannot be written is reported, and the registry
    catches up by itself once it can be: the decayed pin does not come back at a restart."""
    client, state_dir = state_client
    # a TTL that cannot lapse before the registry is broken, however loaded the machine (a
    # 1 s TTL once lapsed, and was written, first)
    created = client.post("/v1/pins", json={"name": "brief", "system": BASE, "ttl": 5})
    assert created.status_code == 201, created.text
    break_registry(state_dir, "unwritable")
    try:
        poll(lambda: client.get("/v1/pins").json()["data"], lambda data: data == [])
        assert registry(state_dir) == ["brief"]
        error = client.get("/v1/stats").json()["pin_persist_error"]
        assert error and "pins.json" in error, error
    finally:
        repair_registry(state_dir)
    poll(lambda: registry(state_dir), lambda names: names == [])  # no request needed
    assert client.get("/v1/stats").json()["pin_persist_error"] is None
    idle(client.get, num_pinned_ok=False)
