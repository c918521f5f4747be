"""Every rejected request gets the OpenAI error envelope with the right status: 400 for what the
client must fix (never a silent ignore) — a prompt over the context included, with OpenAI's
``context_length_exceeded`` code —, 401 without the API key, 404 for an unknown model or route,
413 for a body over the limit."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from litestar.testing import TestClient

from agentd.server.app import ServerSettings, create_app

LOCAL = "http://127.0.0.1"  # a Host header the daemon answers to (testserver.local is not)

USER = [{"role": "user", "content": "hi"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


BAD_CHAT_BODIES = {
    "n > 1": ({"n": 2}, "n"),
    "logprobs": ({"logprobs": True}, "logprobs"),
    "top_logprobs": ({"top_logprobs": 3}, "top_logprobs"),
    "temperature too high": ({"temperature": 3.5}, "temperature"),
    "top_p zero": ({"top_p": 0}, "top_p"),
    "max_tokens zero": ({"max_tokens": 0}, "max_tokens"),
    "presence_penalty": ({"presence_penalty": 5}, "presence_penalty"),
    "frequency_penalty": ({"frequency_penalty": -5}, "frequency_penalty"),
    "too many stops": ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    "logit_bias": ({"logit_bias": {"1": 5}}, "logit_bias"),
    "json_schema response without schema": ({"response_format": {"type": "json_schema"}},
                                            "response_format.json_schema"),
    "no messages": ({"messages": []}, "messages"),
    "messages not a list": ({"messages": "hi"}, "messages"),
    "unknown role": ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    "image part": ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages[0].content[0]"),
    "tool without id": ({"messages": [{"role": "tool", "content": "x"}]},
                        "messages[0].tool_call_id"),
    "tool_choice without tools": ({"tool_choice": "required"}, "tool_choice"),
    "bad tool_choice": ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    "unknown named tool": ({"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice"),
}


@pytest.mark.parametrize("case", list(BAD_CHAT_BODIES))
def test_bad_chat_requests_are_400(client: TestClient, case: str) -> None:
    extra, param = BAD_CHAT_BODIES[case]
    body = {"model": "tiny-llama", "messages": USER, **extra}
    error = assert_openai_error(client.post("/v1/chat/completions", json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


@pytest.mark.parametrize("body", [{"prompt": []}, {"prompt": ""}, {"prompt": ["a", "b"]},
                                  {"prompt": "x", "logprobs": 2}, {"prompt": "x", "suffix": "y"},
                                  {"prompt": "x", "n": 3}])
def test_bad_completion_requests_are_400(client: TestClient, body: dict[str, Any]) -> None:
    assert_openai_error(client.post("/v1/completions", json=body), 400)


def test_malformed_json_is_400(client: TestClient) -> None:
    response = client.post("/v1/chat/completions", content=b'{"messages": [',
                           headers={"content-type": "application/json"})
    error = assert_openai_error(response, 400)
    assert "not valid JSON" in error["message"]


def test_another_models_name_is_served_and_an_unknown_route_is_404(client: TestClient) -> None:
    """One model is served here, whatever a request calls it (harnesses name their vendors'
    models by default, as llama-server allows); the reply says the name was ignored."""
    for path, body in (("/v1/chat/completions", {"messages": USER}),
                       ("/v1/completions", {"prompt": "x"})):
        response = client.post(path, json={"model": "gpt-17", "max_tokens": 1, **body})
        assert response.status_code == 200, response.text
        assert response.headers["x-agentd-ignored"] == "model"
        assert response.json()["model"] != "gpt-17"  # the served model's own name
    assert_openai_error(client.get("/v1/nothing-here"), 404)


def test_prompt_over_the_context_is_400_context_length_exceeded(client: TestClient) -> None:
    long_text = "cache " * 5000  # > 4096 tokens
    error = assert_openai_error(client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": long_text}]}), 400)
    assert "maximum context length is 4096 tokens" in error["message"]
    assert error["code"] == "context_length_exceeded"
    error = assert_openai_error(client.post("/v1/completions", json={"prompt": long_text}), 400)
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"


@pytest.fixture
def small_body_client(tiny) -> Iterator[TestClient]:
    config, engine = tiny
    settings = ServerSettings(max_request_body_bytes=4096)
    with TestClient(create_app(config, engine=engine, settings=settings),
                    base_url=LOCAL) as test_client:
        yield test_client


def test_body_over_the_limit_is_413(small_body_client: TestClient) -> None:
    body = {"messages": [{"role": "user", "content": "x" * 5000}]}
    error = assert_openai_error(small_body_client.post("/v1/chat/completions", json=body), 413)
    assert "too large" in error["message"]


@pytest.fixture
def keyed_client(tiny) -> Iterator[TestClient]:
    config, engine = tiny
    settings = ServerSettings(api_keys=("sk-test",))
    with TestClient(create_app(config, engine=engine, settings=settings),
                    base_url=LOCAL) as test_client:
        yield test_client


def test_api_key_guards_v1_admin_and_metrics_but_not_health(keyed_client: TestClient) -> None:
    for method, path in (("GET", "/v1/models"), ("GET", "/v1/stats"),
                         ("POST", "/admin/shutdown"), ("POST", "/v1/chat/completions")):
        error = assert_openai_error(keyed_client.request(method, path), 401)
        assert error["code"] == "invalid_api_key"
    wrong = keyed_client.get("/v1/models", headers={"Authorization": "Bearer sk-wrong"})
    assert_openai_error(wrong, 401)
    ok = keyed_client.get("/v1/models", headers={"Authorization": "Bearer sk-test"})
    assert ok.status_code == 200
    assert keyed_client.get("/health").status_code == 200
    assert_openai_error(keyed_client.get("/metrics"), 401)  # it names the pins
    assert keyed_client.get("/metrics", headers={"Authorization": "Bearer sk-test"}
                            ).status_code == 200
