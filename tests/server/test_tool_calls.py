"""Tool calls and output formats through the server, on a tiny random model: whatever the
weights say, the grammar makes every call and every JSON reply valid. The schemas here are
finite (enums, booleans, no free strings), so even random weights finish them."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import msgspec
import pytest
from litestar.testing import TestClient

from agentd.server.wires.chat_plan import plan_chat
from agentd.server.wires.chat_types import ChatCompletionRequest
from agentd.server.wires.tool_calls import ToolCallAssembler, ToolMode

UNITS = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "ok": {"type": "boolean"}},
         "required": ["unit", "ok"], "additionalProperties": False}
LEVEL = {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}}, "required": ["level"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": UNITS}},
         {"type": "function", "function": {"name": "set_volume", "parameters": LEVEL}}]
SCHEMAS = {"get_weather": UNITS, "set_volume": LEVEL}
NAMED = {"type": "function", "function": {"name": "set_volume"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def chat(client: TestClient, **body: Any) -> dict[str, Any]:
    body = {"messages": USER, "temperature": 0, "max_tokens": 96, **body}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def stream_chunks(client: TestClient, **body: Any) -> list[dict[str, Any]]:
    body = {"messages": USER, "temperature": 0, "max_tokens": 96, "stream": True, **body}
    text = client.post("/v1/chat/completions", json=body).text
    return [json.loads(e[len("data: "):]) for e in text.split("\n\n") if e.startswith("data: {")]


def assert_valid_calls(calls: list[dict[str, Any]]) -> None:
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        name = call["function"]["name"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


def test_required_gives_one_valid_call_and_no_content(client: TestClient) -> None:
    reply = chat(client, tools=TOOLS, tool_choice="required")  # one call unless parallel
    (choice,) = reply["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    assert len(choice["message"]["tool_calls"]) == 1
    assert_valid_calls(choice["message"]["tool_calls"])


def test_named_function_is_the_one_called(client: TestClient) -> None:
    message = chat(client, tools=TOOLS, tool_choice=NAMED)["choices"][0]["message"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["set_volume"]
    assert_valid_calls(message["tool_calls"])


def test_parallel_calls_are_each_valid(client: TestClient) -> None:
    choice = chat(client, tools=TOOLS, tool_choice="required", max_tokens=120,
                  parallel_tool_calls=True)["choices"][0]
    calls = choice["message"]["tool_calls"]
    if choice["finish_reason"] == "length":
        calls = calls[:-1]  # the last may be cut; every complete one must be valid
    assert_valid_calls(calls)


def test_calls_stream_as_openai_streams_them(client: TestClient) -> None:
    body = {"tools": TOOLS, "tool_choice": "required"}
    whole = chat(client, **body)["choices"][0]["message"]["tool_calls"][0]
    chunks = stream_chunks(client, **body)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    call_deltas = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    first, rest = call_deltas[0], call_deltas[1:]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": whole["function"]["name"], "arguments": ""}
    assert rest and all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                        for d in rest)
    assert "".join(d["function"]["arguments"] for d in rest) == whole["function"]["arguments"]
    assert not any(d.get("content") for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_json_schema_response_format(client: TestClient) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "units", "schema": UNITS}}
    reply = chat(client, response_format=fmt)
    assert reply["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(reply["choices"][0]["message"]["content"]), UNITS)
    streamed = "".join(c["choices"][0]["delta"].get("content") or ""
                       for c in stream_chunks(client, response_format=fmt) if c["choices"])
    assert streamed == reply["choices"][0]["message"]["content"]


def test_vllm_structured_outputs_in_completions(client: TestClient) -> None:
    for body in ({"structured_outputs": {"choice": ["red", "green", "blue"]}},
                 {"guided_choice": ["red", "green", "blue"]},
                 {"structured_outputs": {"regex": "(red|green|blue)"}}):
        response = client.post("/v1/completions", json={
            "prompt": "Pick a colour:", "temperature": 0, "max_tokens": 8, **body})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] in ("red", "green", "blue")


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/gone"}}}}}]},
     "tools", "function 'f'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}}},
     "response_format", "frob"),
    ({"structured_outputs": {"regex": "(open"}}, "structured_outputs", "parenthesis"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs", "missing"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "both"),
    ({"tools": TOOLS, "structured_outputs": {"regex": "a+"}}, "structured_outputs", "JSON"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
])
def test_constraints_that_cannot_work_are_400(client: TestClient, body: dict, param: str,
                                              words: str) -> None:
    response = client.post("/v1/chat/completions", json={"messages": USER, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_plan_constrains_tools_and_keeps_the_prompt(tiny) -> None:
    _, engine = tiny

    def plan(**body: Any):
        return plan_chat(msgspec.convert({"messages": USER, **body}, ChatCompletionRequest),
                         engine, "tiny-llama", 0)

    auto, required = plan(tools=TOOLS), plan(tools=TOOLS, tool_choice="required")
    assert auto.tool_mode is ToolMode.PARSE
    assert auto.params.structured_outputs.tool_calls.mode == "auto"
    assert required.params.structured_outputs.tool_calls.mode == "required"
    assert not required.params.structured_outputs.tool_calls.parallel  # one call by default
    several = plan(tools=TOOLS, tool_choice="required", parallel_tool_calls=True)
    assert several.params.structured_outputs.tool_calls.parallel
    named = plan(tools=TOOLS, tool_choice=NAMED).params.structured_outputs.tool_calls
    assert [f.name for f in named.functions] == ["set_volume"] and not named.parallel
    none = plan(tools=TOOLS, tool_choice="none")
    assert none.tool_mode is ToolMode.OFF and none.params.structured_outputs is None
    # the assistant turn is no longer seeded: the grammar opens the call
    assert required.prompt_token_ids[-3:] == auto.prompt_token_ids[-3:]


@pytest.mark.parametrize("cut", [1, 3, 7, 1000])
@pytest.mark.parametrize(("mode", "text"), [
    (ToolMode.OFF, 'Hi <tool_call>{"name": "f", "arguments": {}}</tool_call>'),
    (ToolMode.PARSE, 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
                     '{"unit": "c", "ok": true}}\n</tool_call>'),
    (ToolMode.PARSE, "No call here, just <tool_call>text"),
    (ToolMode.PARSE, '<tool_call>\n{"name": "f", "arguments": {"a": "}"}}\n</tool_call>\n'
                     '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'),
])
def test_streamed_equals_whole(mode: ToolMode, text: str, cut: int) -> None:
    whole = ToolCallAssembler(mode).whole(text)
    assembler = ToolCallAssembler(mode)
    pieces = []
    for i in range(0, len(text), cut):
        pieces += assembler.feed(text[i : i + cut])
    pieces += assembler.finish()
    assert "".join(p for p in pieces if isinstance(p, str)) == whole.content
    args: dict[int, str] = {}
    for piece in pieces:
        if not isinstance(piece, str):
            args[piece.index] = args.get(piece.index, "") + getattr(piece, "text", "")
    assert [args[i] for i in sorted(args)] == [c.arguments_json for c in whole.tool_calls]
    assert assembler.num_calls == len(whole.tool_calls)
