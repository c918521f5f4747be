"""A request's state as the scheduler and engine see it: token ids and counters, no tensors,
and what it asked for beyond tokens (a prefix to retain, a tail to keep, a pin to register, a
grammar), so that its whole life is held in one place (vLLM keeps it on its ``Request`` too).

Invariant: ``num_computed_tokens <= num_tokens``; ``all_token_ids`` is the prompt followed by
every token generated so far.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from agentd.engine.sampling_params import SamplingParams
from agentd.pins.pin_request import PinRequest


@dataclass(frozen=True)
class RetentionRequest:
    """Hold the prompt's first ``num_tokens`` tokens (whole blocks of them) for ``ttl_s`` once
    computed: cache control (Anthropic ``cache_control``, OpenAI ``prompt_cache_*``)."""

    num_tokens: int
    ttl_s: float

    def __post_init__(self) -> None:
        if self.num_tokens < 0 or not self.ttl_s > 0:
            raise ValueError("a hold covers >= 0 tokens for a positive number of seconds")


@dataclass(frozen=True)
class EngineRequest:
    """One request as a wire's plan hands it to the engine, whole (design §9's one internal
    request): ``AsyncEngine.add_request`` and ``LLMEngine.add_request`` take it as it is."""

    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str | None = None  # None: the engine names it
    cache_salt: str | None = None  # mixed into its first block hash (a tenant's, a client's)
    owner: str | None = None  # the tenant: what it retains is held in its name
    retention: RetentionRequest | None = None  # hold the prompt's prefix once computed
    keep_tail: bool = False  # a stored response: keep its last partial block once finished
    grammar: Any = None  # ``params.structured_outputs`` compiled, off the engine thread
    pin: PinRequest | None = None  # this request prefills a pin; it is registered as it ends
    # the session a client named (prompt_cache_key, a coding agent's session header): the disk
    # tier keeps its blocks over anonymous prefixes
    session: str | None = None


def check_prompt(prompt_token_ids: list[int], max_model_len: int,
                 vocab_size: int | None = None) -> None:
    """The engine's one check of a prompt: not empty, room left in the context for at least one
    output token, token ids within the vocabulary. Raises ValueError saying which."""
    if not prompt_token_ids:
        raise ValueError("the prompt is empty")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(prompt_token_ids)} tokens but this model's context "
            f"(max_model_len) is {max_model_len} tokens, which must also hold the output"
        )
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in prompt_token_ids):
        raise ValueError(f"prompt token ids must be within [0, {vocab_size})")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_output_tokens: int
    cache_salt: str | None = None
    owner: str | None = None  # the tenant it runs for
    arrival_time_s: float = field(default_factory=time.monotonic)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # set at first admission; None until then
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: str | int | None = None
    first_token_time_s: float | None = None
    num_preemptions: int = 0
    # The hash chain of all_token_ids' full blocks, as far as it is known: hashed once while the
    # request waits (its lookup), extended as its blocks are computed and cached, never again
    # every step. The one copy: the cache manager and the pins read it, and keep none.
    block_hashes: list[bytes] = field(default_factory=list)
    pin_name: str | None = None  # the pin this request hit, if any
    # Draft tokens proposed to follow ``all_token_ids`` (agentd.engine.spec_decode); the scheduler
    # runs them once, beside the request's next token, and the sampler keeps those the model agrees
    # on.
    spec_token_ids: list[int] = field(default_factory=list)
    # What it asked for beyond tokens (from its EngineRequest), read by the engine's hooks:
    retention: RetentionRequest | None = None  # until held (then None)
    num_retained_tokens: int = 0  # prompt tokens its retention holds now
    keep_tail: bool = False
    pin: PinRequest | None = None
    grammar: Any = None
    session: str | None = None

    @classmethod
    def of(cls, request_id: str, request: EngineRequest, max_output_tokens: int) -> Request:
        """The running state of ``request``, under ``request_id``."""
        return cls(request_id, list(request.prompt_token_ids), request.params,
                   max_output_tokens, request.cache_salt, request.owner,
                   retention=request.retention, keep_tail=request.keep_tail, pin=request.pin,
                   grammar=request.grammar, session=request.session)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    def prompt_block_hashes(self, block_size: int) -> list[bytes]:
        """The hashes of the prompt's full blocks (all known once the request is admitted)."""
        return self.block_hashes[:self.num_prompt_tokens // block_size]

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def truncate(self, num_tokens: int) -> None:
        """Drop the tokens past ``num_tokens`` (output accepted in one step beyond a stop)."""
        del self.all_token_ids[max(num_tokens, self.num_prompt_tokens):]
        self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens)
