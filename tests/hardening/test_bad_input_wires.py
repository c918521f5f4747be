"""The bad-input matrices of the Responses API (``/v1/responses``: OpenAI's error envelope,
naming the field) and of the Messages API (``/v1/messages``: Anthropic's
``{"type": "error", "error": {"type", "message"}}``): wrong block and item types, tool results
without their call, missing fields, wrong roles, bad cache TTLs, unsupported tools and fields.
Each is answered with the right status in its route's own shape and changes nothing: no prompt
token reaches the engine, no response is stored, the pool is idle and sound afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from litestar.testing import TestClient

from agentd.server.app import create_app

LOCAL = "http://127.0.0.1"
MODEL = "tiny-llama"
LONG_TEXT = "cache " * 5000  # > 4096 tokens, the tiny llama's context here
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"


@dataclass(frozen=True)
class Case:
    body: Any
    status: int = 400
    param: str | None = None  # OpenAI's param (Responses); Anthropic names it in the message
    says: tuple[str, ...] = ()
    path: str = ""
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)


def resp(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": "hi", "max_output_tokens": 2, **fields}


def item(text: str = "hi", role: str = "user", **fields: Any) -> dict[str, Any]:
    return {"type": "message", "role": role,
            "content": [{"type": "input_text", "text": text, **fields}]}


CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
        "arguments": '{"city": "Oslo"}'}
FUNCTION = {"type": "function", "name": "get_weather", "parameters": CITY}

RESPONSES_CASES: dict[str, Case] = {
    "no input": Case({"model": MODEL}, param="input"),
    "empty input": Case(resp(input=[]), param="input"),
    "input of a wrong type": Case(resp(input=5), param="input"),
    "unknown item type": Case(resp(input=[{"type": "hologram", "summary": []}]),
                              param="input[0].type", says=("hologram",)),
    "wrong role": Case(resp(input=[{"role": "robot", "content": "x"}]), param="input[0].role",
                       says=("robot",)),
    "message without content": Case(resp(input=[{"type": "message", "role": "user"}]),
                                     param="input[0]", says=("content",)),
    "image part": Case(resp(input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x"}]}]), param="input[0].content[0]",
        says=("input_image",)),
    "output without its call": Case(resp(input=[item(), {
        "type": "function_call_output", "call_id": "call_9", "output": "4"}]),
        param="input[1].call_id", says=("call_9",)),
    "call without a name": Case(resp(input=[{"type": "function_call", "call_id": "c",
                                             "arguments": "{}"}]), param="input[0]",
                                says=("name",)),
    # a hosted tool (web_search...) is left out and said; a type nobody defines is a 400
    "unknown tool type": Case(resp(tools=[{"type": "hologram"}]), param="tools[0].type",
                              says=("hologram",)),
    "tool name with a space": Case(resp(tools=[{**FUNCTION, "name": "get weather"}]),
                                   param="tools[0].name"),
    "tool schema not an object": Case(resp(tools=[{**FUNCTION, "parameters": {
        "type": "array"}}]), param="tools[0].parameters"),
    "tool_choice names no tool": Case(resp(tools=[FUNCTION], tool_choice={
        "type": "function", "name": "nope"}), param="tool_choice", says=("nope",)),
    "tool_choice required without tools": Case(resp(tool_choice="required"),
                                               param="tool_choice"),
    "temperature above 2": Case(resp(temperature=3), param="temperature"),
    "max_output_tokens a numeric string": Case(resp(max_output_tokens="3"),
                                               param="max_output_tokens", says=("got `str`",)),
    "temperature a numeric string": Case(resp(temperature="0.5"), param="temperature"),
    "store the string true": Case(resp(store="true"), param="store"),
    "max_output_tokens zero": Case(resp(max_output_tokens=0), param="max_output_tokens"),
    "json_schema without a schema": Case(resp(text={"format": {"type": "json_schema",
                                                               "name": "x"}}),
                                         param="text.format.schema"),
    "background": Case(resp(background=True), param="background"),
    # any effort OpenAI defines is served without reasoning; one it does not is a 400
    "reasoning effort": Case(resp(reasoning={"effort": "extreme"}), param="reasoning.effort",
                             says=("extreme",)),
    "reasoning summary": Case(resp(reasoning={"summary": "verbose"}), param="reasoning.summary",
                              says=("verbose",)),
    "include": Case(resp(include=["message.output_text.logprobs"]), param="include",
                    says=("logprobs",)),
    "unknown previous_response_id": Case(resp(previous_response_id="resp_nope"), status=404,
                                         param="previous_response_id", says=("resp_nope",)),
    "bad prompt_cache_options ttl": Case(resp(prompt_cache_options={"ttl": "7d"}),
                                         param="prompt_cache_options.ttl", says=("7d",)),
    "bad breakpoint ttl": Case(resp(input=[item(prompt_cache_breakpoint={
        "mode": "explicit", "ttl": "1m"})]),
        param="input[0].content[0].prompt_cache_breakpoint.ttl"),
    "bad prompt_cache_retention": Case(resp(prompt_cache_retention="forever"),
                                       param="prompt_cache_retention"),
    "both cache lifetimes": Case(resp(prompt_cache_retention="24h",
                                      prompt_cache_options={"ttl": "30m"}),
                                 param="prompt_cache_retention"),
    "prompt over the context": Case(resp(input=LONG_TEXT), param="input",
                                    says=("maximum context length",)),
    "get an unknown response": Case(None, status=404, param="response_id",
                                    path="/v1/responses/resp_nope", method="GET"),
    "delete an unknown response": Case(None, status=404, param="response_id",
                                       path="/v1/responses/resp_nope", method="DELETE"),
    "input_items is not served": Case(None, status=404, path="/v1/responses/x/input_items",
                                      method="GET", says=("input items",)),
}


def msg(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
            **fields}


TOOL = {"name": "get_weather", "input_schema": CITY}
USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}

MESSAGES_CASES: dict[str, Case] = {
    "no max_tokens": Case({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                          says=("max_tokens",)),
    "no messages": Case({"model": MODEL, "max_tokens": 2}, says=("messages",)),
    "system role in messages with no user turn": Case(msg(messages=[
        {"role": "system", "content": "x"}]), says=("user turn",)),
    "wrong role": Case(msg(messages=[{"role": "robot", "content": "x"}]), says=("robot",)),
    "message without content": Case(msg(messages=[{"role": "user"}]),
                                    says=("messages.0.content",)),
    "unknown block type": Case(msg(messages=[{"role": "user", "content": [
        {"type": "banana"}]}]), says=("messages.0.content.0", "banana")),
    "image block": Case(msg(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]),
        says=("image",)),
    "tool_result without its tool_use": Case(msg(messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "4"}]}]),
        says=("toolu_9", "tool_use")),
    "tool_result answering an older turn": Case(msg(messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": [USE]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "4"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "4"}]}]), says=("messages.4.content.0",)),
    "tool_use in a user turn": Case(msg(messages=[{"role": "user", "content": [USE]}]),
                                    says=("assistant turns",)),
    "tool_use without an id": Case(msg(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}]),
        says=("messages.1.content.0.id",)),
    "server tool": Case(msg(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
                        says=("web_search_20250305",)),
    "tool without input_schema": Case(msg(tools=[{"name": "f"}]), says=("input_schema",)),
    "tool_choice names no tool": Case(msg(tools=[TOOL], tool_choice={"type": "tool",
                                                                     "name": "nope"}),
                                      says=("nope",)),
    "unknown tool_choice": Case(msg(tools=[TOOL], tool_choice={"type": "maybe"}),
                                says=("tool_choice",)),
    "tool_choice any without tools": Case(msg(tool_choice={"type": "any"}),
                                          says=("tool_choice requires tools",)),
    "cache_control ttl 10m": Case(msg(system=[{"type": "text", "text": "x", "cache_control": {
        "type": "ephemeral", "ttl": "10m"}}]), says=("system.0.cache_control.ttl", "10m")),
    "cache_control of another type": Case(msg(messages=[{"role": "user", "content": [
        {"type": "text", "text": "x", "cache_control": {"type": "persistent"}}]}]),
        says=("ephemeral",)),
    "top-level cache_control ttl": Case(msg(cache_control={"type": "ephemeral", "ttl": "2h"}),
                                        says=("cache_control.ttl",)),
    "tool cache_control ttl": Case(msg(tools=[{**TOOL, "cache_control": {
        "type": "ephemeral", "ttl": 5}}]), says=("tools.0.cache_control.ttl",)),
    "temperature above 1": Case(msg(temperature=1.5), says=("temperature",)),
    # thinking enabled or adaptive is answered without thinking; a type nobody defines is not
    "thinking": Case(msg(thinking={"type": "sometimes"}), says=("thinking.type",)),
    "system block not text": Case(msg(system=[{"type": "image"}]), says=("system.0.type",)),
    "empty stop sequence": Case(msg(stop_sequences=[""]), says=("stop_sequences",)),
    "negative max_tokens": Case(msg(max_tokens=-1), says=("max_tokens",)),
    "max_tokens a numeric string": Case(msg(max_tokens="3"), says=("max_tokens", "got `str`")),
    "temperature a numeric string": Case(msg(temperature="0.5"), says=("temperature",)),
    "count_tokens with a numeric string": Case(msg(max_tokens="3"),
                                               path="/v1/messages/count_tokens",
                                               says=("max_tokens",)),
    "prompt over the context": Case(msg(messages=[{"role": "user", "content": LONG_TEXT}]),
                                    says=("prompt is too long", "> 4096 maximum")),
    "count_tokens of a bad block": Case({"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "banana"}]}]}, path="/v1/messages/count_tokens",
        says=("banana",)),
    "message batches are not served": Case({}, status=404, path="/v1/messages/batches",
                                           says=("batches",)),
    "a body that is not JSON": Case(b"max_tokens=2", status=415,
                                    headers={"content-type": "text/plain"}, says=("JSON",)),
}


@pytest.fixture(scope="module")
def client(tiny) -> Iterator[TestClient]:
    config, engine = tiny
    with TestClient(create_app(config, engine=engine), base_url=LOCAL) as test_client:
        yield test_client


def send(client: TestClient, case: Case, default_path: str) -> Any:
    path = case.path or default_path
    if case.body is None:
        return client.request(case.method, path)
    if isinstance(case.body, bytes):
        return client.request(case.method, path, content=case.body, headers=case.headers)
    return client.request(case.method, path, json=case.body, headers=case.headers)


def footprint(client: TestClient) -> tuple[Any, ...]:
    """What a refused request must leave as it was."""
    stats = client.get("/v1/stats").json()
    server = client.app.state.agentd
    return (stats["prompt_tokens_total"], stats["num_requests_finished"],
            len(server.responses), stats["by_key"])


def anthropic_error(response: Any, status: int) -> dict[str, Any]:
    """The reply is ``status`` with exactly Anthropic's error shape; returns the error."""
    assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    error = body["error"]
    assert set(error) == {"type", "message"} and error["message"], error
    expected = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 415: "invalid_request_error"}[status]
    assert error["type"] == expected, error
    return error


@pytest.mark.parametrize("name", list(RESPONSES_CASES))
def test_bad_responses_request(client: TestClient, name: str, openai_error, idle) -> None:
    case = RESPONSES_CASES[name]
    before = footprint(client)
    for stream in (False, True) if isinstance(case.body, dict) else (False,):
        body = {**case.body, "stream": True} if stream else case.body
        error = openai_error(send(client, Case(**{**vars(case), "body": body}), RESPONSES),
                             case.status)
        if case.param is not None:
            assert error["param"] == case.param, error
        for text in case.says:
            assert text in error["message"], error
    assert footprint(client) == before
    idle(client.get, num_pinned_ok=False)


@pytest.mark.parametrize("name", list(MESSAGES_CASES))
def test_bad_messages_request(client: TestClient, name: str, idle) -> None:
    case = MESSAGES_CASES[name]
    before = footprint(client)
    for stream in (False, True) if isinstance(case.body, dict) and case.body else (False,):
        body = {**case.body, "stream": True} if stream else case.body
        error = anthropic_error(send(client, Case(**{**vars(case), "body": body}), MESSAGES),
                                case.status)
        for text in case.says:
            assert text in error["message"], error
    assert footprint(client) == before
    idle(client.get, num_pinned_ok=False)


@pytest.mark.parametrize("text", ["false", "true"])
def test_stream_as_a_string_is_a_400_on_both_wires(client: TestClient, text: str, openai_error,
                                                   idle) -> None:
    """``"stream": "false"`` is no bool (msgspec's lax conversion once made it one)."""
    before = footprint(client)
    error = openai_error(client.post(RESPONSES, json=resp(stream=text)), 400)
    assert error["param"] == "stream" and "got `str`" in error["message"], error
    error = anthropic_error(client.post(MESSAGES, json=msg(stream=text)), 400)
    assert "stream" in error["message"] and "got `str`" in error["message"], error
    assert footprint(client) == before
    idle(client.get, num_pinned_ok=False)


def test_unsupported_endpoints_are_named(client: TestClient, openai_error) -> None:
    for path, what in (("/v1/embeddings", "embeddings"), ("/v1/audio/speech", "audio"),
                       ("/v1/images/generations", "image"), ("/v1/moderations", "moderations")):
        error = openai_error(client.post(path, json={"input": "x"}), 404)
        assert error["code"] == "unsupported_endpoint" and what in error["message"], error
        assert "/v1/responses" in error["message"] and "/v1/messages" in error["message"]
    # a path that is no API at all is still a plain 404
    assert openai_error(client.get("/v1/nothing-here"), 404)["code"] == "not_found"
