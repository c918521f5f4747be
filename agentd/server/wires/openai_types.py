"""The OpenAI wire's types for chat and text completions (msgspec Structs): requests as they
decode, replies as they encode.

Invariants: unknown request fields are ignored (agent frameworks send extras); reply Structs
encode exactly like OpenAI's: streaming deltas omit unset fields, ``logprobs`` is always
``null``, and ``usage.prompt_tokens_details.cached_tokens`` is always present. The checks a
request passes are the wire's adapters' (``openai_chat``, ``openai_completions``) and the shared
ones (``checks``).
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

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
    """OpenAI's ``prompt_cache_options`` (chat and Responses): ``mode`` "implicit" (the default:
    the prompt is one breakpoint) or "explicit" (only marked breakpoints), ``ttl`` "30m" or
    "12h"; ``prewarm`` and ``comparison_response_id`` are accepted and change nothing."""

    mode: str | None = None
    ttl: str | None = None
    prewarm: bool | None = None
    comparison_response_id: str | None = None


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


class _Reply(msgspec.Struct, kw_only=True):
    """What every chat and text completion reply, whole or chunk, starts with."""

    id: str
    created: int
    model: str


class ChatCompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatCompletionMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(_Reply, kw_only=True):
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


class ChatCompletionChunk(_Reply, kw_only=True):
    choices: list[ChatCompletionChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"
    system_fingerprint: str | None = None


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class Completion(_Reply, kw_only=True):
    choices: list[CompletionChoice]
    usage: Usage
    object: str = "text_completion"
    system_fingerprint: str | None = None


class CompletionChunk(_Reply, kw_only=True):
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
