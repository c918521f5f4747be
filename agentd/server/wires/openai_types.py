"""What the OpenAI wires share (msgspec Structs): the output-constraint and cache fields of a
request, the usage and the head of every reply, and the model list.

Each wire's own types are beside it (``chat_types``, ``completions_types``, ``responses_types``).
Invariants: unknown request fields are ignored (agent frameworks send extras);
``usage.prompt_tokens_details.cached_tokens`` is always present.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType


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


class Reply(msgspec.Struct, kw_only=True):
    """What every chat and text completion reply, whole or chunk, starts with."""

    id: str
    created: int
    model: str


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    created: int
    max_model_len: int
    max_output_tokens: int  # the cap of a request that sets none (agentd start --max-output-tokens)
    object: str = "model"
    owned_by: str = "agentd"


class ModelList(msgspec.Struct, kw_only=True):
    data: list[ModelCard]
    object: str = "list"
