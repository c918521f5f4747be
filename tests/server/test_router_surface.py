"""What a router reads from a replica (SMG, llm-d): ``/version``, ``/v1/models`` with ``owned_by``
and ``max_model_len``, and vLLM's gauges in ``/metrics`` computed from the engine's real state;
with keys set, ``/version`` stays open and the rest wants the operator's key as before."""

from __future__ import annotations

from typing import Any

import httpx
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from agentd import __version__

LOCAL = "http://127.0.0.1:8000"
PROMPT = [{"role": "system", "content": "You route agents. " * 20},
          {"role": "user", "content": "Where does this land?"}]


def _series(text: str) -> dict[str, list[Any]]:
    series: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, []).append(sample)
    return series


def _value(series: dict[str, list[Any]], name: str) -> float:
    (sample,) = series[name]
    return sample.value


def test_version_and_models_answer_as_vllm_routers_expect(client: TestClient) -> None:
    assert client.get("/version").json() == {"version": __version__, "server": "agentd"}
    (card,) = client.get("/v1/models").json()["data"]
    assert card["owned_by"] == "agentd" and card["max_model_len"] == 4096


def test_gauges_follow_the_engine(client: TestClient) -> None:
    for _ in range(2):  # the second one hits the first one's blocks
        reply = client.post("/v1/chat/completions", json={"messages": PROMPT, "max_tokens": 2})
        assert reply.status_code == 200
    stats = client.get("/v1/stats").json()
    series = _series(client.get("/metrics").text)
    assert stats["prefix_cache_hits"] > 0
    assert _value(series, "vllm:gpu_prefix_cache_hit_rate") == \
        stats["prefix_cache_hits"] / stats["prefix_cache_queries"]
    usage = _value(series, "vllm:kv_cache_usage_perc")
    assert 0.0 <= usage <= 1.0
    assert usage == stats["num_blocks_used"] / stats["num_blocks_total"]
    assert _value(series, "vllm:num_requests_running") == 0.0
    assert _value(series, "vllm:num_requests_waiting") == 0.0
    (info,) = series["vllm:cache_config_info"]
    assert info.value == 1.0 and info.labels["block_size"] == str(stats["block_size"])
    assert info.labels["num_gpu_blocks"] == str(stats["num_blocks_total"])


def test_behind_a_key_version_is_open_and_the_rest_wants_it(tiny) -> None:
    from agentd.server.app import create_app
    from agentd.server.settings import ServerSettings

    config, engine = tiny
    app = create_app(config, engine=engine, settings=ServerSettings(api_keys=("k-router",)))
    with TestClient(app, base_url=LOCAL) as client:
        assert client.get("/version").status_code == 200
        for path in ("/v1/models", "/metrics", "/v1/stats"):
            refused = client.get(path)
            assert refused.status_code == 401, path
            assert refused.json()["error"]["message"].startswith("missing or incorrect API key")
            bearer = httpx.Headers({"Authorization": "Bearer k-router"})
            assert client.get(path, headers=bearer).status_code == 200, path
