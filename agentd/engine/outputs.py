"""What the engine hands back: finished outputs for the offline API, deltas for streaming."""

from __future__ import annotations

from dataclasses import dataclass, field

from agentd.pins.pin_request import PinResult


@dataclass
class RequestOutput:
    """The whole result of one request (offline API, n = 1 only)."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    num_cached_tokens: int
    finish_reason: str | None
    stop_reason: str | int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class StreamDelta:
    """One step's news for a streaming client.

    ``text`` and ``token_ids`` are what is new since the previous delta. ``finish_reason`` is set
    on the last delta only ("stop", "length" or "abort"); ``error`` (and ``error_code``) is set
    when the engine failed the request.
    """

    request_id: str
    text: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    num_retained_tokens: int = 0  # prompt tokens its retention (cache control) holds now
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    error_code: str | None = None  # "context_length_exceeded" or "grammar_dead_end"
    first_token_time_s: float | None = None
    arrival_time_s: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    pin_result: PinResult | None = None  # a pin's prefill: how its registration ended (last)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
