"""Per-request sampling parameters (vLLM's shape), validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from agentd.structured.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature`` below 1e-5 (vLLM's epsilon) is greedy: dividing logits by a smaller one
    overflows float32 to inf, and one NaN row would fail the whole batch's step. ``top_k`` of
    ``None`` (or 0) disables top-k; ``top_p`` of 1.0 disables nucleus sampling. ``seed`` makes
    a sampled request reproducible on its own. ``structured_outputs`` constrains the output to
    a JSON schema, regex, choice, grammar or tool-call turn (vLLM's name for the field).
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    include_stop_str_in_output: bool = False
    n: int = 1
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.n != 1:
            raise ValueError(f"only n=1 is supported, got n={self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 or None disables it), got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
