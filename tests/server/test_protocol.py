"""OpenAI wire types: decoding real SDK bodies, validation errors, and exact response shapes."""

from __future__ import annotations

import copy
from typing import Any

import msgspec
import pytest

from agentd.server.errors import RequestValidationError, error_body
from agentd.server.wires.chat_plan import (
    to_sampling_params,
    to_template_inputs,
    validate_chat_request,
)
from agentd.server.wires.chat_types import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    ToolChoiceNamed,
)
from agentd.server.wires.checks import (
    ANTHROPIC_TOO_LONG,
    OutputRoom,
    decode_request,
    fit_output,
)
from agentd.server.wires.completions_plan import validate_completion_request
from agentd.server.wires.completions_types import (
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
)
from agentd.server.wires.openai_types import ModelCard, ModelList, Usage

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

SDK_BODY: dict[str, Any] = {
    "model": "smollm2",
    "messages": [
        {"role": "developer", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": "18C, sunny"},
    ],
    "tools": [WEATHER_TOOL],
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_completion_tokens": 64,
    "temperature": 0.2,
    "stop": ["\n\n"],
    "seed": 7,
    "parallel_tool_calls": True,
    "some_future_field": {"ignored": True},
}


def decode_chat(body: dict[str, Any]) -> ChatCompletionRequest:
    return decode_request(msgspec.json.encode(body), ChatCompletionRequest)


def encode(obj: msgspec.Struct) -> Any:
    return msgspec.json.decode(msgspec.json.encode(obj))


# ---- decoding ------------------------------------------------------------------------------


def test_decode_sdk_body_with_tools_and_stream_options() -> None:
    req = decode_chat(SDK_BODY)
    validate_chat_request(req)
    assert req.messages[1].content[0].text == "Weather in Paris?"
    assert req.messages[2].tool_calls[0].function.arguments == '{"city": "Paris"}'
    assert isinstance(req.tool_choice, ToolChoiceNamed)
    assert req.tool_choice.function.name == "get_weather"
    assert req.tools[0].function.parameters["required"] == ["city"]
    assert req.stream and req.stream_options.include_usage
    assert req.stop == ["\n\n"]


def test_decode_minimal_body_defaults() -> None:
    req = decode_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    validate_chat_request(req)
    assert req.stream is False and req.tools is None and req.tool_choice is None
    assert req.stream_options is None and req.stop is None


def test_decode_string_tool_choice_and_stop() -> None:
    body = {**SDK_BODY, "tool_choice": "required", "stop": "END"}
    req = decode_chat(body)
    validate_chat_request(req)
    assert req.tool_choice == "required" and req.stop == "END"


def test_decode_type_error_names_the_field() -> None:
    body = {"messages": [{"role": "user", "content": 5}]}
    with pytest.raises(RequestValidationError) as info:
        decode_chat(body)
    assert info.value.param == "messages[0].content"
    assert info.value.status == 400


def test_decode_invalid_json() -> None:
    with pytest.raises(RequestValidationError, match="not valid JSON"):
        decode_request(b"{nope", ChatCompletionRequest)


def test_decode_completion_prompt_forms() -> None:
    for prompt in ["hi", ["hi"], [1, 2, 3], [[1, 2, 3]]]:
        req = decode_request(msgspec.json.encode({"prompt": prompt}), CompletionRequest)
        validate_completion_request(req)
        assert req.prompt == prompt


def test_template_inputs_drop_unset_fields() -> None:
    inputs = to_template_inputs(decode_chat(SDK_BODY))
    assert inputs.messages[0] == {"role": "developer", "content": "You are terse."}
    assert inputs.messages[2] == {
        "role": "assistant",
        "tool_calls": [
            {
                "id": "call_abc",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }
    assert inputs.tools == [WEATHER_TOOL]
    assert inputs.tool_choice == {"type": "function", "function": {"name": "get_weather"}}


# ---- validation ----------------------------------------------------------------------------


def _with(path: list[Any], value: Any) -> dict[str, Any]:
    body = copy.deepcopy(SDK_BODY)
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return body


BAD_BODIES = [
    (_with(["messages"], []), "messages", "at least one"),
    (_with(["messages", 1, "role"], "robot"), "messages[1].role", "system, developer, user"),
    (_with(["messages", 1, "content"], None), "messages[1].content", "required"),
    (
        _with(["messages", 1, "content"], [{"type": "image_url", "image_url": {"url": "x"}}]),
        "messages[1].content[0]",
        "text part",
    ),
    (_with(["messages", 3, "tool_call_id"], None), "messages[3].tool_call_id", "role 'tool'"),
    (_with(["n"], 2), "n", "n must be 1"),
    (_with(["logprobs"], True), "logprobs", "not supported"),
    (_with(["top_logprobs"], 3), "top_logprobs", "not supported"),
    (_with(["max_tokens"], 0), "max_tokens", "at least 1"),
    (_with(["max_completion_tokens"], -1), "max_completion_tokens", "at least 1"),
    (_with(["temperature"], -0.1), "temperature", "[0, 2]"),
    (_with(["temperature"], 2.5), "temperature", "[0, 2]"),
    (_with(["top_p"], 0.0), "top_p", "(0, 1]"),
    (_with(["top_p"], 1.5), "top_p", "(0, 1]"),
    (_with(["presence_penalty"], 3.0), "presence_penalty", "[-2, 2]"),
    (_with(["frequency_penalty"], -2.5), "frequency_penalty", "[-2, 2]"),
    (_with(["stop"], ["a", "b", "c", "d", "e"]), "stop", "at most 4"),
    (_with(["stop"], [""]), "stop", "non-empty"),
    (_with(["tools", 0, "type"], "retrieval"), "tools[0].type", "'function'"),
    (_with(["tools", 0, "function", "name"], "get weather"), "tools[0].function.name", "1-64"),
    (_with(["tools", 0, "function", "name"], ""), "tools[0].function.name", "1-64"),
    (
        _with(["tools", 0, "function", "parameters"], {"type": "string"}),
        "tools[0].function.parameters",
        "JSON Schema object",
    ),
    (_with(["tools"], [WEATHER_TOOL, WEATHER_TOOL]), "tools[1].function.name", "more than one"),
    (
        _with(["tool_choice"], {"type": "function", "function": {"name": "nope"}}),
        "tool_choice",
        "not in tools (get_weather)",
    ),
    (_with(["tool_choice"], "always"), "tool_choice", "none, auto, required"),
    (_with(["tools"], None), "tool_choice", "requires tools"),
]


@pytest.mark.parametrize(("body", "param", "needle"), BAD_BODIES)
def test_validation_errors_name_the_field(body: dict[str, Any], param: str, needle: str) -> None:
    req = decode_chat(body)
    with pytest.raises(RequestValidationError) as info:
        validate_chat_request(req)
    assert info.value.param == param
    assert param in info.value.message
    assert needle in info.value.message
    assert info.value.status == 400
    assert encode(info.value.to_body())["error"]["param"] == param


def test_tool_calls_on_user_message_rejected() -> None:
    call = SDK_BODY["messages"][2]["tool_calls"]
    req = decode_chat(_with(["messages", 1], {"role": "user", "content": "x", "tool_calls": call}))
    with pytest.raises(RequestValidationError, match=r"messages\[1\].tool_calls"):
        validate_chat_request(req)


def test_tool_choice_none_and_auto_without_tools_are_fine() -> None:
    for choice in ("none", "auto"):
        validate_chat_request(decode_chat(_with(["tools"], None) | {"tool_choice": choice}))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": ["a", 1]}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": "a", "logprobs": 2}, "logprobs"),
        ({"prompt": "a", "suffix": "z"}, "suffix"),
        ({"prompt": "a", "n": 3}, "n"),
        ({"prompt": "a", "temperature": 9}, "temperature"),
    ],
)
def test_completion_validation(body: dict[str, Any], param: str) -> None:
    req = decode_request(msgspec.json.encode(body), CompletionRequest)
    with pytest.raises(RequestValidationError) as info:
        validate_completion_request(req)
    assert info.value.param == param


def test_an_output_cap_is_clamped_to_the_room_the_prompt_leaves() -> None:
    """As llama-server and Ollama do: a cap above the room left is the room left (and says
    so); no cap is the server's; only a prompt that leaves no room is an error, in the wire's
    own words."""
    assert fit_output(100, 28, 128, 4096) == OutputRoom(28, 28, clamped=False)
    assert fit_output(100, 32000, 128, 4096) == OutputRoom(28, 32000, clamped=True)
    assert fit_output(100, None, 128, 16) == OutputRoom(16, None, clamped=False)
    assert fit_output(100, None, 128, 4096) == OutputRoom(28, None, clamped=True)
    with pytest.raises(RequestValidationError) as too_long:
        fit_output(128, None, 128, 4096)
    assert too_long.value.status == 400 and too_long.value.code == "context_length_exceeded"
    assert too_long.value.message == (
        "This model's maximum context length is 128 tokens. However, your messages resulted in "
        "128 tokens. Please reduce the length of the messages.")
    with pytest.raises(RequestValidationError) as anthropic:
        fit_output(9145, 32000, 8192, 4096, too_long=ANTHROPIC_TOO_LONG)
    assert anthropic.value.message == "prompt is too long: 9145 tokens > 8192 maximum"


# ---- sampling params -----------------------------------------------------------------------


def test_sampling_params_defaults_follow_openai() -> None:
    req = decode_chat({"messages": [{"role": "user", "content": "hi"}]})
    params = to_sampling_params(req, default_max_tokens=100)
    assert params.temperature == 1.0 and params.top_p == 1.0
    assert params.max_tokens == 100 and params.stop == [] and params.seed is None
    assert params.presence_penalty == 0.0 and params.frequency_penalty == 0.0


def test_sampling_params_max_completion_tokens_wins() -> None:
    req = decode_chat(SDK_BODY | {"max_tokens": 10, "max_completion_tokens": 20, "top_p": 0.5})
    params = to_sampling_params(req, default_max_tokens=100)
    assert params.max_tokens == 20 and params.temperature == 0.2 and params.top_p == 0.5
    assert params.stop == ["\n\n"] and params.seed == 7


def test_sampling_params_from_completion_request() -> None:
    body = {"prompt": "x", "max_tokens": 5, "stop": "END", "temperature": 0, "top_k": 3}
    req = decode_request(msgspec.json.encode(body), CompletionRequest)
    params = to_sampling_params(req, default_max_tokens=100)
    assert params.max_tokens == 5 and params.stop == ["END"] and params.greedy
    assert params.top_k == 3


# ---- response shapes -----------------------------------------------------------------------


def _chunk(delta: DeltaMessage, finish_reason: str | None = None) -> ChatCompletionChunk:
    choice = ChatCompletionChunkChoice(index=0, delta=delta, finish_reason=finish_reason)
    return ChatCompletionChunk(id="chatcmpl-1", created=1, model="m", choices=[choice])


def _chunk_dict(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "system_fingerprint": None,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
        "usage": None,
    }


def test_stream_chunk_shapes_match_openai() -> None:
    first = _chunk(DeltaMessage(role="assistant", content=""))
    assert encode(first) == _chunk_dict({"role": "assistant", "content": ""})
    assert encode(_chunk(DeltaMessage(content="Hel"))) == _chunk_dict({"content": "Hel"})
    assert encode(_chunk(DeltaMessage(), "stop")) == _chunk_dict({}, "stop")


def test_tool_call_chunk_shapes() -> None:
    head = DeltaToolCall(
        index=0,
        id="call_1",
        type="function",
        function=DeltaFunctionCall(name="get_weather", arguments=""),
    )
    tail = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='{"city": "Paris"}'))
    assert encode(_chunk(DeltaMessage(tool_calls=[head]))) == _chunk_dict(
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ""},
                }
            ]
        }
    )
    assert encode(_chunk(DeltaMessage(tool_calls=[tail]))) == _chunk_dict(
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]}
    )


def test_usage_chunk_has_no_choices_and_cached_tokens() -> None:
    chunk = ChatCompletionChunk(
        id="c", created=1, model="m", choices=[], usage=Usage.build(10, 3, 8)
    )
    out = encode(chunk)
    assert out["choices"] == []
    assert out["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 8},
    }


def test_usage_always_has_cached_tokens() -> None:
    usage = Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3)
    assert encode(usage)["prompt_tokens_details"] == {"cached_tokens": 0}
    assert encode(Usage.build(4, 5))["prompt_tokens_details"] == {"cached_tokens": 0}


def test_chat_completion_shape() -> None:
    call = ToolCall(id="call_1", function=FunctionCall(name="f", arguments="{}"))
    with_call = ChatCompletionMessage(content=None, tool_calls=[call])
    plain = ChatCompletionMessage(content="hi")
    reply = ChatCompletion(
        id="chatcmpl-1",
        created=1,
        model="m",
        usage=Usage.build(3, 1),
        choices=[
            ChatCompletionChoice(index=0, message=plain, finish_reason="stop"),
            ChatCompletionChoice(index=1, message=with_call, finish_reason="tool_calls"),
        ],
    )
    out = encode(reply)
    assert out["object"] == "chat.completion"
    assert out["choices"][0] == {
        "index": 0,
        "message": {"role": "assistant", "content": "hi"},
        "finish_reason": "stop",
        "logprobs": None,
    }
    assert out["choices"][1]["message"] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_completion_shapes() -> None:
    choice = CompletionChoice(index=0, text="abc", finish_reason="length")
    whole = Completion(id="cmpl-1", created=1, model="m", choices=[choice], usage=Usage.build(2, 3))
    chunk = CompletionChunk(id="cmpl-1", created=1, model="m", choices=[choice])
    assert encode(whole)["object"] == encode(chunk)["object"] == "text_completion"
    assert encode(chunk)["choices"] == [
        {"index": 0, "text": "abc", "finish_reason": "length", "logprobs": None}
    ]


def test_model_list_and_error_shapes() -> None:
    models = ModelList(data=[ModelCard(id="smollm2", created=5, max_model_len=2048,
                                       max_output_tokens=512)])
    assert encode(models) == {
        "object": "list",
        "data": [
            {
                "id": "smollm2",
                "object": "model",
                "created": 5,
                "owned_by": "agentd",
                "max_model_len": 2048,
                "max_output_tokens": 512,
            }
        ],
    }
    assert encode(error_body("bad", param="top_p")) == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "top_p", "code": None}
    }


def test_template_inputs_keep_the_tool_type_and_drop_unset_fields() -> None:
    """Templates see tools as OpenAI sent them: ``{"type": "function", "function": {...}}``
    (the default ``type`` once vanished through omit_defaults), unset optional fields absent."""
    from agentd.server.wires.chat_plan import to_template_inputs

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"function": {"name": "f", "parameters": {"type": "object"}}}]}
    inputs = to_template_inputs(decode_chat(body))
    assert inputs.tools == [{"function": {"name": "f", "parameters": {"type": "object"}},
                             "type": "function"}]
    assert inputs.messages == [{"role": "user", "content": "hi"}]
