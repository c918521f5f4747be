"""The Responses and Messages wires end to end: a real daemon (``agentd start``) with the default
model (SmolLM2-135M), the official ``openai`` SDK's ``client.responses``, the official
``anthropic`` SDK's ``messages``, and the openai-agents SDK with its default model — the
Responses API — running a tool and answering. Every streamed event is parsed by the SDKs."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
SYSTEM = ("You are a weather assistant. Use the tools when you need the weather. "
          "Answer in one short sentence.")


@pytest.fixture(scope="module")
def daemon(default_daemon) -> str:
    return default_daemon.url


@pytest.fixture(scope="module")
def oai(daemon: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daemon}/v1", api_key="unused", max_retries=0, timeout=900)


@pytest.fixture(scope="module")
def exact_oai(exact_daemon) -> openai.OpenAI:
    """The default model in the exact mode, for the test that holds a reply to be the same
    streamed or whole: the second request runs on the first's cached prefix, and the default
    mode's int8 products turn the last bits a cached prefix changes (its last row runs on the
    decode kernel, the whole prompt's on the prefill one) into another greedy token at a
    near-tie."""
    return openai.OpenAI(base_url=f"{exact_daemon.url}/v1", api_key="unused", max_retries=0,
                         timeout=900)


@pytest.fixture(scope="module")
def claude(daemon: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=daemon, api_key="unused", max_retries=0, timeout=900)


def test_responses_plain_and_streamed(exact_oai: openai.OpenAI) -> None:
    body: Any = {"model": MODEL, "instructions": SYSTEM, "input": "Say hello to Ada.",
                 "temperature": 0, "max_output_tokens": 48}
    whole = exact_oai.responses.create(**body)
    assert whole.output_text.strip() and whole.usage.output_tokens > 0
    events = list(exact_oai.responses.create(**body, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.output_text == whole.output_text
    with exact_oai.responses.stream(**body) as stream:
        accumulated = list(stream)  # the SDK checks each event against its snapshot
    assert accumulated[-1].response.output_text == whole.output_text


def test_responses_tool_round_trip_continues_from_the_stored_ids(oai: openai.OpenAI) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": CITY,
            "description": "The current weather in a city."}
    first = oai.responses.create(model=MODEL, instructions=SYSTEM, tools=[tool],
                                 tool_choice="required", temperature=0, max_output_tokens=64,
                                 input="What is the weather in Paris?")
    [call] = [item for item in first.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), CITY)
    second = oai.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[tool], temperature=0,
        max_output_tokens=48, input=[{"type": "function_call_output", "call_id": call.call_id,
                                      "output": "18 C and sunny"}])
    assert second.output_text.strip() or any(i.type == "function_call" for i in second.output)
    assert second.usage.input_tokens_details.cached_tokens == \
        first.usage.input_tokens + first.usage.output_tokens - 1


def test_messages_text_tools_and_count_tokens(claude: anthropic.Anthropic) -> None:
    system: Any = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    tools: Any = [{"name": "get_weather", "description": "The current weather in a city.",
                   "input_schema": CITY}]
    question: Any = {"role": "user", "content": "What is the weather in Paris?"}
    greedy: Any = {"extra_body": {"temperature": 0}}
    first = claude.messages.create(model=MODEL, max_tokens=64, system=system, tools=tools,
                                   tool_choice={"type": "any"}, messages=[question], **greedy)
    [use] = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use"
    jsonschema.validate(use.input, CITY)
    turns: Any = [question, {"role": "assistant", "content": first.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": "18 C and sunny"}]}]
    with claude.messages.stream(model=MODEL, max_tokens=48, system=system, tools=tools,
                                messages=turns, **greedy) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert text == "".join(b.text for b in final.content if b.type == "text")
    counted = claude.messages.count_tokens(model=MODEL, system=system, tools=tools,
                                           messages=turns)
    usage = final.usage
    # Anthropic's total: uncached + read from cache + written to it (the cache_control mark)
    assert counted.input_tokens == (usage.input_tokens + usage.cache_read_input_tokens
                                    + usage.cache_creation_input_tokens)
    assert usage.cache_read_input_tokens > 0  # the system prompt and first turn were cached


def test_openai_agents_default_responses_model_runs_a_tool(daemon: str,
                                                           agents_weather_tool: Any) -> None:
    agents = pytest.importorskip("agents")
    agents.set_default_openai_client(openai.AsyncOpenAI(
        base_url=f"{daemon}/v1", api_key="unused", max_retries=0, timeout=900),
        use_for_tracing=False)
    agent = agents.Agent(name="weather", instructions=SYSTEM, tools=[agents_weather_tool.tool],
                         model=MODEL, model_settings=agents.ModelSettings(
                             tool_choice="required", temperature=0, max_tokens=96))
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert agents_weather_tool.cities  # the tool was called with parsed arguments and executed
    assert isinstance(result.final_output, str) and result.final_output.strip()
    # both model calls went over the Responses API (ids of agentd's stored responses)
    assert len(result.raw_responses) >= 2
    assert all(r.response_id.startswith("resp_") for r in result.raw_responses)
