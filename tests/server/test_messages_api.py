"""The Messages API through the official ``anthropic`` SDK against a daemon on loopback
(uvicorn, a tiny random model): ``messages.create`` and ``messages.stream`` (every event parsed
by the SDK's accumulator), client tools with a ``tool_result`` round trip, ``count_tokens``,
``cache_control`` marks, stop sequences, an assistant prefill, ``x-api-key`` and Anthropic's
error shape through the SDK's own exception types."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from agentd.server.app import ServerSettings, create_app

MODEL = "tiny-llama"
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]}},
        "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "Weather in a city.", "input_schema": CITY}
GREEDY: Any = {"extra_body": {"temperature": 0}}  # this SDK no longer has a temperature argument
SYSTEM = [{"type": "text", "text": "You are a weather agent. " * 8,
           "cache_control": {"type": "ephemeral", "ttl": "1h"}}]


@pytest.fixture(scope="module")
def url(tiny, serve) -> Iterator[str]:
    config, engine = tiny
    with serve(create_app(config, engine=engine)) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=600)


def test_text_message_and_count_tokens(client: anthropic.Anthropic) -> None:
    messages: Any = [{"role": "user", "content": "Say hello."}]
    message = client.messages.create(model=MODEL, max_tokens=6, **GREEDY, system=SYSTEM,
                                     messages=messages, metadata={"user_id": "agent-7"})
    assert message.type == "message" and message.role == "assistant"
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    [block] = message.content
    assert block.type == "text" and block.text
    usage = message.usage
    assert usage.output_tokens == 6
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages)
    assert counted.input_tokens == (usage.input_tokens + usage.cache_read_input_tokens
                                    + usage.cache_creation_input_tokens)
    # the same prompt again: its full blocks come from the cache
    again = client.messages.create(model=MODEL, max_tokens=6, **GREEDY, system=SYSTEM,
                                   messages=messages)
    assert again.content[0].text == block.text
    assert again.usage.cache_read_input_tokens == counted.input_tokens // 16 * 16
    assert again.usage.input_tokens == counted.input_tokens - again.usage.cache_read_input_tokens


def test_stream_matches_the_whole_message(client: anthropic.Anthropic) -> None:
    body: Any = {"model": MODEL, "max_tokens": 8, **GREEDY,
                 "messages": [{"role": "user", "content": "Count to three."}]}
    whole = client.messages.create(**body)
    with client.messages.stream(**body) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    kinds = [event.type for event in client.messages.create(**body, stream=True)]
    assert kinds[:2] == ["message_start", "content_block_start"]  # the SDK drops pings
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_tool_use_and_tool_result_round_trip(client: anthropic.Anthropic) -> None:
    question: Any = {"role": "user", "content": "What is the weather in Oslo?"}
    first = client.messages.create(model=MODEL, max_tokens=64, **GREEDY, tools=[WEATHER],
                                   tool_choice={"type": "any"}, messages=[question])
    assert first.stop_reason == "tool_use"
    [use] = [block for block in first.content if block.type == "tool_use"]
    assert use.name == "get_weather" and use.input["city"] in ("Oslo", "Rome")
    assert use.id.startswith("toolu_")
    result: Any = {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": use.id, "content": "4 C and rain"}]}
    answer = client.messages.create(
        model=MODEL, max_tokens=4, **GREEDY, tools=[WEATHER],
        tool_choice={"type": "none"},
        messages=[question, {"role": "assistant", "content": first.content}, result])
    assert answer.stop_reason == "max_tokens" and answer.content[0].type == "text"
    # the same tool turn streamed: input_json_delta fragments the SDK assembles
    with client.messages.stream(model=MODEL, max_tokens=64, **GREEDY, tools=[WEATHER],
                                tool_choice={"type": "any"}, messages=[question]) as stream:
        final = stream.get_final_message()
    [streamed] = [block for block in final.content if block.type == "tool_use"]
    assert final.stop_reason == "tool_use" and streamed.input == use.input


def test_stop_sequence_and_prefill(client: anthropic.Anthropic) -> None:
    body: Any = {"model": MODEL, "max_tokens": 12, **GREEDY,
                 "messages": [{"role": "user", "content": "Go on."}]}
    text = client.messages.create(**body).content[0].text
    word = text.split()[2]
    stopped = client.messages.create(**body, stop_sequences=[word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert word not in stopped.content[0].text
    # an assistant prefill ends the prompt (the reply continues it)
    prefill = " ".join(text.split()[:2])
    with_prefill = [*body["messages"], {"role": "assistant", "content": prefill}]
    continued = client.messages.create(**{**body, "messages": with_prefill})
    counted = client.messages.count_tokens(model=MODEL, messages=with_prefill).input_tokens
    without = client.messages.count_tokens(model=MODEL, messages=body["messages"]).input_tokens
    assert counted > without
    usage = continued.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == counted


def test_errors_are_anthropic_exceptions(client: anthropic.Anthropic, tiny, serve) -> None:
    with pytest.raises(anthropic.BadRequestError, match="tool_result") as caught:
        client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}])
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):  # an unknown route, in Anthropic's shape
        client.get("/v1/messages/nothing-here", cast_to=object)
    # Claude Code's default model name is served by the one model here, and said
    other = client.messages.with_raw_response.create(
        model="claude-opus", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert other.headers["x-agentd-ignored"] == "model"
    config, engine = tiny
    with serve(create_app(config, engine=engine, settings=ServerSettings(api_keys=("k1",)))) \
            as keyed:
        good = anthropic.Anthropic(base_url=keyed, api_key="k1", max_retries=0, timeout=600)
        assert good.messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]).input_tokens > 0
        bad = anthropic.Anthropic(base_url=keyed, api_key="k2", max_retries=0, timeout=600)
        with pytest.raises(anthropic.AuthenticationError) as denied:
            bad.messages.create(model=MODEL, max_tokens=2,
                                messages=[{"role": "user", "content": "hi"}])
        assert denied.value.body["error"]["type"] == "authentication_error"


def test_max_tokens_zero_goes_to_the_prewarm(client: anthropic.Anthropic) -> None:
    """Accepted by validation and handed to ``retention.prewarm``: a pre-warm reply (no
    content, no output tokens) where retention is built, else a 501 that says so."""
    try:
        warmed = client.messages.create(model=MODEL, max_tokens=0,
                                        messages=[{"role": "user", "content": "Warm me."}])
    except anthropic.APIStatusError as exc:
        assert exc.status_code == 501 and "max_tokens: 0" in exc.body["error"]["message"]
        assert exc.body["type"] == "error" and exc.body["error"]["type"] == "api_error"
        return
    assert warmed.content == [] and warmed.usage.output_tokens == 0
