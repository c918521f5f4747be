"""The Chat Completions wire's types (msgspec Structs): the request as it decodes, the reply and
its stream chunks as they encode.

Invariants: unknown request fields are ignored (agent frameworks send extras); replies encode
exactly like OpenAI's: streaming deltas omit unset fields, ``logprobs`` is always ``null``, and
``usage.prompt_tokens_details.cached_tokens`` is always present. The checks a request passes are
``chat_plan``'s and the shared ones (``checks``).
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from agentd.server.wires.openai_types import (
    ConstraintFields,
    PromptCacheOptions,
    Reply,
    StreamOptions,
    Usage,
)


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


class ChatCompletionMessage(msgspec.Struct, kw_only=True):
    content: str | None  # required, so it is encoded as null next to tool calls
    role: str = "assistant"
    tool_calls: list[ToolCall] | UnsetType = UNSET  # omitted when the reply has none


class ChatCompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatCompletionMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(Reply, kw_only=True):
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


class ChatCompletionChunk(Reply, kw_only=True):
    choices: list[ChatCompletionChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"
    system_fingerprint: str | None = None
