"""Hardening fixtures: a tiny random-model engine per module, app clients over it, a loopback
uvicorn server in a thread, and the idle check every hardening test ends with — ``/health`` 200,
``/admin/integrity`` ok, no request or stream left, no block held but pinned ones.

The helpers are handed to tests as fixtures (``openai_error``, ``idle``; ``serve`` and ``poll``
come from the root conftest):
test modules here are not a package, so they cannot import from this file.

Torch runs single-threaded here: tiny models gain nothing from threads, and on a busy 2-core
machine OpenMP's spin-waiting makes them up to 100x slower.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest
import torch

from agentd.config import EngineConfig
from agentd.engine.async_engine import AsyncEngine
from agentd.server.app import ServerSettings, create_app

TINY_KV_BYTES = 8 * 2**20  # 1,024 blocks of 16 tokens for the tiny llama
IDLE_TIMEOUT_S = 30.0


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def start_engine(path: Any, **config_kwargs: Any) -> tuple[EngineConfig, AsyncEngine]:
    config = EngineConfig(model=str(path), kv_cache_memory_bytes=TINY_KV_BYTES, **config_kwargs)
    engine = AsyncEngine.from_config(config)
    engine.start()
    return config, engine


@pytest.fixture(scope="module")
def tiny(tiny_model_factory) -> Iterator[tuple[EngineConfig, AsyncEngine]]:
    """(config, started AsyncEngine) for a tiny random Llama with the SmolLM2 tokenizer."""
    config, engine = start_engine(tiny_model_factory("llama"))
    yield config, engine
    engine.shutdown()


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    """The reply is ``status`` with exactly OpenAI's error envelope; returns the error."""
    assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert error["type"] in ("invalid_request_error", "authentication_error", "server_error")
    return error


def wait_idle(get: Callable[[str], httpx.Response], num_pinned_ok: bool = True,
              timeout_s: float = IDLE_TIMEOUT_S) -> dict[str, Any]:
    """Poll until the daemon is healthy and idle; return its integrity report.

    Idle: ``/health`` 200, ``/admin/integrity`` ok, no request in the scheduler, no stream open,
    and no block held except by pins. Aborts land on the engine thread a step later, so this
    polls instead of asserting at once.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        assert get("/health").status_code == 200
        report = get("/admin/integrity").json()
        assert report["ok"], report["error"]
        busy = report["num_requests"] or report["num_streams"] or \
            report["num_blocks_used"] != (report["num_blocks_pinned"] if num_pinned_ok else 0)
        if not busy:
            return report
        assert time.monotonic() < deadline, f"the daemon never went idle: {report}"
        time.sleep(0.05)


@contextmanager
def clients_over(tiny: tuple[EngineConfig, AsyncEngine],
                 settings: dict[str, ServerSettings]) -> Iterator[dict[str, Any]]:
    """One Litestar test client per named ``ServerSettings``, all over the one engine."""
    from litestar.testing import TestClient

    config, engine = tiny
    with ExitStack() as stack:
        yield {name: stack.enter_context(TestClient(
            create_app(config, engine=engine, settings=one), base_url="http://127.0.0.1"))
               for name, one in settings.items()}


@pytest.fixture(scope="session")
def app_clients() -> Callable[..., Any]:
    return clients_over


@pytest.fixture(scope="session")
def openai_error() -> Callable[..., dict[str, Any]]:
    return assert_openai_error


@pytest.fixture(scope="session")
def idle() -> Callable[..., dict[str, Any]]:
    return wait_idle
