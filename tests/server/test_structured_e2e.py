"""Tool calls and JSON that always parse, end to end: a real daemon with the default model
(SmolLM2-135M), the real ``openai`` SDK, and the agent frameworks themselves (openai-agents,
LangChain). Every call is checked against its schema with the ``jsonschema`` library, never
with agentd's own code."""

from __future__ import annotations

import asyncio
import json
from importlib import resources
from typing import Any

import jsonschema
import openai
import pytest

from agentd.bench.workload import load_workload, opening_turns, packaged_path

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WORKLOADS = ("research_agent", "coding_agent", "support_agent")
# per workload: its single turns, then its conversations' first messages. 50 each is the whole
# check (``pytest -m full``, about 4 minutes a workload on 2 cores: 2,000-token agent prompts at
# batch 16), and 10 each. CI runs 4 of the code-editing agent's (required and named calls
# alternate, two of its 4 tools named): each workload costs a cold prefill of its
# system prompt and tools, and on one of CI's threads the research agent's 2,305 tokens took ~35 s
# and its 10 calls ~55 s more, where the coding agent's 5,785 took 123 s (attention grows with
# the square of the prompt). The fields these tools lack (`format: email`, `minItems`/`maxItems`,
# `number`, `pattern`) are enforced in tests/structured (test_enforced, test_formats) and
# test_closing.
CI_WORKLOAD = "code_edit_agent"
NUM_PROMPTS_CI = 4
NUM_PROMPTS = 10
NUM_PROMPTS_FULL = 50
CONCURRENCY = 16
MAX_TOKENS = 128


def workload(name: str) -> dict[str, Any]:
    return json.loads(resources.files("agentd.workloads").joinpath(f"{name}.json").read_text())


def prompts_of(name: str, num_prompts: int) -> list[str]:
    prompts = opening_turns(load_workload(packaged_path(name)), num_prompts)
    assert len(prompts) == num_prompts  # every workload has 50
    return prompts


@pytest.fixture(scope="module")
def daemon(default_daemon) -> str:
    return default_daemon.url


@pytest.fixture(scope="module")
def client(daemon: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daemon}/v1", api_key="unused", max_retries=0)


async def gather_limited(calls: list[Any]) -> list[Any]:
    """The first call alone, then the rest ``CONCURRENCY`` at a time: they hit the prefix the
    first one cached (the system prompt and tools), as an agent's later requests do. Sent all at
    once, each computed the same ~4,000-token prefix itself (in-flight prefills share nothing),
    which was most of this module's time."""
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(call: Any) -> Any:
        async with gate:
            return await call

    if not calls:
        return []
    first = await calls[0]
    return [first, *await asyncio.gather(*(one(c) for c in calls[1:]))]


def check_calls(message: Any, tools: list[dict[str, Any]], only: str | None = None) -> None:
    """Every call names a tool and its arguments validate against that tool's schema."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert message.tool_calls, f"no tool call; content: {message.content!r}"
    for call in message.tool_calls:
        assert call.type == "function" and call.id
        assert call.function.name in schemas
        assert only is None or call.function.name == only
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.parametrize(("name", "num_prompts"), [
    (CI_WORKLOAD, NUM_PROMPTS_CI),
    *[pytest.param(name, NUM_PROMPTS, marks=pytest.mark.full) for name in WORKLOADS],
    *[pytest.param(name, NUM_PROMPTS_FULL, marks=pytest.mark.full) for name in WORKLOADS]])
def test_required_and_named_calls_always_validate(daemon: str, name: str,
                                                  num_prompts: int) -> None:
    data = workload(name)
    tools, prompts = data["tools"], prompts_of(name, num_prompts)
    names = [t["function"]["name"] for t in tools]

    async def run() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=f"{daemon}/v1", api_key="unused",
                                      max_retries=0, timeout=600) as client:
            def ask(prompt: str, choice: Any) -> Any:
                return client.chat.completions.create(
                    model=MODEL, temperature=0, max_tokens=MAX_TOKENS, tools=tools,
                    tool_choice=choice, messages=[{"role": "system", "content": data["system"]},
                                                  {"role": "user", "content": prompt}])
            return await gather_limited([ask(p, choice_of(i)) for i, p in enumerate(prompts)])

    def choice_of(i: int) -> Any:
        """Even prompts "required", odd ones a named function (each tool in turn): every prompt
        asks once, so the suite stays within CI's time."""
        if i % 2 == 0:
            return "required"
        return {"type": "function", "function": {"name": names[(i // 2) % len(names)]}}

    replies = asyncio.run(run())
    for i, reply in enumerate(replies):
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", (prompts[i], choice)
        assert choice.message.content is None
        named = None if i % 2 == 0 else choice_of(i)["function"]["name"]
        check_calls(choice.message, tools, only=named)
        assert named is None or len(choice.message.tool_calls) == 1


WEATHER_TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "units": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}}}]


def weather_history() -> list[dict[str, Any]]:
    """An agent loop's history: three questions, each answered through a call and its result.
    SmolLM2-135M opens no call on its own from a system prompt alone (not one in the
    workloads' first turns, constrained or not); after a history of calls it does."""
    history: list[dict[str, Any]] = [{"role": "system", "content": (
        "You answer weather questions. Always call get_weather first, then answer from its "
        "result.")}]
    for i, (city, result) in enumerate([("Paris", "18 C, sunny"), ("Madrid", "25 C, clear"),
                                        ("London", "12 C, rain")]):
        history += [
            {"role": "user", "content": f"What's the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call_{i}", "type": "function", "function": {
                    "name": "get_weather", "arguments": json.dumps({"city": city})}}]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": result},
            {"role": "assistant", "content": f"It is {result} in {city}."}]
    return history


def test_auto_calls_that_appear_validate(daemon: str) -> None:
    """``tool_choice`` "auto": the model chooses between text and a call; every call it opens
    is constrained from its opening on, so it parses and validates, and ends the turn."""
    cities = ["Tokyo", "Berlin", "Lima", "Oslo", "Cairo", "Delhi", "Rome", "Quito", "Seoul",
              "Accra", "Perth", "Hanoi"]

    async def run() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=f"{daemon}/v1", api_key="unused",
                                      max_retries=0, timeout=600) as client:
            return await gather_limited([client.chat.completions.create(
                model=MODEL, temperature=0, max_tokens=64, tools=WEATHER_TOOLS,
                messages=weather_history() + [
                    {"role": "user", "content": f"What's the weather in {city}?"}])
                for city in cities])

    replies = asyncio.run(run())
    with_calls = [r for r in replies if r.choices[0].message.tool_calls]
    for reply in with_calls:
        assert reply.choices[0].finish_reason == "tool_calls"
        check_calls(reply.choices[0].message, WEATHER_TOOLS)
    for reply in replies:
        if not reply.choices[0].message.tool_calls:
            assert "<tool_call>" not in (reply.choices[0].message.content or "")
    assert with_calls  # the model does open calls on its own here; each one validated above


SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                      "temperature_c": {"type": "number", "minimum": -60,
                                                        "maximum": 60}},
     "required": ["city", "temperature_c"]},
    {"type": "object", "properties": {"sentiment": {"enum": ["positive", "neutral", "negative"]},
                                      "confidence": {"type": "number", "minimum": 0,
                                                     "maximum": 1}},
     "required": ["sentiment", "confidence"]},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 4,
                                                "items": {"type": "string", "maxLength": 30}}},
     "required": ["items"]},
    {"type": "object", "properties": {"person": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                         "age": {"type": "integer", "minimum": 0,
                                                 "maximum": 130}},
        "required": ["name", "age"]}}, "required": ["person"]},
    {"type": "object", "properties": {"is_bug": {"type": "boolean"},
                                      "severity": {"type": "integer", "minimum": 1,
                                                   "maximum": 5}},
     "required": ["is_bug", "severity"]},
    {"type": "object", "properties": {"steps": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9},
                                         "action": {"type": "string", "maxLength": 40}},
        "required": ["n", "action"]}}}, "required": ["steps"]},
    {"type": "object", "properties": {"language": {"enum": ["python", "rust", "go", "c"]},
                                      "lines": {"type": "integer", "minimum": 1,
                                                "maximum": 10000}},
     "required": ["language", "lines"]},
    {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 80},
                                      "sources": {"type": "array", "maxItems": 2, "items": {
                                          "type": "string", "maxLength": 40}}},
     "required": ["answer", "sources"]},
    {"type": "object", "properties": {"price": {"type": "number", "exclusiveMinimum": 0,
                                                "maximum": 1000},
                                      "currency": {"enum": ["USD", "EUR", "GBP"]}},
     "required": ["price", "currency"]},
    {"type": "object", "properties": {"date": {"type": "string",
                                               "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                                      "event": {"type": "string", "maxLength": 40}},
     "required": ["date", "event"]},
]
QUESTIONS = [
    "What's the weather in Lisbon today?", "Classify: 'the update broke my build again'.",
    "List a few things to pack for a beach trip.", "Who wrote Hamlet, and how old was he?",
    "The login page crashes on submit. Is it a bug, and how bad?",
    "How do I deploy a static site?", "Which language is the Linux kernel written in?",
    "What is the capital of Japan?", "How much does a good keyboard cost?",
    "When did the first moon landing happen?",
]


def test_json_schema_replies_validate(daemon: str) -> None:
    """20 schemas: each of the ten above as given, and in strict mode (sent together, as
    concurrent agents send them: one batch decodes them all)."""
    cases = [(strict, i, schema, question) for strict in (False, True)
             for i, (schema, question) in enumerate(zip(SCHEMAS, QUESTIONS, strict=True))]

    async def run() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=f"{daemon}/v1", api_key="unused",
                                      max_retries=0, timeout=600) as client:
            return await gather_limited([client.chat.completions.create(
                model=MODEL, temperature=0, max_tokens=MAX_TOKENS,
                response_format={"type": "json_schema", "json_schema": {
                    "name": f"s{i}", "schema": schema, "strict": strict}},
                messages=[{"role": "user", "content": question + " Answer in JSON."}])
                for strict, i, schema, question in cases])

    for (strict, _, schema, _), reply in zip(cases, asyncio.run(run()), strict=True):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        value = json.loads(choice.message.content)
        jsonschema.validate(value, schema)
        if strict:  # strict mode: every property present
            assert set(value) == set(schema["properties"])


def test_json_object_reply(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=MAX_TOKENS, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Reply in JSON with the keys name and age for "
                                              "a cat called Tom, aged 3."}])
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_streamed_call_arrives_as_openai_streams_it(client: openai.OpenAI) -> None:
    data = workload(CI_WORKLOAD)  # its prefix is cached by the test above
    chunks = list(client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=MAX_TOKENS, tools=data["tools"], stream=True,
        tool_choice="required", messages=[{"role": "system", "content": data["system"]},
                                          {"role": "user", "content": data["turns"][3]}]))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert calls[0].id and calls[0].function.name and calls[0].function.arguments == ""
    assert len(calls) > 2 and all(c.id is None and c.function.name is None for c in calls[1:])
    arguments = "".join(c.function.arguments for c in calls)
    schema = next(t["function"]["parameters"] for t in data["tools"]
                  if t["function"]["name"] == calls[0].function.name)
    jsonschema.validate(json.loads(arguments), schema)
    assert not any(d.content for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


# --- the agent frameworks -------------------------------------------------------------------

def test_openai_agents_runs_a_tool_and_answers(daemon: str, agents_weather_tool: Any) -> None:
    agents = pytest.importorskip("agents")
    client = openai.AsyncOpenAI(base_url=f"{daemon}/v1", api_key="unused", max_retries=0)
    agent = agents.Agent(
        name="weather", instructions="Use the get_weather tool, then answer in one sentence.",
        tools=[agents_weather_tool.tool], model=agents.OpenAIChatCompletionsModel(MODEL, client),
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                            max_tokens=96))
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert agents_weather_tool.cities  # the tool was called with parsed arguments and executed
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert "<tool_call>" not in result.final_output


def test_openai_agents_output_type_is_parsed(daemon: str) -> None:
    agents = pytest.importorskip("agents")
    pydantic = pytest.importorskip("pydantic")
    agents.set_tracing_disabled(True)

    class Weather(pydantic.BaseModel):
        city: str
        temperature_c: int

    client = openai.AsyncOpenAI(base_url=f"{daemon}/v1", api_key="unused", max_retries=0)
    agent = agents.Agent(
        name="extract", instructions="Extract the city and temperature.", output_type=Weather,
        model=agents.OpenAIChatCompletionsModel(MODEL, client),
        model_settings=agents.ModelSettings(temperature=0, max_tokens=64))
    result = agents.Runner.run_sync(agent, "In Oslo it is 4 degrees Celsius.", max_turns=2)
    assert isinstance(result.final_output, Weather)


def test_langchain_bind_tools_and_structured_output(daemon: str) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    pydantic = pytest.importorskip("pydantic")

    class Weather(pydantic.BaseModel):
        """The weather in a city."""

        city: str
        temperature_c: int

    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        return city

    llm = langchain_openai.ChatOpenAI(base_url=f"{daemon}/v1", api_key="unused", model=MODEL,
                                      temperature=0, max_tokens=96, max_retries=0)
    message = llm.bind_tools([get_weather], tool_choice="required").invoke(
        "What is the weather in Rome?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    weather = llm.with_structured_output(Weather).invoke("In Oslo it is 4 degrees Celsius.")
    assert isinstance(weather, Weather)


# --- unbounded formats end within max_tokens -----------------------------------------------

TIME_TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "query_prometheus", "description": "Run a PromQL query over a time range",
    "parameters": {"type": "object", "required": ["query", "time_range"], "properties": {
        "query": {"type": "string", "description": "PromQL expression"},
        "time_range": {"type": "object", "required": ["start", "end"], "properties": {
            "start": {"type": "string", "format": "date-time"},
            "end": {"type": "string", "format": "date-time"}}},
        "dashboard": {"type": "string", "format": "uri"}}}}}]
TIME_PROMPTS = ["What was the p99 latency of checkout between 2pm and 3pm yesterday?",
                "Query the error rate from 2023-02-03T14:42:28.322912Z on, and link the "
                "dashboard."]


@pytest.fixture(scope="module")
def time_call_estimate(default_model_dir) -> int:
    """What closing says the shortest call to ``TIME_TOOLS`` takes, on the default model's
    tokenizer (the model's weights do not enter it)."""
    from transformers import AutoTokenizer

    from agentd.structured.compiler import GrammarCompiler
    from agentd.structured.matchers import StructuredOutputs
    from agentd.structured.params import tool_calls_params

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    structured = StructuredOutputs(len(tokenizer), compiler.decoded_vocab,
                                   [tokenizer.eos_token_id])
    params = tool_calls_params(TIME_TOOLS, {"type": "function",
                                            "function": {"name": "query_prometheus"}})
    assert params is not None
    structured.add("estimate", compiler.compile(params))
    cost = structured.cost_to_close("estimate")
    assert cost is not None
    return cost


@pytest.mark.parametrize("budget", ["tight", "issue's"])
def test_calls_with_date_times_and_uris_end_and_validate(daemon: str, time_call_estimate: int,
                                                         budget: str) -> None:
    """A call forced by name to a tool with date-time and uri fields, sampled: it ends with
    its call, whose arguments parse and validate, formats checked (issue 22: fractional
    seconds written until max_tokens ran out). ``max_tokens``: a few tokens past the estimate,
    or the issue's 200."""
    schema = TIME_TOOLS[0]["function"]["parameters"]
    max_tokens = time_call_estimate + 8 if budget == "tight" else 200

    async def run() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=f"{daemon}/v1", api_key="unused",
                                      max_retries=0, timeout=600) as client:
            return await asyncio.gather(*(client.chat.completions.create(
                model=MODEL, temperature=0.7, seed=seed, max_tokens=max_tokens,
                tools=TIME_TOOLS, messages=[{"role": "user", "content": prompt}],
                tool_choice={"type": "function", "function": {"name": "query_prometheus"}})
                for seed, prompt in enumerate(TIME_PROMPTS)))

    for reply in asyncio.run(run()):
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", (max_tokens, choice)
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schema,
                            format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        assert reply.usage.completion_tokens <= max_tokens
