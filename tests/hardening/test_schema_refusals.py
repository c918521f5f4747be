"""Schemas the grammar cannot serve are 400s on every wire, naming the field that carries them,
before the engine sees the request: a schema with a part that has no finite instance (its
required properties recur: the model could only write ``{"next": {"next": ...`` and the
engine thread's forced text grew until the kernel killed the daemon), one over the size
limits, and, where the client marked it strict, one with a keyword the grammar cannot enforce.
A schema without strict keeps such a keyword as best effort."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from litestar.testing import TestClient

from agentd.server.app import create_app

LOCAL = "http://127.0.0.1"
MODEL = "tiny-llama"
DEFS = {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
              "required": ["next"]}}
ENDLESS = {"$defs": DEFS, "$ref": "#/$defs/n"}
ENDLESS_ARGS = {"type": "object", "properties": {"list": {"$ref": "#/$defs/n"}}, "$defs": DEFS}
NOT_3 = {"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}}
ENDS = "#/$defs/n has no finite instance: every instance needs \"next\" (#/$defs/n again)"
STRICT = "not at #/properties/n cannot be enforced"


def deep(depth: int = 100) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            **fields}


def tool(parameters: dict[str, Any], **function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "walk", "parameters": parameters,
                                             **function}}


def json_format(schema: dict[str, Any], strict: bool | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": "out", "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


CHAT_CASES = {  # name: (body, param, what the message says)
    "response_format": (chat(response_format=json_format(ENDLESS)), "response_format", ENDS),
    "tools, required": (chat(tools=[tool(ENDLESS_ARGS)], tool_choice="required"), "tools",
                        ENDS),
    "tools, named": (chat(tools=[tool(ENDLESS_ARGS)], tool_choice={
        "type": "function", "function": {"name": "walk"}}), "tools", ENDS),
    "tools, auto": (chat(tools=[tool(ENDLESS_ARGS)]), "tools", ENDS),
    "structured_outputs": (chat(structured_outputs={"json": ENDLESS}), "structured_outputs",
                           ENDS),
    "guided_json": (chat(guided_json=ENDLESS), "guided_json", ENDS),
    "strict response_format": (chat(response_format=json_format(NOT_3, strict=True)),
                               "response_format", STRICT),
    "strict function": (chat(tools=[tool(NOT_3, strict=True)], tool_choice="required"),
                        "tools", STRICT),
    "strict response_format beside tools": (chat(
        tools=[tool({"type": "object"})], response_format=json_format(NOT_3, strict=True)),
        "tools", "response format's schema: " + STRICT),
    "deep response_format": (chat(response_format=json_format(deep())), "response_format",
                             "nests deeper than 64 levels"),
    "deep tool": (chat(tools=[tool(deep())]), "tools[0].function.parameters",
                  "nests deeper than 64 levels"),
}


def responses(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": "hi", "max_output_tokens": 4, **fields}


RESPONSES_CASES = {
    "text.format": (responses(text={"format": {"type": "json_schema", "name": "out",
                                               "schema": ENDLESS}}), "text.format", ENDS),
    "strict text.format": (responses(text={"format": {
        "type": "json_schema", "name": "out", "schema": NOT_3, "strict": True}}),
        "text.format", STRICT),
    "function tool": (responses(tools=[{"type": "function", "name": "walk",
                                        "parameters": ENDLESS_ARGS}], tool_choice="required"),
                      "tools", ENDS),
    "strict function tool": (responses(tools=[{"type": "function", "name": "walk",
                                               "parameters": NOT_3, "strict": True}]),
                             "tools", STRICT),
}


def messages(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
            **fields}


MESSAGES_CASES = {
    "output_config.format": (messages(output_config={"format": {
        "type": "json_schema", "schema": ENDLESS}}), ("output_config.format", ENDS)),
    "tool input_schema": (messages(tools=[{"name": "walk", "input_schema": ENDLESS_ARGS}],
                                   tool_choice={"type": "any"}), ("tools", ENDS)),
    "deep output_config.format": (messages(output_config={"format": {
        "type": "json_schema", "schema": deep()}}), ("output_config.format", "nests deeper")),
}


@pytest.fixture(scope="module")
def client(tiny) -> Iterator[TestClient]:
    config, engine = tiny
    with TestClient(create_app(config, engine=engine), base_url=LOCAL) as test_client:
        yield test_client


def num_requests(client: TestClient) -> int:
    return client.get("/v1/stats").json()["num_requests_finished"]


@pytest.mark.parametrize("name", list(CHAT_CASES) + list(RESPONSES_CASES))
def test_openai_wires_refuse_naming_the_field(client: TestClient, name: str, openai_error,
                                             idle) -> None:
    body, param, says = {**CHAT_CASES, **RESPONSES_CASES}[name]
    path = "/v1/chat/completions" if name in CHAT_CASES else "/v1/responses"
    before = num_requests(client)
    for stream in (False, True):
        error = openai_error(client.post(path, json={**body, "stream": stream}), 400)
        assert error["param"] == param, error
        assert says in error["message"] and error["message"].startswith(param), error
    assert num_requests(client) == before  # the engine never saw them
    idle(client.get, num_pinned_ok=False)


@pytest.mark.parametrize("name", list(MESSAGES_CASES))
def test_messages_refuses_in_anthropics_shape(client: TestClient, name: str, idle) -> None:
    body, says = MESSAGES_CASES[name]
    response = client.post("/v1/messages", json=body)
    assert response.status_code == 400, response.text
    payload = response.json()
    assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
    assert all(text in payload["error"]["message"] for text in says), payload
    idle(client.get, num_pinned_ok=False)


def too_deep_body(body: dict[str, Any], depth: int = 5000) -> str:
    """``body`` as JSON text with its ``"DEEP"`` string an object schema ``depth`` levels deep
    (written as text: json.dumps itself recurses out near 1,000 levels)."""
    schema = '{"type": "object", "properties": {"a": ' * depth + '{"type": "integer"}' + \
        "}}" * depth
    return json.dumps(body).replace('"DEEP"', schema)


def test_a_body_too_deep_to_decode_is_a_400(client: TestClient, openai_error) -> None:
    """Past the 64 levels a schema may nest, a body of 5,000 is past what msgspec's decoder
    takes (it recurses per level); its RecursionError is a 400 too, on every wire."""
    headers = {"content-type": "application/json"}
    for path, body in (("/v1/chat/completions", chat(response_format=json_format("DEEP"))),
                       ("/v1/responses", responses(text={"format": {
                           "type": "json_schema", "name": "out", "schema": "DEEP"}}))):
        response = client.post(path, content=too_deep_body(body), headers=headers)
        assert "nests too deep" in openai_error(response, 400)["message"]
    response = client.post("/v1/messages", content=too_deep_body(messages(output_config={
        "format": {"type": "json_schema", "schema": "DEEP"}})), headers=headers)
    assert response.status_code == 400 and "nests too deep" in response.text, response.text


def test_without_strict_an_unenforced_keyword_is_best_effort(client: TestClient) -> None:
    for strict in (None, False):
        response = client.post("/v1/chat/completions", json=chat(
            response_format=json_format(NOT_3, strict=strict)))
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
