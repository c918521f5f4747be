"""End to end: a real ``agentd start`` process with the default model on a free loopback port,
driven by the real ``openai`` SDK — sync, async and streaming chat, a tool-call round trip,
16 concurrent streams equal to the same requests run alone (on the exact mode, which promises
it), prefix-cache hits reported in ``usage``, and Prometheus counters that move."""

from __future__ import annotations

import asyncio
import json
from importlib import resources

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def daemon(default_daemon) -> str:
    """The base URL of the shared ``python -m agentd.cli start`` with the default model."""
    return default_daemon.url


@pytest.fixture(scope="module")
def client(daemon: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daemon}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def exact_url(exact_daemon) -> str:
    """The default model in the exact mode: the tests that hold a request's tokens to be the
    same streamed or whole, alone or among 15 others, on a cached prefix or not."""
    return exact_daemon.url


@pytest.fixture(scope="module")
def exact_client(exact_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{exact_url}/v1", api_key="unused", max_retries=0)


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_sync_chat(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=ask("Name a color."),
                                           temperature=0, max_tokens=12)
    assert reply.object == "chat.completion" and reply.model == MODEL
    assert reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.usage.prompt_tokens_details.cached_tokens >= 0


def test_async_chat(daemon: str) -> None:
    async def run() -> str:
        async with openai.AsyncOpenAI(base_url=f"{daemon}/v1", api_key="unused") as client:
            reply = await client.chat.completions.create(
                model=MODEL, messages=ask("Name a fruit."), temperature=0, max_tokens=12)
            return reply.choices[0].message.content or ""

    assert asyncio.run(run())


def test_streaming_chat_equals_non_streaming(exact_client: openai.OpenAI) -> None:
    request = dict(model=MODEL, messages=ask("Count to five."), temperature=0, max_tokens=16)
    whole = exact_client.chat.completions.create(**request)
    chunks = list(exact_client.chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks
              if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        whole.usage.completion_tokens


def test_tool_call_round_trip(client: openai.OpenAI) -> None:
    messages = ask("What is the weather in Paris right now?")
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], temperature=0, max_tokens=32,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments), dict)
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id,
                  "content": json.dumps({"city": "Paris", "temperature_c": 18})}]
    second = client.chat.completions.create(model=MODEL, messages=messages,
                                            tools=[WEATHER_TOOL], temperature=0, max_tokens=24)
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length")
    assert answer.message.content and not answer.message.tool_calls
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_sixteen_concurrent_streams_equal_solo_runs(exact_client: openai.OpenAI,
                                                    exact_url: str) -> None:
    prompts = [f"Write one sentence about the number {i}." for i in range(16)]
    request = dict(model=MODEL, temperature=0, max_tokens=12)
    solo = [exact_client.chat.completions.create(messages=ask(p), **request)
            .choices[0].message.content for p in prompts]

    async def stream_one(aclient: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await aclient.chat.completions.create(messages=ask(prompt), stream=True,
                                                       **request)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{exact_url}/v1", api_key="unused") as aclient:
            return await asyncio.gather(*(stream_one(aclient, p) for p in prompts))

    assert asyncio.run(run_all()) == solo
    assert len(set(solo)) > 1  # the prompts really are different requests


def test_repeated_system_prompt_reports_cached_tokens(client: openai.OpenAI) -> None:
    workload = json.loads(resources.files("agentd.workloads").joinpath(
        "coding_agent.json").read_text())
    system = workload["system"][:1500]  # ~300 tokens: many full blocks, a quick cold prefill
    usages = []
    for turn in workload["turns"][:2]:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": system}, *ask(turn)],
            temperature=0, max_tokens=4)
        usages.append(reply.usage)
    cached = usages[1].prompt_tokens_details.cached_tokens
    assert cached > 0
    assert cached >= 128  # the system prompt alone spans 20-odd full 16-token blocks
    assert cached < usages[1].prompt_tokens  # the new user turn was not cached


def _counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if not s.name.endswith("_created") and "le" not in s.labels}


def test_metrics_counters_move(client: openai.OpenAI, daemon: str) -> None:
    before = _counters(daemon)
    client.chat.completions.create(model=MODEL, messages=ask("Say hi."), max_tokens=4)
    after = _counters(daemon)
    for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:prefix_cache_queries_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_count"):
        assert after[name] > before.get(name, 0.0), name
    assert "vllm:kv_cache_usage_perc" in after and "vllm:num_requests_running" in after


def test_completions_and_errors_through_the_sdk(client: openai.OpenAI) -> None:
    text = client.completions.create(model=MODEL, prompt="The capital of France is",
                                     max_tokens=4, temperature=0)
    assert text.choices[0].text and text.usage.completion_tokens <= 4
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.chat.completions.create(model=MODEL, messages=ask("hi"), n=2)
    with pytest.raises(openai.NotFoundError):  # an unknown route
        client.get("/nothing-here", cast_to=object)
    other = client.chat.completions.with_raw_response.create(  # the one model serves any name
        model="gpt-17", messages=ask("hi"), max_tokens=2)
    assert other.headers["x-agentd-ignored"] == "model" and other.parse().choices


def test_prompt_lookup_streams_what_it_returns_whole(exact_client: openai.OpenAI,
                                                     exact_url: str) -> None:
    """A code-editing request, whose reply copies the function it quotes: the daemon (default
    ``--speculative ngram``) accepts drafts, several tokens a step, and the streamed reply with
    a stop string is the whole reply cut before the stop, as without speculation."""
    workload = json.loads(resources.files("agentd.workloads").joinpath(
        "code_edit_agent.json").read_text())
    messages = [{"role": "system", "content": workload["system"]},
                {"role": "user", "content": workload["turns"][9]}]
    request = dict(model=MODEL, messages=messages, temperature=0, max_tokens=48)
    before = _counters(exact_url)
    whole = exact_client.chat.completions.create(**request).choices[0].message.content or ""
    after = _counters(exact_url)
    assert after["vllm:spec_decode_num_accepted_tokens_total"] > \
        before["vllm:spec_decode_num_accepted_tokens_total"] + 8
    index = next(i for i in range(len(whole) // 2, len(whole) - 6)
                 if whole.find(whole[i:i + 6]) == i)
    stop = whole[index:index + 6]
    chunks = list(exact_client.chat.completions.create(**request, stream=True, stop=[stop]))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole[:index]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and
            c.choices[0].finish_reason] == ["stop"]
