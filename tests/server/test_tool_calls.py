"""Tool calls in the server: the forced-prefix seeding of the assistant turn, and the assembler
that turns generated text into content and calls the same way whole or streamed."""

from __future__ import annotations

import json

import msgspec
import pytest
from litestar.testing import TestClient

from agentd.server.protocol import ChatCompletionRequest
from agentd.server.serving_chat import plan_chat
from agentd.server.tool_calls import (
    CallPiece,
    ToolCallAssembler,
    ToolMode,
    forced_call_prefix,
)

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def test_forced_prefixes() -> None:
    assert forced_call_prefix(False, None) == ""
    assert forced_call_prefix(True, None) == '<tool_call>\n{"name": "'
    assert forced_call_prefix(False, "get_weather") == \
        '<tool_call>\n{"name": "get_weather", "arguments": '


def _stream(assembler: ToolCallAssembler, text: str, cut: int) -> tuple[str, list]:
    pieces = []
    for i in range(0, len(text), cut):
        pieces += assembler.feed(text[i : i + cut])
    pieces += assembler.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    calls = [(p.index, p.call.name, p.call.arguments_json) for p in pieces
             if isinstance(p, CallPiece)]
    return content, calls


@pytest.mark.parametrize("cut", [1, 3, 7, 1000])
@pytest.mark.parametrize(("mode", "prefix", "text"), [
    (ToolMode.OFF, "", 'Hi <tool_call>{"name": "f", "arguments": {}}</tool_call>'),
    (ToolMode.PARSE, "", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
                         '{"city": "Paris"}}\n</tool_call>'),
    (ToolMode.PARSE, "", "No call here, just <tool_call>text"),
    (ToolMode.FORCED, forced_call_prefix(False, "get_weather"),
     '{"city": "Paris"}}\n</tool_call>'),
    (ToolMode.FORCED, forced_call_prefix(False, "get_weather"), '{"city": "Paris"}}'),  # unclosed
    (ToolMode.FORCED, forced_call_prefix(True, None),
     'get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'),
    (ToolMode.FORCED, forced_call_prefix(True, None), "oops, not json"),
])
def test_streamed_equals_whole(mode: ToolMode, prefix: str, text: str, cut: int) -> None:
    whole = ToolCallAssembler(mode, prefix).whole(text)
    content, calls = _stream(ToolCallAssembler(mode, prefix), text, cut)
    assert content == whole.content
    assert calls == [(i, c.name, c.arguments_json) for i, c in enumerate(whole.tool_calls)]


def test_forced_call_is_parsed_even_unclosed() -> None:
    parsed = ToolCallAssembler(ToolMode.FORCED, forced_call_prefix(False, "get_weather")) \
        .whole('{"city": "Paris"}}')
    (call,) = parsed.tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments_json) == {"city": "Paris"}
    assert parsed.content == ""


def test_named_tool_choice_seeds_the_prompt(tiny) -> None:
    _, engine = tiny
    plain = plan_chat(_request(tool_choice=None), engine, "tiny-llama", 0)
    assert plain.tool_mode is ToolMode.PARSE and plain.forced_prefix == ""
    forced = plan_chat(_request(tool_choice=NAMED), engine, "tiny-llama", 0)
    assert forced.tool_mode is ToolMode.FORCED
    prefix_ids = engine.tokenizer(forced.forced_prefix, add_special_tokens=False).input_ids
    assert forced.prompt_token_ids[-len(prefix_ids):] == prefix_ids
    none = plan_chat(_request(tool_choice="none"), engine, "tiny-llama", 0)
    assert none.tool_mode is ToolMode.OFF


def _request(tool_choice: object) -> ChatCompletionRequest:
    body = {"messages": USER, "tools": TOOLS, "tool_choice": tool_choice}
    return msgspec.convert(body, ChatCompletionRequest)


def test_forced_call_over_http_keeps_the_seeded_text(client: TestClient) -> None:
    """The tiny random model cannot finish the JSON, so the reply is content that starts with
    the seeded opening — proof the prefix went into the prompt and back into the parse."""
    body = {"messages": USER, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 4,
            "temperature": 0}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["content"].startswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    events = client.post("/v1/chat/completions", json={**body, "stream": True}).text
    chunks = [json.loads(e[len("data: "):]) for e in events.split("\n\n")
              if e.startswith("data: {")]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == message["content"]
