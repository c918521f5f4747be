"""The Responses API through the official ``openai`` SDK (``client.responses``) against a daemon
on loopback (uvicorn, a tiny random model): plain, streamed (every event parsed, by both the raw
iterator and the SDK's accumulating ``responses.stream``), function tools with a
``function_call_output`` round trip, the store (GET/DELETE, ``store: false``, per API key), and
``previous_response_id`` continued token-exactly: on every turn of a six-turn conversation the
cached tokens are the whole previous prompt and reply, less the reply's last token, and the
replies are the tokens the same prompts give computed from nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from agentd.server.app import ServerSettings, create_app

MODEL = "tiny-llama"
# an enum keeps a random model's arguments short (the grammar forces one of these)
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]}},
        "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
           "parameters": CITY}


@pytest.fixture(scope="module")
def served(tiny, serve) -> Iterator[tuple[str, Any]]:
    config, engine = tiny
    app = create_app(config, engine=engine)
    with serve(app) as url:
        yield url, app.state.agentd


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="unused", max_retries=0,
                         timeout=600)


def test_plain_response_is_stored_and_can_be_deleted(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Say hello.", instructions="Be brief.",
                                       max_output_tokens=6, temperature=0,
                                       metadata={"run": "1"}, prompt_cache_key="greeter")
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "incomplete"  # the tiny model never stops within 6 tokens
    assert response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text == message.content[0].text and response.output_text
    usage = response.usage
    assert usage.output_tokens == 6 and usage.input_tokens > 6
    assert usage.input_tokens_details.cached_tokens == 0
    assert response.instructions == "Be brief." and response.metadata == {"run": "1"}
    again = client.responses.retrieve(response.id)
    assert again.model_dump() == response.model_dump()
    deleted = client.responses.delete(response.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError, match=response.id):
        client.responses.retrieve(response.id)


def test_store_false_keeps_nothing(client: openai.OpenAI, served) -> None:
    num_stored = len(served[1].responses)
    response = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    assert response.store is False and len(served[1].responses) == num_stored
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        client.responses.create(model=MODEL, input="more", previous_response_id=response.id)


def test_streamed_events_parse_and_match_the_whole_reply(client: openai.OpenAI) -> None:
    body = {"model": MODEL, "input": "Count to three.", "max_output_tokens": 8, "temperature": 0}
    whole = client.responses.create(**body, store=False)
    events = list(client.responses.create(**body, store=False, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    # the SDK's own accumulator (ResponseStream) checks every event against its snapshot
    with client.responses.stream(**body, store=False) as stream:
        accumulated = list(stream)
    assert accumulated[-1].type == "response.incomplete"
    assert accumulated[-1].response.output_text == whole.output_text


def test_function_call_round_trip(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="What is the weather in Oslo?",
                                    tools=[WEATHER], tool_choice="required", temperature=0,
                                    max_output_tokens=64)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and isinstance(json.loads(call.arguments)["city"],
                                                            str)
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "4 C, rain"}
    # the whole conversation sent again, as stateless agents do
    history = [{"role": "user", "content": "What is the weather in Oslo?"},
               *[item.model_dump(exclude_none=True) for item in first.output], output]
    answer = client.responses.create(model=MODEL, input=history, tools=[WEATHER],
                                     tool_choice="none", max_output_tokens=4, store=False)
    assert answer.output[0].type == "message" and answer.output_text
    # and continued from the stored response with the output alone
    continued = client.responses.create(model=MODEL, previous_response_id=first.id,
                                        input=[output], tools=[WEATHER], tool_choice="none",
                                        max_output_tokens=4, store=False)
    assert continued.previous_response_id == first.id and continued.output_text
    previous = first.usage
    assert continued.usage.input_tokens_details.cached_tokens == \
        previous.input_tokens + previous.output_tokens - 1


def test_streamed_function_call(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input="Weather in Rome?", tools=[WEATHER],
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=64, store=False, stream=True))
    kinds = [e.type for e in events]
    added = events[kinds.index("response.output_item.added")]
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    arguments = "".join(e.delta for e in events
                        if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == arguments and json.loads(arguments)["city"]
    assert kinds[-1] == "response.completed"
    [call] = events[-1].response.output
    assert call.arguments == arguments and call.call_id == added.item.call_id
    with client.responses.stream(model=MODEL, input="Weather in Rome?", tools=[WEATHER],
                                 tool_choice="required", max_output_tokens=64,
                                 store=False) as stream:
        final = stream.get_final_response()
    [call] = final.output
    assert call.type == "function_call" and json.loads(call.arguments)["city"]


def test_six_turns_continue_token_exactly(client: openai.OpenAI, served) -> None:
    server = served[1]
    previous = None
    for turn in range(6):
        response = client.responses.create(
            model=MODEL, input=f"Turn {turn}: tell me more about caches.", temperature=0,
            max_output_tokens=5 + turn, instructions="You are terse." if turn == 0 else None,
            previous_response_id=previous.id if previous else None)
        stored = server.responses.get(None, response.id).token_ids
        usage = response.usage
        assert len(stored) == usage.input_tokens + usage.output_tokens
        if previous is not None:
            before = server.responses.get(None, previous.id).token_ids
            assert stored[:len(before)] == before  # the earlier turns were never re-rendered
            # every token of the previous prompt and reply was a hit, but its last (no step
            # computed that token's KV)
            assert usage.input_tokens_details.cached_tokens == len(before) - 1
        # the same prompt computed from nothing (another cache salt) gives the same tokens
        fresh = client.completions.create(
            model=MODEL, prompt=stored[:usage.input_tokens], max_tokens=usage.output_tokens,
            temperature=0, extra_body={"cache_salt": f"from-nothing-{turn}", "ignore_eos": True})
        assert fresh.usage.prompt_tokens_details.cached_tokens == 0
        assert fresh.choices[0].text == response.output_text
        previous = response


def test_responses_are_kept_per_api_key(tiny, serve) -> None:
    config, engine = tiny
    app = create_app(config, engine=engine, settings=ServerSettings(api_keys=("ka", "kb")))
    with serve(app) as url:
        a, b = (openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=600)
                for key in ("ka", "kb"))
        response = a.responses.create(model=MODEL, input="secret", max_output_tokens=2)
        assert a.responses.retrieve(response.id).id == response.id
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(response.id)
        with pytest.raises(openai.NotFoundError):
            b.responses.create(model=MODEL, input="x", previous_response_id=response.id)
        with pytest.raises(openai.NotFoundError):
            b.responses.delete(response.id)
        a.responses.delete(response.id)


def test_prompt_cache_key_stats(client: openai.OpenAI, served) -> None:
    from click.testing import CliRunner

    from agentd.cli.stats import command as stats_command

    url, _ = served
    for _ in range(2):
        client.responses.create(model=MODEL, input="Same prompt, same key.", store=False,
                                max_output_tokens=2, prompt_cache_key="agent-blue")
    client.chat.completions.create(model=MODEL, max_tokens=2, prompt_cache_key="agent-blue",
                                   messages=[{"role": "user", "content": "Same prompt."}])
    [row] = [r for r in client.get("/stats", cast_to=object)["by_key"]
             if r["key"] == "agent-blue"]
    assert row["requests"] == 3 and row["hits"] >= 1  # the second response hit the first
    assert 0 < row["cached_tokens"] < row["prompt_tokens"]
    shown = CliRunner().invoke(stats_command, ["--by-key", "--url", url])
    assert shown.exit_code == 0, shown.output
    assert "agent-blue" in shown.output and "hit rate" in shown.output
