"""The Responses API's types (msgspec Structs): the request as it decodes (``ResponsesRequest``)
and the reply objects, encoded exactly as OpenAI's.

Invariant: a ``Response`` carries every field the official SDK reads — ``output`` items of type
``message`` (``output_text`` parts) and ``function_call``, ``status`` and
``incomplete_details``, and ``usage`` with ``input_tokens_details.cached_tokens`` — and echoes
the request's settings (tools, tool_choice, text format, instructions, metadata...).
"""

from __future__ import annotations

from typing import Any

import msgspec

from agentd.server.wires.openai_types import PromptCacheOptions


class OutputText(msgspec.Struct, kw_only=True):
    text: str
    type: str = "output_text"
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class OutputMessage(msgspec.Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    content: list[OutputText]
    status: str = "completed"
    role: str = "assistant"


class FunctionCallItem(msgspec.Struct, kw_only=True, tag_field="type", tag="function_call",
                       omit_defaults=True):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"
    namespace: str | None = None  # the namespace tool it belongs to, if any


class CustomToolCallItem(msgspec.Struct, kw_only=True, tag_field="type",
                         tag="custom_tool_call", omit_defaults=True):
    id: str
    call_id: str
    name: str
    input: str  # the free text the model wrote for the tool
    status: str = "completed"
    namespace: str | None = None


CallItem = FunctionCallItem | CustomToolCallItem
OutputItem = OutputMessage | FunctionCallItem | CustomToolCallItem


class InputTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails = msgspec.field(
        default_factory=OutputTokensDetails)


class Response(msgspec.Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    status: str
    output: list[OutputItem]
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    previous_response_id: str | None
    prompt_cache_key: str | None
    store: bool
    temperature: float
    top_p: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    user: str | None
    usage: ResponseUsage | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, str] | None = None
    completed_at: int | None = None
    truncation: str = "disabled"
    reasoning: dict[str, Any] = msgspec.field(
        default_factory=lambda: {"effort": None, "summary": None})
    background: bool = False
    service_tier: str = "default"
    object: str = "response"


class DeletedResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "response.deleted"
    deleted: bool = True


class TextFormat(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    input: str | list[dict[str, Any]] | None = None
    model: str | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    truncation: str | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    reasoning: dict[str, Any] | None = None
    cache_salt: str | None = None  # vLLM extension, as on chat
    ignore_eos: bool = False  # vLLM extension, as on chat
