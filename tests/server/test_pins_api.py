"""Pins over HTTP against tiny random models: shapes and errors of /v1/pins, hits for any user
message under three template styles (ChatML without tools support, Qwen-style and Llama-3-style
tools templates), reordered tool keys, a timestamp near miss in /v1/stats, TTL decay, the pin
budget, persistence in the state dir, and the agentd: series in /metrics."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import pytest
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from agentd.config import EngineConfig
from agentd.engine.async_engine import AsyncEngine
from agentd.server.app import create_app
from agentd.server.settings import ServerSettings

LOCAL = "http://127.0.0.1"  # a Host header the daemon answers to (testserver.local is not)

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # tiny llama: layers * K/V * block * kv heads * dim * fp32
NUM_BLOCKS = 320  # budget (0.5) = 160 blocks: the research pin (143 blocks) fits, little more
USER_MESSAGES = ("Find recent work on solid-state batteries.", "What is 17% of 2,340?",
                 "Summarize https://example.com/report in two sentences.")


@pytest.fixture(scope="module")
def research() -> dict[str, Any]:
    return json.loads(resources.files("agentd.workloads").joinpath("research_agent.json")
                      .read_text())


@pytest.fixture(scope="module")
def engines(tiny_model_factory) -> Iterator[dict[str, AsyncEngine]]:
    """Started engines, one per template style, built on first use."""
    built: dict[str, AsyncEngine] = {}

    class Lazy(dict):
        def __missing__(self, template: str) -> AsyncEngine:
            path = tiny_model_factory("llama", None if template == "chatml" else template)
            num_blocks = NUM_BLOCKS if template == "chatml" else 1024  # llama3's tools: 2.6K
            engine = AsyncEngine.from_config(EngineConfig(
                model=str(path), kv_cache_memory_bytes=num_blocks * BLOCK_BYTES))
            engine.start()
            self[template] = built[template] = engine
            return engine

    yield Lazy()
    for engine in built.values():
        engine.shutdown()


def _unpin_all(engine: AsyncEngine) -> None:
    async def run() -> None:
        await engine.call(lambda e: [e.unpin(p.name) for p in e.pins.registry])
        await engine.call(lambda e: e.expired_pins.clear())

    asyncio.run(run())


@pytest.fixture
def make_client(engines, wait_idle) -> Iterator[Any]:
    """``make_client(template="chatml", state_dir=None)`` → a TestClient; pins are dropped and
    the pool must be idle when the test ends."""
    opened: list[tuple[TestClient, AsyncEngine]] = []

    def make(template: str = "chatml", state_dir: Path | None = None) -> TestClient:
        engine = engines[template]
        app = create_app(EngineConfig(), engine=engine,
                         settings=ServerSettings(state_dir=state_dir))
        client = TestClient(app, base_url=LOCAL)
        client.__enter__()
        opened.append((client, engine))
        return client

    yield make
    for client, engine in opened:
        _unpin_all(engine)
        wait_idle(lambda c=client: c.get("/v1/stats").json())
        client.__exit__(None, None, None)


@pytest.fixture
def client(make_client) -> TestClient:
    return make_client()


def pin(client: TestClient, system: str, name: str = "research", **body: Any) -> httpx.Response:
    return client.post("/v1/pins", json={"name": name, "system": system, **body})


def chat(client: TestClient, system: str, text: str, tools: Any = None) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "system", "content": system},
                                         {"role": "user", "content": text}],
                            "max_tokens": 2, "temperature": 0}
    if tools:
        body["tools"] = tools
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def cached(reply: dict[str, Any]) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return body


def reversed_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: reversed_keys(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [reversed_keys(v) for v in value]
    return value


# --- shapes and errors -------------------------------------------------------------------------
def test_create_list_get_delete(client: TestClient, research: dict) -> None:
    created = pin(client, research["system"], tools=research["tools"], ttl="1h")
    assert created.status_code == 201, created.text
    info = created.json()
    assert info["object"] == "pin" and info["name"] == "research"
    assert info["num_tokens"] == 16 * info["num_blocks"] and info["num_tokens"] > 1500
    assert info["ttl"] == 3600 and info["hits"] == 0 and info["num_tools"] == 6
    assert info["prefill_s"] > 0 and info["restored"] is False
    listed = client.get("/v1/pins").json()
    assert listed["object"] == "list"
    assert [p["name"] for p in listed["data"]] == ["research"]
    assert {"name", "num_tokens", "num_blocks", "created", "ttl", "hits"} <= set(listed["data"][0])
    one = client.get("/v1/pins/research").json()
    assert one["num_blocks"] == info["num_blocks"] and one["created"] == info["created"]
    stats = client.get("/v1/stats").json()
    assert stats["num_pins"] == 1 and stats["num_blocks_pinned"] == info["num_blocks"]
    assert client.delete("/v1/pins/research").json() == {
        "name": "research", "deleted": True, "object": "pin.deleted"}
    assert client.get("/v1/pins").json()["data"] == []
    assert error(client.get("/v1/pins/research"), 404)["code"] == "pin_not_found"
    assert error(client.delete("/v1/pins/research"), 404)["code"] == "pin_not_found"
    stats = client.get("/v1/stats").json()
    assert stats["num_blocks_pinned"] == 0 and stats["num_blocks_cached"] >= info["num_blocks"]


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"name": "x"}, ..., "system"),
    ({"name": "x", "system": "   "}, "system", "non-empty"),
    ({"name": "a b", "system": "hi"}, "name", "name must be"),
    ({"name": "x", "system": "hi", "ttl": "soon"}, "ttl", "cannot parse duration"),
    ({"name": "x", "system": "hi", "ttl": 0}, "ttl", "ttl must be positive"),
    ({"name": "x", "system": "hi", "tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name", "function.name"),
    ({"name": "x", "system": "hi"}, None, "shorter than one block"),
])
def test_bad_bodies_are_400(client: TestClient, body: dict, param: Any, needle: str) -> None:
    err = error(client.post("/v1/pins", json=body), 400)
    assert needle in err["message"]
    assert param is ... or err["param"] == param
    assert client.get("/v1/pins").json()["data"] == []


def test_duplicate_is_409(client: TestClient, research: dict) -> None:
    assert pin(client, research["system"]).status_code == 201
    err = error(pin(client, research["system"] + " Other."), 409)
    assert err["code"] == "pin_exists" and "already exists" in err["message"]
    assert len(client.get("/v1/pins").json()["data"]) == 1


def test_longer_than_the_context_is_400(client: TestClient) -> None:
    support = json.loads(resources.files("agentd.workloads").joinpath("support_agent.json")
                         .read_text())  # ~4.5K tokens; the tiny model's context is 4,096
    err = error(pin(client, support["system"], tools=support["tools"]), 400)
    assert err["code"] == "context_length_exceeded" and "max_model_len" in err["message"]
    assert client.get("/v1/pins").json()["data"] == []


def test_over_budget_is_409_and_changes_nothing(client: TestClient, research: dict) -> None:
    first = pin(client, research["system"], tools=research["tools"]).json()
    before = client.get("/v1/stats").json()
    budget = NUM_BLOCKS // 2
    other = " ".join(f"Rule {i}: cite every source you use." for i in range(60))
    err = error(pin(client, other, name="other"), 409)
    assert err["code"] == "pin_budget_exceeded"
    left = budget - first["num_blocks"]
    assert f"only {left} of the {budget}-block pin budget are left" in err["message"]
    assert "needs " in err["message"]
    after = client.get("/v1/stats").json()
    assert [p["name"] for p in client.get("/v1/pins").json()["data"]] == ["research"]
    for key in ("num_blocks_pinned", "num_blocks_free", "num_blocks_cached", "num_pins",
                "num_requests_finished"):
        assert after[key] == before[key], key


# --- hits --------------------------------------------------------------------------------------
@pytest.mark.parametrize("template", ["chatml", "qwen", "llama3"])
def test_any_user_message_hits_the_pin(make_client, research: dict, template: str) -> None:
    client = make_client(template)
    created = pin(client, research["system"], tools=research["tools"])
    assert created.status_code == 201, created.text
    info = created.json()
    assert info["num_tokens"] > 1500, info
    for text in USER_MESSAGES:
        reply = chat(client, research["system"], text, research["tools"])
        assert cached(reply) >= info["num_tokens"], (template, text)
    listed = client.get("/v1/pins/research").json()
    assert listed["hits"] == len(USER_MESSAGES)
    assert listed["tokens_served"] == len(USER_MESSAGES) * info["num_tokens"]


def test_reordered_tool_keys_still_hit(client: TestClient, research: dict) -> None:
    info = pin(client, research["system"], tools=research["tools"]).json()
    shuffled = reversed_keys(research["tools"])
    assert json.dumps(shuffled) != json.dumps(research["tools"])
    assert cached(chat(client, research["system"], "Hello", shuffled)) >= info["num_tokens"]


def test_timestamp_near_miss_in_stats(client: TestClient, research: dict) -> None:
    lines = research["system"].split("\n")
    middle = len(lines) // 2

    def with_time(stamp: str) -> str:
        return "\n".join([*lines[:middle], f"Current time: {stamp}", *lines[middle:]])

    info = pin(client, with_time("2025-06-01 09:30 UTC"), tools=research["tools"]).json()
    reply = chat(client, with_time("2025-06-02 14:05 UTC"), "What day is it?", research["tools"])
    assert cached(reply) < info["num_tokens"]
    near = client.get("/v1/stats").json()["near_misses"]
    assert near["total"] == 1
    (top,) = near["top"]
    assert top["pin"] == "research" and "date or time" in top["cause"] and top["count"] == 1
    (latest,) = near["recent"]
    assert 0 < latest["divergence_token"] < info["num_tokens"]
    assert latest["pin_num_tokens"] == info["num_tokens"]
    assert cached(reply) <= latest["divergence_token"]
    assert "Current time: 2025-06-0⟦1 09:30" in latest["pin_text"]
    assert "Current time: 2025-06-0⟦2 14:05" in latest["request_text"]
    assert client.get("/v1/stats").json()["pins"][0]["near_misses"] == 1


def test_reordered_tools_are_a_near_miss(make_client, research: dict) -> None:
    """The Qwen-style template renders the system text first, so tools in another order share
    a long prefix with the pin and diverge inside the tools."""
    client = make_client("qwen")
    info = pin(client, research["system"], tools=research["tools"]).json()
    swapped = [research["tools"][1], research["tools"][0], *research["tools"][2:]]
    assert cached(chat(client, research["system"], "Hi", swapped)) < info["num_tokens"]
    (latest,) = client.get("/v1/stats").json()["near_misses"]["recent"]
    assert latest["cause"] == "the tools differ (another order, or changed schemas)"
    assert info["num_tokens"] // 4 < latest["divergence_token"] < info["num_tokens"]


# --- TTL and persistence -----------------------------------------------------------------------
def test_ttl_decays_to_ordinary_lru(client: TestClient, research: dict) -> None:
    info = pin(client, research["system"], ttl=0.5).json()
    assert info["ttl"] == 0.5
    assert [p["name"] for p in client.get("/v1/pins").json()["data"]] == ["research"]
    deadline = time.monotonic() + 10
    while client.get("/v1/pins").json()["data"]:
        assert time.monotonic() < deadline, "the pin never decayed"
        time.sleep(0.1)
    stats = client.get("/v1/stats").json()
    assert stats["num_pins"] == 0 and stats["num_blocks_pinned"] == 0
    # decayed, not dropped: its full blocks stay cached (a partial tail block is never
    # cached; it is freed)
    assert stats["num_blocks_cached"] >= info["num_blocks"] - (info["tail_tokens"] > 0)
    # ... and serve as an ordinary cached prefix (whole blocks: the tail went with the pin)
    assert cached(chat(client, research["system"], "Hi")) >= info["num_tokens"] - info[
        "tail_tokens"]


def test_registry_and_stored_kv_in_the_state_dir(make_client, research: dict,
                                                 tmp_path: Path) -> None:
    client = make_client(state_dir=tmp_path)
    info = pin(client, research["system"], tools=research["tools"], ttl="2h").json()
    doc = json.loads((tmp_path / "pins.json").read_text())
    (entry,) = doc["pins"]
    assert entry["name"] == "research" and entry["ttl_s"] == 7200
    assert entry["tools"][0]["function"]["name"] == research["tools"][0]["function"]["name"]
    (segment,) = (tmp_path / "kv-store").glob("*/*.pin.seg")  # the pin's blocks, pinned
    assert segment.stat().st_size > 0
    assert client.get("/v1/stats").json()["pin_persist_error"] is None
    assert client.delete("/v1/pins/research").status_code == 200
    assert json.loads((tmp_path / "pins.json").read_text())["pins"] == []
    assert not segment.exists()  # pinned no more (no disk tier here: deleted)
    assert info["num_blocks"] > 0


def test_restore_on_start_from_the_state_dir(engines, research: dict, tmp_path: Path,
                                             wait_idle) -> None:
    """A second app over the same state dir restores the pin (the engine is shared here, so
    the first app's pin is dropped first, as a restart would)."""
    engine = engines["chatml"]
    settings = ServerSettings(state_dir=tmp_path)
    with TestClient(create_app(EngineConfig(), engine=engine, settings=settings),
                    base_url=LOCAL) as first:
        info = pin(first, research["system"], tools=research["tools"]).json()
    _unpin_all(engine)
    with TestClient(create_app(EngineConfig(), engine=engine, settings=settings),
                    base_url=LOCAL) as second:
        assert [p["name"] for p in second.get("/v1/pins").json()["data"]] == ["research"]
        (report,) = second.get("/v1/stats").json()["pin_restore"]
        assert report["source"] == "store" and report["num_tokens"] == info["num_tokens"]
        assert report["prefill_s"] == pytest.approx(info["prefill_s"])
        assert cached(chat(second, research["system"], "Hi", research["tools"])) >= \
            info["num_tokens"]
        _unpin_all(engine)
        wait_idle(lambda: second.get("/v1/stats").json())


# --- stats and metrics -------------------------------------------------------------------------
def samples(client: TestClient) -> dict[tuple[str, tuple], float]:
    text = client.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(found: dict, name: str, **labels: str) -> float:
    matches = [v for (n, ls), v in found.items()
               if n == name and labels.items() <= dict(ls).items()]
    return sum(matches)


def test_metrics_and_stats_move(client: TestClient, research: dict) -> None:
    info = pin(client, research["system"], tools=research["tools"]).json()
    before = samples(client)
    chat(client, "A prompt no cache has seen: " + "x" * 50, "Hi")  # a miss
    chat(client, research["system"], "Hi", research["tools"])  # a hit
    deadline = time.monotonic() + 5
    while value(samples(client), "agentd:pin_hits_total", pin="research") < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    after = samples(client)
    assert value(after, "agentd:pin_hits_total", pin="research") == 1
    assert value(after, "agentd:pin_tokens_served_total", pin="research") == info["num_tokens"]
    assert value(after, "agentd:pin_blocks", pin="research") == info["num_blocks"]
    assert value(after, "agentd:kv_cache_blocks", state="pinned") == info["num_blocks"]
    for outcome in ("hit", "miss"):
        name = "agentd:time_to_first_token_seconds_count"
        assert value(after, name, cache=outcome) == value(before, name, cache=outcome) + 1
    stats = client.get("/v1/stats").json()
    assert 0 < stats["prefix_cache_hit_rate"] <= 1
    assert stats["ttft"]["hit"]["count"] >= 1 and stats["ttft"]["miss"]["count"] >= 1
    assert stats["ttft"]["hit"]["p50"] <= stats["ttft"]["hit"]["p99"]
    assert stats["tokens_per_s"] > 0
    (row,) = stats["pins"]
    assert row["name"] == "research" and row["hits"] == 1
    assert row["tokens_served"] == info["num_tokens"] and row["num_blocks"] == info["num_blocks"]


def test_near_miss_metric(client: TestClient, research: dict) -> None:
    head, tail = research["system"][:2000], research["system"][2000:]
    pin(client, f"{head}\nToday is Monday, 2025-06-02.\n{tail}", tools=research["tools"])
    chat(client, f"{head}\nToday is Tuesday, 2025-06-03.\n{tail}", "Hi", research["tools"])
    deadline = time.monotonic() + 5
    while not value(samples(client), "agentd:near_misses_total", pin="research"):
        assert time.monotonic() < deadline, "no near miss was recorded"
        time.sleep(0.05)


def test_pins_need_the_api_key(engines) -> None:
    app = create_app(EngineConfig(), engine=engines["chatml"],
                     settings=ServerSettings(api_keys=("k1",)))
    with TestClient(app, base_url=LOCAL) as client:
        assert error(client.get("/v1/pins"), 401)["type"] == "authentication_error"
        assert client.get("/v1/pins", headers={"Authorization": "Bearer k1"}).status_code == 200

