"""Legacy text completions: a prompt (text or token ids) in, a ``Completion`` or SSE chunks out.

Invariant: the prompt reaches the engine exactly as given — token ids untouched, text through the
tokenizer with its special tokens (vLLM's behaviour) — and ``echo`` prepends the prompt text to
the reply without changing what is generated.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from agentd.async_engine import AsyncEngine, RequestStream
from agentd.outputs import StreamDelta
from agentd.sampling_params import SamplingParams
from agentd.server.constraints import Constraint, output_format
from agentd.server.errors import APIError
from agentd.server.protocol import (
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    RequestValidationError,
    to_sampling_params,
    validate_completion_request,
    validate_prompt_len,
)
from agentd.server.retention import RetentionRequest
from agentd.server.serving import (
    SSE_DONE,
    collect,
    delta_error,
    exception_error,
    new_request_id,
    sse,
    sse_error,
    usage_of,
)

# OpenAI's default for the legacy endpoint; chat completions default to "until the end".
DEFAULT_MAX_TOKENS = 16
OnFinish = Callable[[StreamDelta, str], None]


@dataclass(frozen=True)
class CompletionPlan:
    request_id: str
    model: str
    created: int
    prompt_token_ids: list[int]
    params: SamplingParams
    echo_text: str
    include_usage: bool
    cache_salt: str | None
    constraint: Constraint | None
    prompt_cache_key: str | None = None  # the Plan fields ``wires.plan.start`` reads
    keep_tail: bool = False
    retention: RetentionRequest | None = None  # text completions retain nothing


def plan_completion(req: CompletionRequest, engine: AsyncEngine, model: str,
                    created: int) -> CompletionPlan:
    """Validate ``req`` and tokenize its prompt; raises OpenAI-shaped 400 errors."""
    validate_completion_request(req, engine.max_model_len)
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
    try:
        validate_prompt_len(len(prompt_token_ids), params.max_tokens, engine.max_model_len)
    except RequestValidationError as exc:
        exc.message = exc.message.replace("shorten the messages", "shorten the prompt")
        exc.param = "prompt" if exc.param == "messages" else exc.param
        raise
    return CompletionPlan(
        request_id=new_request_id("cmpl"), model=model, created=created,
        prompt_token_ids=prompt_token_ids, params=params,
        echo_text=prompt_text if req.echo else "",
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        cache_salt=req.cache_salt, constraint=constraint,
    )


async def complete_text(plan: CompletionPlan, deltas: AsyncIterator[StreamDelta],
                        on_finish: OnFinish) -> Completion:
    got = await collect(deltas)
    finish_reason = str(got.last.finish_reason)
    on_finish(got.last, finish_reason)
    choice = CompletionChoice(index=0, text=plan.echo_text + got.text,
                              finish_reason=finish_reason)
    return Completion(id=plan.request_id, created=plan.created, model=plan.model,
                      choices=[choice], usage=usage_of(got.last))


async def stream_text(plan: CompletionPlan, deltas: RequestStream,
                      on_finish: OnFinish) -> AsyncIterator[bytes]:
    """SSE chunks for one submitted generation. Closing this generator early aborts the
    request; so does dropping it unstarted (``RequestStream`` aborts when garbage-collected).
    """

    def chunk(text: str, finish_reason: str | None = None) -> bytes:
        choice = CompletionChoice(index=0, text=text, finish_reason=finish_reason)
        return sse(CompletionChunk(id=plan.request_id, created=plan.created, model=plan.model,
                                   choices=[choice]))

    try:
        if plan.echo_text:
            yield chunk(plan.echo_text)
        last: StreamDelta | None = None
        async for delta in deltas:
            last = delta
            if delta.text:
                yield chunk(delta.text)
        assert last is not None  # the engine always ends a stream with a finished delta
        if last.error is not None:
            yield sse_error(delta_error(last))
        else:
            finish_reason = str(last.finish_reason)
            yield chunk("", finish_reason)
            if plan.include_usage:
                yield sse(CompletionChunk(id=plan.request_id, created=plan.created,
                                          model=plan.model, choices=[], usage=usage_of(last)))
            on_finish(last, finish_reason)
    except APIError as exc:
        yield sse_error(exc)
    except (ValueError, RuntimeError) as exc:
        yield sse_error(exception_error(exc))
    finally:
        await deltas.aclose()  # aborts it if unfinished
    yield SSE_DONE
