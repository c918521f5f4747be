"""What keeps web pages and slow clients out, before a request reaches its handler.

A daemon on 127.0.0.1 without a key is reachable from every web page the user opens: a page
may send "simple" cross-site requests (``text/plain``, form or untyped bodies) without a CORS
preflight, and a DNS-rebinding page reaches the daemon under its own domain name and can read
the replies. Invariants of ``web_guard``, a Litestar middleware on every route (its refusals are
raised, so each answers in its route's wire shape, and close the connection):

- Host: a request whose ``Host`` names neither a loopback name, the address the daemon is bound
  to, nor one of ``allowed_hosts`` is refused with a 403 (what Ollama and vLLM do against DNS
  rebinding). A daemon bound to every interface also answers to IP literals and this machine's
  name.
- Content type: a request that carries a body must say it is JSON (``application/json`` or
  ``application/*+json``), else 415: a page cannot send that cross-site without a preflight,
  which only ``--cors-origin`` origins pass.
- Body: read whole before the handler starts, within ``read_timeout_s``; a client that trickles
  it is answered 408 and disconnected. So a request counts as arriving (the engine's gather wait,
  ``count_arrivals``) only once its body is complete. A body sent with ``Content-Encoding: gzip``
  or ``zstd`` (Codex can compress its requests) reaches the handler decompressed, and the size
  limit holds for what it decompresses to: decompression stops one byte past it, so a
  compression bomb is a 413 after reading the limit, never a hang; another encoding is a 415.

``POST /admin/shutdown`` takes no body, so it needs a key or the token ``agentd start`` writes
to the state dir (``require_local_token``). Header read timeouts live in the HTTP protocol
(``agentd.server.serve``), which sees a request before any ASGI app does.
"""

from __future__ import annotations

import asyncio
import hmac
import io
import ipaddress
import socket
import time
import zlib
from typing import Any

from agentd.server.errors import APIError
from agentd.server.local_token import TOKEN_FILE, TOKEN_HEADER

# A refusal leaves the body unread: the connection cannot carry another request.
_CLOSE = {"connection": "close"}
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_WILDCARDS = frozenset({"", "0.0.0.0", "::"})


def host_allowed(host_header: str | None, bind_host: str, allowed_hosts: tuple[str, ...]) -> bool:
    """Whether a request with this ``Host`` header may reach a daemon bound to ``bind_host``."""
    if host_header is None:
        return True  # HTTP/1.0 clients; every browser sends Host
    name = _host_name(host_header)
    if name in LOOPBACK_NAMES or name.endswith(".localhost") or name == bind_host.lower():
        return True
    for pattern in allowed_hosts:
        pattern = pattern.lower().rstrip(".")
        if pattern == "*" or name == pattern or (
                pattern.startswith("*.") and name.endswith(pattern[1:])):
            return True
    if bind_host in _WILDCARDS:
        return _is_ip(name) or name == socket.gethostname().lower()
    return False


def _host_name(host_header: str) -> str:
    host = host_header.strip().lower()
    if host.startswith("["):  # [::1]:8000
        return host[1:].partition("]")[0]
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def is_json(content_type: str | None) -> bool:
    media = (content_type or "").partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                           and media.endswith("+json"))


def web_guard(app: Any, *, server: Any) -> Any:
    """ASGI middleware: the Host and content-type checks, and the whole body within the read
    timeout (see the module docstring)."""

    async def middleware(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        settings = server.settings
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        if not host_allowed(headers.get("host"), settings.bind_host, settings.allowed_hosts):
            name = _host_name(headers["host"])
            raise APIError(
                403, f"this daemon does not answer to the Host {name!r} (a guard against DNS "
                f"rebinding); if you reach it by that name, start it with --allowed-hosts {name}",
                code="host_not_allowed", headers=_CLOSE)
        if not _has_body(headers):
            await app(scope, receive, send)
            return
        if not is_json(headers.get("content-type")):
            got = headers.get("content-type") or "none"
            raise APIError(
                415, f"the request body must be JSON, sent with 'Content-Type: application/json' "
                f"(got {got!r})", code="unsupported_media_type", headers=_CLOSE)
        body = await _read_body(receive, settings.read_timeout_s,
                                settings.max_request_body_bytes)
        if body is None:
            return  # the client went away
        if isinstance(body, APIError):
            raise body
        encoding = headers.get("content-encoding", "identity").strip().lower()
        data = b"".join(m.get("body", b"") for m in body)
        if encoding not in ("", "identity") and len(data) <= settings.max_request_body_bytes:
            plain = _decompressed(data, encoding, settings.max_request_body_bytes)
            body = [{"type": "http.request", "more_body": False, "body": plain}]
            scope = {**scope, "headers": _plain_headers(scope["headers"], plain)}
        await app(scope, _replay(body, receive), send)

    return middleware


def _decompressed(data: bytes, encoding: str, max_bytes: int) -> bytes:
    """``data`` decoded, at most ``max_bytes`` of it (a 413 past them, a 400 if corrupt)."""
    if encoding not in ("gzip", "zstd"):
        raise APIError(415, f"Content-Encoding {encoding!r} is not supported: send the body "
                       "plain, or compressed with gzip or zstd", code="unsupported_media_type",
                       headers=_CLOSE)
    import zstandard  # one import, once a compressed body comes

    try:
        if encoding == "gzip":
            inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
            out = inflater.decompress(data, max_bytes + 1)
        else:
            with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)) as reader:
                out = reader.read(max_bytes + 1)
    except (zlib.error, zstandard.ZstdError, ValueError, OSError) as exc:
        raise APIError(400, f"the request body is not valid {encoding}: {exc}",
                       code="invalid_body") from exc
    if len(out) > max_bytes:
        raise APIError(413, f"the request body decompresses to more than the {max_bytes}-byte "
                       "limit (--max-request-body)", code="request_too_large", headers=_CLOSE)
    return out


def _plain_headers(headers: list[tuple[bytes, bytes]], body: bytes) -> list[tuple[bytes, bytes]]:
    """The request's headers for its decompressed body."""
    kept = [(k, v) for k, v in headers if k.lower() not in (b"content-encoding",
                                                             b"content-length")]
    return [*kept, (b"content-length", str(len(body)).encode())]


def _has_body(headers: dict[str, str]) -> bool:
    return "transfer-encoding" in headers or \
        headers.get("content-length", "0").strip() not in ("", "0")


async def _read_body(receive: Any, timeout_s: float,
                     max_bytes: int) -> list[dict[str, Any]] | APIError | None:
    """The body's ``http.request`` messages, read within ``timeout_s``; stops once past
    ``max_bytes`` (Litestar answers 413 from what was read)."""
    deadline = time.monotonic() + timeout_s
    messages: list[dict[str, Any]] = []
    num_bytes = 0
    while True:
        try:
            message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0))
        except TimeoutError:
            return APIError(408, f"the request body did not arrive within {timeout_s:g} s "
                            "(--read-timeout)", code="request_timeout", headers=_CLOSE)
        if message["type"] == "http.disconnect":
            return None
        messages.append(message)
        num_bytes += len(message.get("body", b""))
        if not message.get("more_body", False) or num_bytes > max_bytes:
            return messages


def _replay(messages: list[dict[str, Any]], receive: Any) -> Any:
    async def replay() -> Any:
        return messages.pop(0) if messages else await receive()

    return replay


def require_local_token(connection: Any, _: Any) -> None:
    """Litestar guard for ``/admin/shutdown``: with API keys the key guard already ran; without
    them the caller must show the token from the state dir (``agentd stop`` does)."""
    server = connection.app.state.agentd
    if server.settings.api_keys:
        return
    given = connection.headers.get(TOKEN_HEADER, "").strip().encode()
    if not hmac.compare_digest(given, server.cli_token.encode()):
        raise APIError(401, "POST /admin/shutdown needs the daemon's local token (`agentd stop` "
                       f"sends it from {TOKEN_FILE} in the state dir) or an API key",
                       code="missing_token")
