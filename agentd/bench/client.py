"""Streaming OpenAI calls for the benchmark (chat completions, or with ``api`` the Responses or
Messages wire: ``agentd.bench.wires``), and what the server is (agentd or another one).

TTFT is the time from sending a request to the first chunk that carries content or a tool call
(the role chunk a server sends at once does not count). Output tokens and cached prompt tokens
come from the usage chunk (``stream_options.include_usage``); a server that sends no usage has
its output tokens counted as content chunks and its cached tokens left unknown (None).

Invariants: the client only reads the server, except for the pins it creates (and deletes);
every failure a user can fix (nothing listening, a missing key, an unknown model, an error
reply) is a ``BenchError`` whose message says what to do. For a server that rejects agentd's
request extensions (``ignore_eos``, ``cache_salt``) the first 400 turns ``ignore_eos`` off
for the rest of the run and the request is sent again.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from agentd.bench.wires import PATHS, Usage, build_body, read_event, tools_as_text
from agentd.bench.workload import Message, Namespace


class BenchError(Exception):
    """A benchmark failure the user can act on."""


@dataclass
class RequestResult:
    phase: str
    ttft_s: float | None  # None: the reply had no content or tool call
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int | None  # None: the server does not report it
    output_tokens: int
    start_s: float  # perf_counter at send, to order and window requests


@dataclass(frozen=True)
class ServerInfo:
    kind: str  # "agentd" or "openai"
    root_url: str
    model: str
    pid: int | None
    version: str | None
    max_model_len: int | None
    num_blocks_total: int | None
    block_size: int
    compute: dict[str, Any] | None = None  # agentd's ISA, dtype, weights and kernels


def split_url(url: str) -> tuple[str, str]:
    """(root URL, OpenAI base URL) from a URL given with or without ``/v1``."""
    url = url.rstrip("/")
    root = url[: -len("/v1")] if url.endswith("/v1") else url
    return root, root + "/v1"


def is_local(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    return host in ("localhost", "::1", "0.0.0.0") or host.startswith("127.")


class BenchClient:
    def __init__(self, url: str, api_key: str | None, timeout_s: float = 1800.0,
                 api: str = "chat", tools_in_system: bool = False) -> None:
        self.root_url, self.base_url = split_url(url)
        self.api = api  # the wire: chat, responses or messages (agentd.bench.wires)
        self.tools_in_system = tools_in_system  # tools sent as system text (wires.tools_as_text)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(timeout_s, connect=10.0)
        # Idle connections are dropped well before a server's own keep-alive timeout (5 s in
        # llama-server's HTTP library), so a request rarely goes out on one the server closed.
        limits = httpx.Limits(max_connections=512, keepalive_expiry=1.0)
        self._http = httpx.AsyncClient(headers=headers, timeout=timeout, trust_env=False,
                                       limits=limits)
        self.send_ignore_eos = True

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        try:
            return await self._http.request(method, url, **kwargs)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise BenchError(f"nothing answers at {self.root_url}; start a daemon with "
                             "`agentd start` or pass --url") from exc
        except httpx.TransportError as exc:
            raise BenchError(f"{method} {url} failed: {exc!r}") from exc

    async def get_json(self, path: str, root: bool = False) -> Any | None:
        """The JSON of a successful GET, or None when the reply is an error or not JSON."""
        base = self.root_url if root else self.base_url
        response = await self._request("GET", base + path)
        if response.status_code == 401:
            raise BenchError(f"{self.root_url} wants an API key; pass --api-key or set "
                             "AGENTD_API_KEY / OPENAI_API_KEY")
        if response.is_error:
            return None
        try:
            return response.json()
        except ValueError:
            return None

    async def detect(self, model: str | None, force_openai: bool) -> ServerInfo:
        """agentd when ``/health`` names a pid and version and ``/v1/stats`` answers."""
        models = await self.get_json("/models")
        if not models or not models.get("data"):
            raise BenchError(f"{self.base_url}/models lists no models; is {self.root_url} an "
                             "OpenAI-compatible server?")
        cards = {card["id"]: card for card in models["data"]}
        name = model or next(iter(cards))
        if model is not None and model not in cards:
            raise BenchError(f"the server serves {', '.join(cards)}, not {model}; pass one of "
                             "those to --model")
        health = None if force_openai else await self.get_json("/health", root=True)
        stats = await self.get_json("/stats") if isinstance(health, dict) else None
        agentd = (isinstance(health, dict) and "pid" in health and "version" in health
                  and isinstance(stats, dict))
        if not agentd:
            return ServerInfo("openai", self.root_url, name, None, None,
                              cards[name].get("max_model_len"), None, 16)
        return ServerInfo("agentd", self.root_url, name, health["pid"], health["version"],
                          stats.get("max_model_len") or cards[name].get("max_model_len"),
                          stats.get("num_blocks_total"), stats.get("block_size") or 16,
                          stats.get("compute"))

    async def stats(self) -> dict[str, Any] | None:
        return await self.get_json("/stats")

    async def create_pin(self, name: str, system: str,
                         tools: list[dict[str, Any]]) -> dict[str, Any] | str:
        """The pin's description, or why the server refused it."""
        body = {"name": name, "system": system, "tools": tools or None}
        response = await self._request("POST", self.base_url + "/pins", json=body)
        if response.status_code in (404, 405):
            return "this agentd has no /v1/pins endpoint"
        if response.is_error:
            return f"pinning failed: {error_message(response)}"
        return response.json()

    async def delete_pin(self, name: str) -> None:
        await self._request("DELETE", f"{self.base_url}/pins/{name}")

    async def chat(self, phase: str, model: str, messages: list[Message],
                   tools: list[dict[str, Any]], namespace: Namespace,
                   max_tokens: int) -> RequestResult:
        """One streamed request on the client's wire (a chat completion by default), greedy,
        measured."""
        if self.tools_in_system:
            messages, tools = tools_as_text(messages, tools), []
        body = build_body(self.api, model, messages, tools, max_tokens)
        if namespace.salt is not None:
            body["cache_salt"] = namespace.salt
        if self.send_ignore_eos:
            body["ignore_eos"] = True
        try:
            return await self._stream_once_more(phase, body)
        except _Rejected as exc:
            if not self.send_ignore_eos or "cache_salt" in body:
                raise BenchError(f"{phase} request failed: {exc}") from exc
            self.send_ignore_eos = False  # a strict server: retry with standard fields only
            del body["ignore_eos"]
            try:
                return await self._stream_once_more(phase, body)
            except _Rejected as again:
                raise BenchError(f"{phase} request failed: {again}") from again

    async def _stream_once_more(self, phase: str, body: dict[str, Any]) -> RequestResult:
        """``_stream``, sent again once when the server closed a kept-alive connection before
        answering (nothing was computed; the retry is measured from its own start)."""
        try:
            return await self._stream(phase, body)
        except _Unanswered:
            try:
                return await self._stream(phase, body)
            except _Unanswered as exc:
                raise BenchError(f"{phase} request failed: {exc.__cause__!r}") from exc

    async def _stream(self, phase: str, body: dict[str, Any]) -> RequestResult:
        start = time.perf_counter()
        answered = False
        ttft: float | None = None
        usage = Usage()
        num_chunks = 0
        try:
            async with self._http.stream("POST", self.base_url + PATHS[self.api],
                                         json=body) as reply:
                answered = True
                if reply.status_code == 400:
                    raise _Rejected(error_message(reply, await reply.aread()))
                if reply.is_error:
                    raise BenchError(f"{phase} request failed: "
                                     f"{error_message(reply, await reply.aread())}")
                async for line in reply.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    try:
                        content = read_event(self.api, json.loads(line[len("data: "):]), usage)
                    except ValueError as exc:
                        raise BenchError(f"{phase} request failed mid-stream: {exc}") from exc
                    if content:
                        num_chunks += 1
                        if ttft is None:
                            ttft = time.perf_counter() - start
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise BenchError(f"nothing answers at {self.root_url} any more") from exc
        except httpx.RemoteProtocolError as exc:
            if not answered:
                raise _Unanswered from exc
            raise BenchError(f"{phase} request failed: {exc!r}") from exc
        except httpx.TransportError as exc:
            raise BenchError(f"{phase} request failed: {exc!r}") from exc
        cached = usage.cached_tokens
        return RequestResult(phase=phase, ttft_s=ttft, e2e_s=time.perf_counter() - start,
                             prompt_tokens=usage.prompt_tokens,
                             cached_tokens=int(cached) if cached is not None else None,
                             output_tokens=usage.output_tokens if usage.output_tokens is not None
                             else num_chunks, start_s=start)


class _Rejected(Exception):
    """A 400 reply: maybe only our extensions, so the caller may retry without them."""


class _Unanswered(Exception):
    """The connection closed before any reply (a kept-alive connection the server dropped)."""


def error_message(response: httpx.Response, body: bytes | None = None) -> str:
    raw = body if body is not None else response.content
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}: {raw[:300].decode(errors='replace')}"
