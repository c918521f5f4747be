"""The server's life: 503 while the model loads (and after a failed load), 200 once ready; the
shutdown route; and clients that disconnect mid-request — over a real uvicorn socket — abort
their request and give its blocks back."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from litestar.testing import TestClient

from agentd.config import EngineConfig
from agentd.engine.async_engine import AsyncEngine
from agentd.server.app import create_app

LOCAL = "http://127.0.0.1"  # a Host header the daemon answers to (testserver.local is not)

USER = [{"role": "user", "content": "Tell me a long story about caches."}]
LONG = {"messages": USER, "max_tokens": 3000, "ignore_eos": True, "temperature": 0}


def test_health_is_503_while_loading_then_200(tiny, monkeypatch, poll) -> None:
    config, _ = tiny
    gate = threading.Event()
    real_from_config = AsyncEngine.from_config.__func__

    def gated(cls: type[AsyncEngine], cfg: EngineConfig) -> AsyncEngine:
        assert gate.wait(60)
        return real_from_config(cls, cfg)

    monkeypatch.setattr(AsyncEngine, "from_config", classmethod(gated))
    with TestClient(create_app(config), base_url=LOCAL) as client:
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        for response in (client.get("/v1/models"), client.get("/v1/stats"),
                         client.post("/v1/chat/completions", json={"messages": USER})):
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "model_loading"
        gate.set()
        poll(lambda: client.get("/health"), lambda r: r.status_code == 200)
        assert client.get("/health").json()["model"] == "tiny-llama"
        reply = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
        assert reply.status_code == 200


def test_failed_load_is_reported_and_asks_to_exit(tmp_path, poll) -> None:
    exit_codes: list[int] = []
    config = EngineConfig(model=str(tmp_path / "no-such-model"))
    with TestClient(create_app(config, request_exit=exit_codes.append), base_url=LOCAL) as client:
        health = poll(lambda: client.get("/health").json(), lambda h: h["status"] == "error")
        assert "model not found" in health["error"]
        assert client.get("/health").status_code == 503
        error = client.get("/v1/models").json()["error"]
        assert "failed to load" in error["message"]
    assert exit_codes == [1]


def test_shutdown_route_asks_the_server_to_exit(tiny) -> None:
    config, engine = tiny
    exit_codes: list[int] = []
    with TestClient(create_app(config, engine=engine, request_exit=exit_codes.append),
                    base_url=LOCAL) as client:
        refused = client.post("/admin/shutdown")  # a web page cannot stop a keyless daemon
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "missing_token"
        token = client.app.state.agentd.cli_token
        response = client.post("/admin/shutdown", headers={"x-agentd-token": token})
        assert response.status_code == 202 and response.json()["status"] == "stopping"
    assert exit_codes == [0]
    assert engine.running  # an engine passed in belongs to the caller: still running


@pytest.fixture
def live_url(tiny, serve) -> Iterator[str]:
    config, engine = tiny
    with serve(create_app(config, engine=engine)) as url:
        yield url


def _stats(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/v1/stats").json()


def test_stream_disconnect_aborts_and_frees_blocks(live_url: str, wait_idle) -> None:
    before = _stats(live_url)
    with httpx.stream("POST", f"{live_url}/v1/chat/completions",
                      json={**LONG, "stream": True}, timeout=30) as response:
        lines = response.iter_lines()
        data = [line for line in (next(lines) for _ in range(12)) if line.startswith("data:")]
        assert len(data) >= 3  # role chunk and some content: the request is running
    after = wait_idle(lambda: _stats(live_url))
    assert after["num_requests_finished"] == before["num_requests_finished"] + 1
    assert after["generation_tokens_total"] - before["generation_tokens_total"] < 3000


def test_non_stream_disconnect_aborts_and_frees_blocks(live_url: str, wait_idle) -> None:
    before = _stats(live_url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live_url}/v1/chat/completions", json=LONG, timeout=1.0)
    after = wait_idle(lambda: _stats(live_url))
    assert after["num_requests_finished"] == before["num_requests_finished"] + 1
    assert after["generation_tokens_total"] - before["generation_tokens_total"] < 3000
    # and the server still serves
    reply = httpx.post(f"{live_url}/v1/chat/completions", json={"messages": USER,
                                                                 "max_tokens": 2}, timeout=30)
    assert reply.status_code == 200


def test_shutdown_aborts_streams_after_the_grace_period(tiny, poll, tmp_path) -> None:
    """``serve`` (what ``agentd start`` runs): a stream still running when the grace period ends
    is aborted cleanly — a final ``abort`` chunk and ``[DONE]`` — and serve returns 0."""
    from agentd.server.serve import serve
    from agentd.server.settings import ServerSettings

    config, _ = tiny
    sock = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    status: list[int] = []
    thread = threading.Thread(daemon=True, target=lambda: status.append(serve(
        config, ServerSettings(shutdown_grace_s=1.0, state_dir=tmp_path), sock,
        log_level="warning")))
    thread.start()
    poll(lambda: _health_code(url), lambda code: code == 200)
    token = {"x-agentd-token": (tmp_path / "cli.token").read_text().strip()}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**LONG, "stream": True},
                      timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert httpx.post(f"{url}/admin/shutdown", headers=token).status_code == 202
        data = [line for line in lines if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]"
    assert '"finish_reason":"abort"' in data[-2]
    thread.join(30)
    assert status == [0]


def _health_code(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/health").status_code
    except httpx.TransportError:
        return None
