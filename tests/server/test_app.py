"""The Litestar app against a tiny random model: reply shapes, SSE framing, completions, stats,
metrics and the OpenAPI schema. Every test leaves the pool idle (checked by the fixture)."""

from __future__ import annotations

import json
from typing import Any

import httpx
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

USER = [{"role": "user", "content": "Say something about caches."}]


def chat(client: TestClient, **body: Any) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"model": "tiny-llama", "messages": USER,
                                                      "max_tokens": 6, **body})


def sse_data(response: httpx.Response) -> list[str]:
    assert response.headers["content-type"].startswith("text/event-stream")
    events = response.text.split("\n\n")
    assert events[-1] == ""
    assert all(e.startswith("data: ") for e in events[:-1])
    return [e[len("data: "):] for e in events[:-1]]


# --- shapes ----------------------------------------------------------------------------------
def test_models_lists_the_served_model(client: TestClient) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["tiny-llama"]
    assert body["data"][0]["max_model_len"] == 4096


def test_chat_completion_shape(client: TestClient) -> None:
    body = chat(client, temperature=0).json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == "tiny-llama"
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["logprobs"] is None
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert "tool_calls" not in choice["message"]
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["completion_tokens"] <= 6
    assert isinstance(usage["prompt_tokens_details"]["cached_tokens"], int)


def test_every_role_and_text_parts_render(client: TestClient) -> None:
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'},
    ]
    response = chat(client, messages=messages, temperature=0)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["role"] == "assistant"


def test_greedy_is_deterministic_and_max_completion_tokens_wins(client: TestClient) -> None:
    first = chat(client, temperature=0, max_tokens=50, max_completion_tokens=5).json()
    second = chat(client, temperature=0, max_tokens=50, max_completion_tokens=5).json()
    assert first["choices"][0]["message"] == second["choices"][0]["message"]
    assert first["usage"]["completion_tokens"] == 5
    assert first["choices"][0]["finish_reason"] == "length"
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_stop_string_ends_the_reply(client: TestClient) -> None:
    text = chat(client, temperature=0, max_tokens=12).json()["choices"][0]["message"]["content"]
    stop = text.strip()[2:5]
    assert stop.strip(), f"need visible text to stop on, got {text!r}"
    body = chat(client, temperature=0, max_tokens=12, stop=[stop]).json()
    assert body["choices"][0]["message"]["content"] == text[: text.index(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"


def test_sse_chunk_sequence(client: TestClient) -> None:
    whole = chat(client, temperature=0).json()["choices"][0]
    data = sse_data(chat(client, temperature=0, stream=True))
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" and len(c["choices"]) == 1 for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    middle = [c["choices"][0] for c in chunks[1:-1]]
    assert all(set(m["delta"]) == {"content"} and m["finish_reason"] is None for m in middle)
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]
    assert "".join(m["delta"]["content"] for m in middle) == whole["message"]["content"]


def test_stream_include_usage_adds_a_last_usage_chunk(client: TestClient) -> None:
    data = sse_data(chat(client, stream=True, stream_options={"include_usage": True}))
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 6
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0


def test_completions_text_token_ids_echo_and_stream(client: TestClient) -> None:
    body = client.post("/v1/completions", json={"prompt": "The cache", "max_tokens": 4,
                                                "echo": True, "temperature": 0}).json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"].startswith("The cache")
    assert body["usage"]["completion_tokens"] == 4
    ids = client.post("/v1/completions", json={"prompt": [504, 2389], "max_tokens": 3}).json()
    assert ids["usage"]["prompt_tokens"] == 2
    data = sse_data(client.post("/v1/completions", json={"prompt": [[504, 2389]], "stream": True,
                                                         "max_tokens": 3, "temperature": 0}))
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_stats_report_engine_and_pool(client: TestClient) -> None:
    stats = client.get("/v1/stats").json()
    for key in ("num_requests_running", "num_requests_waiting", "prefix_cache_queries",
                "prefix_cache_hits", "num_blocks_free", "num_blocks_cached", "num_blocks_used",
                "num_blocks_total", "model", "uptime_s", "max_model_len"):
        assert key in stats
    assert stats["num_blocks_free"] + stats["num_blocks_cached"] + stats["num_blocks_used"] == \
        stats["num_blocks_total"]


def _scrape(client: TestClient) -> dict[str, float]:
    response = client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def test_metrics_parse_and_counters_move(client: TestClient) -> None:
    before = _scrape(client)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:num_preemptions_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total"):
        assert name in before
    chat(client, temperature=0)
    chat(client, temperature=0, stream=True)
    after = _scrape(client)
    for name in ("vllm:prefix_cache_queries_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_success_total"):
        assert after[name] > before.get(name, 0.0), name
    assert after["vllm:time_to_first_token_seconds_count"] - \
        before.get("vllm:time_to_first_token_seconds_count", 0.0) == 2
    assert after["vllm:prefix_cache_hits_total"] > before["vllm:prefix_cache_hits_total"]


def test_openapi_schema_is_served(client: TestClient) -> None:
    schema = client.get("/docs/openapi.json").json()
    assert "/v1/chat/completions" in schema["paths"]
    assert "ChatCompletionRequest" in json.dumps(schema["components"])


def test_arrivals_are_counted_until_submission_and_always_released(client: TestClient) -> None:
    """The middleware behind request coalescing: every completion request counts as arriving
    until its handler submits it, and the count returns to 0 after successes, streams and
    errors alike."""
    engine = client.app.state.agentd.engine
    assert engine.arriving == 0
    seen: list[int] = []
    real_add = engine.add_request

    def add_request(*args: Any, **kwargs: Any) -> Any:
        seen.append(engine.arriving)  # the request being submitted still counts here
        return real_add(*args, **kwargs)

    engine.add_request = add_request
    try:
        _arrivals_round_trip(client)
    finally:
        del engine.add_request
    assert seen == [1, 1, 1]
    assert engine.arriving == 0


def _arrivals_round_trip(client: TestClient) -> None:
    assert chat(client, max_tokens=2).status_code == 200
    assert chat(client, max_tokens=2, stream=True).status_code == 200
    assert chat(client, max_tokens=2, n=3).status_code == 400  # refused before submission
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code \
        == 200
    assert client.post("/v1/completions", json={"prompt": ""}).status_code == 400
