"""What a web page and a slow client can do to a daemon without a key: nothing.

A page may send cross-site "simple" requests (text/plain, form or untyped bodies, no preflight)
and a DNS-rebinding page reaches 127.0.0.1 under its own name; both are refused before a handler
runs, and change nothing. ``/admin/shutdown`` needs the local token (or a key). Only
``--cors-origin`` origins get CORS headers. Clients that trickle headers or bodies are answered
408 and disconnected within the read timeout, and a request counts as arriving (the engine's
gather wait) only once its body is whole.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from litestar.testing import TestClient

from agentd.server.app import ServerSettings, create_app
from agentd.server.web_guard import host_allowed

LOCAL = "http://127.0.0.1"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PINS = "/v1/pins"
BODIES = {CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
          COMPLETIONS: {"prompt": "hi", "max_tokens": 2},
          PINS: {"name": "from-a-page", "system": "You are a page's agent. " * 10}}
READ_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def client(tiny) -> Iterator[TestClient]:
    config, engine = tiny
    with TestClient(create_app(config, engine=engine), base_url=LOCAL) as test_client:
        yield test_client


@pytest.mark.parametrize("content_type", [
    "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x", None])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, PINS])
def test_a_body_that_is_not_declared_json_is_415_and_changes_nothing(
        client: TestClient, path: str, content_type: str | None, openai_error, idle) -> None:
    """What a page can send cross-site without a preflight: refused before parsing."""
    headers = {} if content_type is None else {"content-type": content_type}
    request = client.build_request("POST", path, content=json.dumps(BODIES[path]).encode(),
                                   headers=headers)
    assert "content-type" not in request.headers or content_type is not None  # a Blob body
    error = openai_error(client.send(request), 415)
    assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]
    assert client.get(PINS).json()["data"] == []
    idle(client.get, num_pinned_ok=False)


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8",
                                          "Application/JSON", "application/vnd.agent+json"])
def test_json_content_types_are_served(client: TestClient, content_type: str, idle) -> None:
    response = client.post(CHAT, content=json.dumps(BODIES[CHAT]).encode(),
                           headers={"content-type": content_type})
    assert response.status_code == 200, response.text
    idle(client.get, num_pinned_ok=False)


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.nip.io:8000",
                                  "localhost.evil.example", "[::2]:8000"])
@pytest.mark.parametrize("method,path", [("POST", CHAT), ("POST", PINS), ("GET", "/v1/models"),
                                         ("GET", "/v1/stats"), ("POST", "/admin/shutdown")])
def test_a_foreign_host_header_is_403_on_every_route(client: TestClient, host: str,
                                                     method: str, path: str, openai_error,
                                                     idle) -> None:
    """DNS rebinding: the page's own name in Host, the daemon's address underneath."""
    response = client.request(method, path, json=BODIES.get(path), headers={"host": host})
    error = openai_error(response, 403)
    assert error["code"] == "host_not_allowed" and "--allowed-hosts" in error["message"]
    assert client.get(PINS).json()["data"] == []
    idle(client.get, num_pinned_ok=False)


def test_host_names_a_daemon_answers_to() -> None:
    local = ("localhost", "localhost:8000", "127.0.0.1:9", "[::1]:8000", "app.localhost:3000",
             "LOCALHOST.", None)
    assert all(host_allowed(h, "127.0.0.1", ()) for h in local)
    assert not any(host_allowed(h, "127.0.0.1", ()) for h in
                   ("evil.example", "10.0.0.7:8000", "myhost", "localhost.evil.example"))
    allowed = ("myhost.lan", "*.corp.example")
    assert host_allowed("myhost.lan:8000", "127.0.0.1", allowed)
    assert host_allowed("gpu1.corp.example", "127.0.0.1", allowed)
    assert not host_allowed("corp.example.evil", "127.0.0.1", allowed)
    assert host_allowed("anything", "127.0.0.1", ("*",))
    assert host_allowed("192.168.1.5:8000", "192.168.1.5", ())
    # bound to every interface: any address of the machine, its name, never a foreign name
    assert host_allowed("10.0.0.7:8000", "0.0.0.0", ()) and host_allowed("[fe80::1]", "::", ())
    assert host_allowed(socket.gethostname(), "0.0.0.0", ())
    assert not host_allowed("evil.example", "0.0.0.0", ())


def test_shutdown_needs_the_local_token_without_keys(client: TestClient, openai_error) -> None:
    """Body-less, so the content-type check cannot stop it: a page's POST is refused (401)."""
    for headers in ({}, {"x-agentd-token": "guess"}, {"x-agentd-token": ""}):
        error = openai_error(client.post("/admin/shutdown", headers=headers), 401)
        assert error["code"] == "missing_token" and "agentd stop" in error["message"]
    assert client.get("/health").json()["status"] == "ready"


def test_stop_without_the_daemons_state_dir_says_where_it_looked(tiny, serve,
                                                                   tmp_path) -> None:
    """``agentd stop`` pointed at another state dir: no token there (or another start's) is
    what it says, with the dir and how to point at the daemon's, never that a key is needed."""
    from click.testing import CliRunner

    from agentd.cli import main

    config, engine = tiny
    settings = ServerSettings(state_dir=tmp_path / "daemon")
    elsewhere = tmp_path / "elsewhere"
    with serve(create_app(config, engine=engine, settings=settings)) as url:
        for token in (None, "another-starts-token"):
            if token is not None:
                elsewhere.mkdir()
                (elsewhere / "cli.token").write_text(token)
            result = CliRunner().invoke(main, ["stop", "--url", url, "--state-dir",
                                               str(elsewhere)], env={"AGENTD_API_KEY": ""})
            assert result.exit_code == 1, result.output
            [line] = [text for text in result.output.splitlines() if text.strip()]
            found = "no local daemon token was found in the state dir" if token is None \
                else "is not the daemon's"
            assert found in line and str(elsewhere) in line, line
            assert "--state-dir" in line and "AGENTD_HOME" in line and "API key" not in line
        assert (tmp_path / "daemon" / "cli.token").exists()
        assert httpx.get(f"{url}/health").json()["status"] == "ready"


PREFLIGHT = {"origin": "http://localhost:3000", "access-control-request-method": "POST",
             "access-control-request-headers": "authorization, content-type"}


def test_no_cors_by_default(client: TestClient) -> None:
    preflight = client.options(CHAT, headers=PREFLIGHT)
    assert "access-control-allow-origin" not in preflight.headers
    reply = client.post(CHAT, json=BODIES[CHAT], headers={"origin": "http://localhost:3000"})
    assert reply.status_code == 200 and "access-control-allow-origin" not in reply.headers


def test_cors_origin_gets_preflights_and_headers_others_do_not(tiny, idle) -> None:
    config, engine = tiny
    settings = ServerSettings(cors_origins=("http://localhost:3000",))
    with TestClient(create_app(config, engine=engine, settings=settings),
                    base_url=LOCAL) as cors:
        preflight = cors.options(CHAT, headers=PREFLIGHT)
        assert preflight.status_code == 204, preflight.text
        assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        allowed_headers = preflight.headers["access-control-allow-headers"].lower()
        assert "authorization" in allowed_headers and "content-type" in allowed_headers
        reply = cors.post(CHAT, json=BODIES[CHAT], headers={"origin": "http://localhost:3000"})
        assert reply.status_code == 200
        assert reply.headers["access-control-allow-origin"] == "http://localhost:3000"
        other = cors.options(CHAT, headers={**PREFLIGHT, "origin": "http://evil.example"})
        assert other.status_code >= 400
        assert other.headers.get("access-control-allow-origin") != "http://evil.example"
        idle(cors.get, num_pinned_ok=False)


# --- slow clients --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slow_server(tiny) -> Iterator[tuple[str, int, Any]]:
    """The app under uvicorn with agentd's HTTP protocol (``agentd start``'s), 1 s read
    timeout: (host, port, engine)."""
    import uvicorn

    from agentd.server.serve import http_protocol

    config, engine = tiny
    app = create_app(config, engine=engine,
                     settings=ServerSettings(read_timeout_s=READ_TIMEOUT_S))
    sock = socket.create_server(("127.0.0.1", 0), backlog=256)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                           http=http_protocol(READ_TIMEOUT_S)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield "127.0.0.1", sock.getsockname()[1], engine
    server.should_exit = True
    thread.join(30)
    sock.close()


HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\n")


class Trickler:
    """A socket that sends ``first`` at once, then ``rest`` one byte every ``gap_s``."""

    def __init__(self, address: tuple[str, int], first: bytes, rest: bytes,
                 gap_s: float = 0.2) -> None:
        self.sock = socket.create_connection(address, timeout=10)
        self.sock.sendall(first)
        self.rest, self.gap_s = rest, gap_s
        self.started = time.monotonic()
        self.reply = b""
        self.closed_after_s: float | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.sock.settimeout(self.gap_s)
        for byte in self.rest:
            try:
                self.sock.sendall(bytes([byte]))
                chunk = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                break
            if not chunk:
                break
            self.reply += chunk
        self.sock.settimeout(10)
        try:
            while chunk := self.sock.recv(4096):
                self.reply += chunk
        except OSError:
            pass
        self.closed_after_s = time.monotonic() - self.started
        self.sock.close()


def body_of(content: bytes) -> bytes:
    return b"Content-Length: %d\r\n\r\n" % len(content)


@pytest.mark.parametrize("phase", ["headers", "body", "connect only"])
def test_a_trickling_client_gets_408_and_is_disconnected(slow_server, phase: str) -> None:
    """Bounds: not before the timeout, and well before the trickle would end (60 s)."""
    host, port, _ = slow_server
    content = json.dumps(BODIES[CHAT]).encode() + b" " * 300
    if phase == "headers":
        client = Trickler((host, port), HEAD, body_of(content) + content)
    elif phase == "body":
        client = Trickler((host, port), HEAD + body_of(content) + content[:5], content[5:])
    else:
        client = Trickler((host, port), b"", b"")
    client.thread.join(READ_TIMEOUT_S + 10)
    assert client.closed_after_s is not None, "the slow client was never disconnected"
    assert READ_TIMEOUT_S - 0.1 <= client.closed_after_s <= READ_TIMEOUT_S + 5
    assert client.reply.startswith(b"HTTP/1.1 408 "), client.reply[:200]
    assert b'"code":"request_timeout"' in client.reply


def test_trickling_bodies_do_not_count_as_arriving_and_service_goes_on(slow_server) -> None:
    """50 sockets trickling bodies: the engine's arriving count (which makes an idle engine
    hold its first step up to 20 ms for them) stays 0, and other requests are served."""
    import httpx

    host, port, engine = slow_server
    content = json.dumps(BODIES[CHAT]).encode()
    clients = [Trickler((host, port), HEAD + body_of(content) + content[:10], content[10:],
                        gap_s=0.05) for _ in range(50)]
    time.sleep(0.3)
    assert engine.arriving == 0
    reply = httpx.post(f"http://{host}:{port}{CHAT}", json=BODIES[CHAT], timeout=30)
    assert reply.status_code == 200, reply.text
    for client in clients:
        client.thread.join(READ_TIMEOUT_S + 10)
        assert client.reply.startswith(b"HTTP/1.1 408 "), client.reply[:200]
    assert engine.arriving == 0
