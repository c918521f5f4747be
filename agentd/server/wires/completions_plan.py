"""The OpenAI legacy text completions wire's plan: a prompt (text or token ids) checked and
turned into the shared ``Plan`` (its replies: ``completions_reply``).

Invariant: the prompt reaches the engine exactly as given — token ids untouched, text through the
tokenizer with its special tokens (vLLM's behaviour) — and ``echo`` prepends the prompt text to
the reply without changing what is generated. Text completions retain nothing and parse no tool
calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentd.engine.request import EngineRequest
from agentd.server.errors import APIError, RequestValidationError
from agentd.server.wires.chat_plan import to_sampling_params
from agentd.server.wires.checks import check_sampling
from agentd.server.wires.completions_types import (
    CompletionRequest,
)
from agentd.server.wires.constraints import output_format
from agentd.server.wires.plan import Plan
from agentd.server.wires.serving import new_request_id
from agentd.server.wires.tool_calls import ToolMode

# OpenAI's default for the legacy endpoint; chat completions default to "until the end".
DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class CompletionJob:
    plan: Plan
    echo_text: str  # the prompt's text, when ``echo`` asks for it first in the reply


def plan_completion(req: CompletionRequest, engine: Any, model: str,
                    created: int) -> CompletionJob:
    """Validate ``req`` and tokenize its prompt; raises OpenAI-shaped 400 errors."""
    validate_completion_request(req)
    prompt = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]  # ["text"] or [[ids]]: one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        prompt_token_ids = list(engine.tokenizer(prompt).input_ids)
        prompt_text = prompt
    else:
        prompt_token_ids = [int(t) for t in prompt]  # type: ignore[arg-type]
        if any(not 0 <= t < engine.vocab_size for t in prompt_token_ids):
            raise APIError(400, f"prompt token ids must be in [0, {engine.vocab_size})",
                           param="prompt")
        prompt_text = engine.tokenizer.decode(prompt_token_ids) if req.echo else ""
    try:
        params = to_sampling_params(req, DEFAULT_MAX_TOKENS)
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
    constraint = output_format(req)
    if constraint is not None:
        params.structured_outputs = constraint.params
    plan = Plan(
        model=model, created=created,
        request=EngineRequest(prompt_token_ids, params, new_request_id("cmpl"), req.cache_salt),
        tool_mode=ToolMode.OFF, constraint=constraint,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        prompt_param="prompt",
    )
    return CompletionJob(plan, prompt_text if req.echo else "")


def validate_completion_request(req: CompletionRequest) -> None:
    """Raise ``RequestValidationError`` for the first thing wrong with ``req``."""
    _check_prompt(req.prompt)
    if req.logprobs is not None:
        raise RequestValidationError("logprobs is not supported; omit it", "logprobs")
    if req.suffix is not None:
        raise RequestValidationError("suffix is not supported; omit it", "suffix")
    check_sampling(req)


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
