"""OpenAI wire types (msgspec Structs) and the checks a request passes before it reaches the engine.

Invariants: unknown request fields are ignored (agent frameworks send extras), but known fields
that agentd does not support (``n > 1``, logprobs, ``logit_bias``) are rejected with a 400
naming the field. Response Structs encode exactly like OpenAI's: streaming deltas omit
unset fields, ``logprobs`` is always ``null``, and ``usage.prompt_tokens_details.cached_tokens``
is always present.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from agentd.sampling_params import SamplingParams

MAX_STOP_SEQUENCES = 4
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what a torch generator accepts
TOOL_CHOICE_STRINGS = ("none", "auto", "required")
ROLES = ("system", "developer", "user", "assistant", "tool")
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_MSGSPEC_PATH = re.compile(r" - at `\$\.?(.*)`$")


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


class ContentPart(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):  # "type" always kept: templates may read it
    function: FunctionDef
    type: str = "function"


class ToolChoiceFunction(msgspec.Struct, kw_only=True):
    name: str


class ToolChoiceNamed(msgspec.Struct, kw_only=True):
    function: ToolChoiceFunction
    type: str = "function"


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class PromptCacheOptions(msgspec.Struct, kw_only=True):
    """OpenAI's ``prompt_cache_options``: ``mode`` "implicit" (the default: the prompt is one
    breakpoint) or "explicit" (only marked breakpoints), ``ttl`` "30m" or "12h"."""

    mode: str | None = None
    ttl: str | None = None


class JSONSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    type: str
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsBody(msgspec.Struct, kw_only=True):
    """vLLM's ``structured_outputs`` extension (set one of json, regex, choice, grammar,
    json_object)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None


class ConstraintFields(msgspec.Struct, kw_only=True):
    """The output-constraint fields chat and text completions share: OpenAI's
    ``response_format``, vLLM's ``structured_outputs`` and its older ``guided_*`` fields."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatCompletionRequest(ConstraintFields, kw_only=True):
    messages: list[ChatMessage]
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | ToolChoiceNamed | None = None
    parallel_tool_calls: bool | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM extension
    cache_salt: str | None = None  # vLLM extension
    prompt_cache_key: str | None = None  # names a conversation or agent: stats by key
    prompt_cache_retention: str | None = None  # "in_memory" | "24h": keep the prompt cached
    prompt_cache_options: PromptCacheOptions | None = None


class CompletionRequest(ConstraintFields, kw_only=True):
    prompt: str | list[str | int | list[int]]
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    n: int | None = None
    logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None


# ---------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0
    # prompt tokens computed and retained for a request that asked to retain its prefix
    cache_write_tokens: int | UnsetType = UNSET


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = msgspec.field(default_factory=PromptTokensDetails)

    @classmethod
    def build(
        cls, num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0
    ) -> Usage:
        return cls(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=num_completion_tokens,
            total_tokens=num_prompt_tokens + num_completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens),
        )


class ChatCompletionMessage(msgspec.Struct, kw_only=True):
    content: str | None  # required, so it is encoded as null next to tool calls
    role: str = "assistant"
    tool_calls: list[ToolCall] | UnsetType = UNSET  # omitted when the reply has none


class ChatCompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatCompletionMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: str | None = None


class DeltaFunctionCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"
    system_fingerprint: str | None = None


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class Completion(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    object: str = "text_completion"
    system_fingerprint: str | None = None


class CompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"
    system_fingerprint: str | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "agentd"


class ModelList(msgspec.Struct, kw_only=True):
    data: list[ModelCard]
    object: str = "list"


class ErrorInfo(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorInfo


def error_body(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
) -> ErrorResponse:
    """The OpenAI error envelope: ``{"error": {"message", "type", "param", "code"}}``."""
    return ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))


# ---------------------------------------------------------------------------------------------
# Decoding and validation
# ---------------------------------------------------------------------------------------------


class RequestValidationError(ValueError):
    """A request the client must fix; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code

    def to_body(self) -> ErrorResponse:
        return error_body(self.message, param=self.param)


RequestT = TypeVar("RequestT", ChatCompletionRequest, CompletionRequest)


def decode_request(body: bytes, request_type: type[RequestT]) -> RequestT:
    """Decode a JSON body, turning msgspec's errors into a 400 that names the field."""
    try:
        return msgspec.json.decode(body, type=request_type)
    except msgspec.ValidationError as exc:
        match = _MSGSPEC_PATH.search(str(exc))
        raise RequestValidationError(str(exc), param=match.group(1) if match else None) from exc
    except msgspec.DecodeError as exc:
        raise RequestValidationError(f"request body is not valid JSON: {exc}") from exc


def validate_chat_request(req: ChatCompletionRequest, max_model_len: int) -> None:
    """Raise ``RequestValidationError`` for the first thing wrong with ``req``."""
    if not req.messages:
        raise RequestValidationError("messages must contain at least one message", "messages")
    for i, message in enumerate(req.messages):
        _check_message(message, f"messages[{i}]")
    if req.max_completion_tokens is not None:
        check_max_tokens(req.max_completion_tokens, "max_completion_tokens", max_model_len)
    if req.logprobs:
        raise RequestValidationError(
            "logprobs is not supported; omit it or set it to false", "logprobs"
        )
    if req.top_logprobs:
        raise RequestValidationError("top_logprobs is not supported; omit it", "top_logprobs")
    _check_sampling(req, max_model_len)
    tool_names = _check_tools(req.tools or [])
    _check_tool_choice(req.tool_choice, tool_names)


def validate_completion_request(req: CompletionRequest, max_model_len: int) -> None:
    """Raise ``RequestValidationError`` for the first thing wrong with ``req``."""
    _check_prompt(req.prompt)
    if req.logprobs is not None:
        raise RequestValidationError("logprobs is not supported; omit it", "logprobs")
    if req.suffix is not None:
        raise RequestValidationError("suffix is not supported; omit it", "suffix")
    _check_sampling(req, max_model_len)


def validate_prompt_len(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                        param: str = "messages", max_tokens_param: str = "max_tokens") -> None:
    """Reject a rendered prompt that leaves no room, or too little room, to generate: a 400 with
    OpenAI's code ``context_length_exceeded`` that names both numbers (what SDKs and agent
    frameworks look for to trim a conversation)."""
    if num_prompt_tokens >= max_model_len:
        raise RequestValidationError(
            f"the prompt is {num_prompt_tokens} tokens, but the model's context length "
            f"(max_model_len) is {max_model_len} tokens; shorten the {param}",
            param,
            code="context_length_exceeded",
        )
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise RequestValidationError(
            f"the prompt ({num_prompt_tokens} tokens) plus {max_tokens_param} ({max_tokens}) "
            f"exceeds max_model_len ({max_model_len}); lower {max_tokens_param}",
            max_tokens_param,
            code="context_length_exceeded",
        )


def _check_message(message: ChatMessage, where: str) -> None:
    if message.role not in ROLES:
        allowed = ", ".join(ROLES)
        raise RequestValidationError(
            f"{where}.role must be one of {allowed}, got {message.role!r}", f"{where}.role"
        )
    content = message.content
    if content is None and message.role != "assistant":
        raise RequestValidationError(
            f"{where}.content is required for role {message.role!r}", f"{where}.content"
        )
    if isinstance(content, list):
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise RequestValidationError(
                    f'{where}.content[{j}] must be a text part ({{"type": "text", "text": '
                    f"...}}); got type {part.type!r}",
                    f"{where}.content[{j}]",
                )
    if message.role == "tool" and not message.tool_call_id:
        raise RequestValidationError(
            f"{where}.tool_call_id is required for a message with role 'tool'",
            f"{where}.tool_call_id",
        )
    if message.tool_calls and message.role != "assistant":
        raise RequestValidationError(
            f"{where}.tool_calls is allowed only on assistant messages", f"{where}.tool_calls"
        )
    for j, call in enumerate(message.tool_calls or []):
        if call.type != "function" or not call.function.name:
            raise RequestValidationError(
                f"{where}.tool_calls[{j}] must have type 'function' and a function name",
                f"{where}.tool_calls[{j}]",
            )


def check_max_tokens(value: int, name: str, max_model_len: int) -> None:
    if value <= 0:
        raise RequestValidationError(f"{name} must be at least 1, got {value}", name)
    if value > max_model_len:
        raise RequestValidationError(
            f"{name} must be at most max_model_len ({max_model_len}), got {value}", name
        )


def check_range(
    value: float | None, name: str, low: float, high: float, low_open: bool = False
) -> None:
    if value is None:
        return
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise RequestValidationError(f"{name} must be in {interval}, got {value}", name)


def _check_sampling(req: ChatCompletionRequest | CompletionRequest, max_model_len: int) -> None:
    if req.n is not None and req.n != 1:
        raise RequestValidationError(
            f"n must be 1 (only one choice is supported), got {req.n}", "n"
        )
    if req.max_tokens is not None:
        check_max_tokens(req.max_tokens, "max_tokens", max_model_len)
    check_range(req.temperature, "temperature", 0.0, 2.0)
    check_range(req.top_p, "top_p", 0.0, 1.0, low_open=True)
    check_range(req.presence_penalty, "presence_penalty", -2.0, 2.0)
    check_range(req.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    if req.seed is not None and not SEED_MIN <= req.seed <= SEED_MAX:
        raise RequestValidationError(
            f"seed must be a 64-bit integer in [{SEED_MIN}, {SEED_MAX}], got {req.seed}", "seed"
        )
    if req.top_k is not None and req.top_k < 0:
        raise RequestValidationError(
            f"top_k must be >= 0 (0 disables it), got {req.top_k}", "top_k"
        )
    if req.logit_bias:
        raise RequestValidationError("logit_bias is not supported; omit it", "logit_bias")
    stops = _stop_list(req.stop)
    if len(stops) > MAX_STOP_SEQUENCES:
        raise RequestValidationError(
            f"stop accepts at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}", "stop"
        )
    if any(not s for s in stops):
        raise RequestValidationError("stop sequences must be non-empty strings", "stop")


def _check_tools(tools: list[Tool]) -> list[str]:
    names: list[str] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.type != "function":
            raise RequestValidationError(
                f"{where}.type must be 'function', got {tool.type!r}", f"{where}.type"
            )
        name = tool.function.name
        if not FUNCTION_NAME.match(name):
            raise RequestValidationError(
                f"{where}.function.name must be 1-64 characters of a-z, A-Z, 0-9, '_' or '-', "
                f"got {name!r}",
                f"{where}.function.name",
            )
        if name in names:
            raise RequestValidationError(
                f"{where}.function.name {name!r} is used by more than one tool",
                f"{where}.function.name",
            )
        check_parameters(tool.function.parameters, f"{where}.function.parameters")
        names.append(name)
    return names


def check_parameters(parameters: dict[str, Any] | None, where: str) -> None:
    if parameters is None:
        return
    if parameters.get("type", "object") != "object":
        raise RequestValidationError(
            f'{where} must be a JSON Schema object ({{"type": "object", ...}}), got type '
            f"{parameters.get('type')!r}",
            where,
        )
    if not isinstance(parameters.get("properties", {}), dict):
        raise RequestValidationError(f"{where}.properties must be an object", where)


def _check_tool_choice(tool_choice: str | ToolChoiceNamed | None, tool_names: list[str]) -> None:
    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    if isinstance(tool_choice, str) and tool_choice not in TOOL_CHOICE_STRINGS:
        raise RequestValidationError(
            f"tool_choice must be one of {', '.join(TOOL_CHOICE_STRINGS)} or "
            f'{{"type": "function", "function": {{"name": ...}}}}, got {tool_choice!r}',
            "tool_choice",
        )
    if not tool_names:
        raise RequestValidationError(
            "tool_choice requires tools; pass tools or omit tool_choice", "tool_choice"
        )
    if isinstance(tool_choice, ToolChoiceNamed) and tool_choice.function.name not in tool_names:
        raise RequestValidationError(
            f"tool_choice names the function {tool_choice.function.name!r}, which is not in "
            f"tools ({', '.join(tool_names)})",
            "tool_choice",
        )


def _check_prompt(prompt: str | list[str | int | list[int]]) -> None:
    if isinstance(prompt, str):
        return
    if not prompt:
        raise RequestValidationError("prompt must not be empty", "prompt")
    kinds = {type(item) for item in prompt}
    if len(kinds) > 1:
        raise RequestValidationError(
            "prompt must be a string, a list of strings, a list of token ids or a list of lists "
            "of token ids; got a mixed list",
            "prompt",
        )
    if len(prompt) > 1 and kinds != {int}:
        raise RequestValidationError(
            f"prompt holds {len(prompt)} prompts; only one prompt per request is supported",
            "prompt",
        )
    if kinds == {list} and not prompt[0]:
        raise RequestValidationError("prompt token ids must not be empty", "prompt")


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


# ---------------------------------------------------------------------------------------------
# Conversions
# ---------------------------------------------------------------------------------------------


def to_sampling_params(
    req: ChatCompletionRequest | CompletionRequest, default_max_tokens: int | None
) -> SamplingParams:
    """OpenAI defaults: temperature 1, top_p 1; ``max_completion_tokens`` wins over
    ``max_tokens``; ``default_max_tokens`` applies when neither is given."""
    max_tokens = getattr(req, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = req.max_tokens
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        stop=_stop_list(req.stop),
        ignore_eos=req.ignore_eos,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
    )


@dataclass(frozen=True)
class TemplateInputs:
    """A chat request as plain OpenAI-shaped dicts, ready for ``agentd.chat.render_chat``."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: str | dict[str, Any] | None


def to_template_inputs(req: ChatCompletionRequest) -> TemplateInputs:
    """Unset (None) fields are dropped, so templates that test ``'key' in message`` behave."""
    return TemplateInputs(
        messages=msgspec.to_builtins(req.messages),
        tools=msgspec.to_builtins(req.tools) if req.tools is not None else None,
        tool_choice=msgspec.to_builtins(req.tool_choice),
    )
