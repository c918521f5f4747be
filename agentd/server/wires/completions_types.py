"""The text completions wire's types (msgspec Structs): the request as it decodes, the reply and
its stream chunks as they encode (the legacy ``/v1/completions``; its shapes are OpenAI's).
"""

from __future__ import annotations

import msgspec

from agentd.server.wires.openai_types import ConstraintFields, Reply, StreamOptions, Usage


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


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class Completion(Reply, kw_only=True):
    choices: list[CompletionChoice]
    usage: Usage
    object: str = "text_completion"
    system_fingerprint: str | None = None


class CompletionChunk(Reply, kw_only=True):
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"
    system_fingerprint: str | None = None
