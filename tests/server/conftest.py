"""Server test fixtures: one tiny random-model engine per module, and app clients over it that
check, when their test ends, that no request still holds a KV block."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

LOCAL = "http://127.0.0.1"  # a Host header the daemon answers to (testserver.local is not)

IdleWaiter = Callable[[Callable[[], dict[str, Any]]], dict[str, Any]]


def _wait_idle(get_stats: Callable[[], dict[str, Any]], timeout_s: float = 20.0) -> dict[str, Any]:
    """Poll ``/v1/stats`` until nothing runs, waits or holds a block (but for retained prefixes,
    which hold theirs until they expire); return those stats."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = get_stats()
        busy = stats["num_blocks_used"] - stats["num_blocks_retained"] or \
            stats["num_requests_running"] or stats["num_requests_waiting"]
        if not busy:
            return stats
        assert time.monotonic() < deadline, f"the pool never went idle: {stats}"
        time.sleep(0.05)


@pytest.fixture
def wait_idle() -> IdleWaiter:
    return _wait_idle


@pytest.fixture(scope="module")
def tiny(tiny_model_factory) -> Iterator[Any]:
    """(config, started AsyncEngine) for a tiny random Llama with the SmolLM2 tokenizer."""
    from agentd.config import EngineConfig
    from agentd.engine.async_engine import AsyncEngine

    path = tiny_model_factory("llama")
    config = EngineConfig(model=str(path), kv_cache_memory_bytes=8 * 2**20)
    engine = AsyncEngine.from_config(config)
    engine.start()
    yield config, engine
    engine.shutdown()


@pytest.fixture
def client(tiny) -> Iterator[Any]:
    """A Litestar TestClient over the tiny engine; the pool must be idle after the test."""
    from litestar.testing import TestClient

    from agentd.server.app import create_app

    config, engine = tiny
    with TestClient(create_app(config, engine=engine), base_url=LOCAL) as test_client:
        yield test_client
        _wait_idle(lambda: test_client.get("/v1/stats").json())


@dataclass
class WeatherTool:
    """An openai-agents function tool, ``get_weather(city)``, that records each city it ran for."""
    tool: Any
    cities: list[str] = field(default_factory=list)


@pytest.fixture
def agents_weather_tool() -> WeatherTool:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    ran = WeatherTool(tool=None)

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        ran.cities.append(city)
        return f"It is 18 C and sunny in {city}."

    ran.tool = get_weather
    return ran
