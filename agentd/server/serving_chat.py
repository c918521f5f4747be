"""Chat completions: a validated request becomes prompt token ids, and the engine's deltas become
one ``ChatCompletion`` or a stream of chunks shaped exactly like OpenAI's.

Invariants: a stream is a role chunk, content (or tool-call) chunks, one chunk with the
``finish_reason``, an optional usage chunk, then ``[DONE]``; the streamed and the non-streamed
reply of the same generation carry the same content and tool calls.

Tools and formats. With tools on, the turn is grammar-constrained (``agentd.structured``):
``required`` or a named function makes it calls only, ``auto`` lets it open with text; every
call that appears is valid. ``response_format`` / ``structured_outputs`` constrain the text.
A turn holds one call unless the client sends ``parallel_tool_calls: true`` (OpenAI defaults to
several): offered another call after the first, small models repeat it until max_tokens —
SmolLM2 called ``list_dir`` with the same arguments until its 120 tokens ran out — and an agent
would run each repeat.

Cache fields. ``prompt_cache_retention: "24h"`` and ``prompt_cache_options`` retain the prompt
(``agentd.server.retention``); the usage then reports ``cache_write_tokens`` beside
``cached_tokens``. ``prompt_cache_key`` names the conversation or agent for near-miss reports.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from agentd.async_engine import AsyncEngine, RequestStream
from agentd.chat import render_chat
from agentd.outputs import StreamDelta
from agentd.server.constraints import output_format, tool_constraint
from agentd.server.errors import APIError
from agentd.server.protocol import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    Usage,
    to_sampling_params,
    to_template_inputs,
    validate_chat_request,
    validate_prompt_len,
)
from agentd.server.retention import cache_usage, openai_retention
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
from agentd.server.tool_calls import Piece, ToolCallAssembler, ToolMode
from agentd.server.wires.plan import OnFinish, Plan
from agentd.tool_parser import CallStartEvent


def plan_chat(req: ChatCompletionRequest, engine: AsyncEngine, model: str,
              created: int) -> Plan:
    """Validate ``req`` and render it to token ids; raises OpenAI-shaped 400 errors."""
    validate_chat_request(req, engine.max_model_len)
    inputs = to_template_inputs(req)
    tokenizer = engine.tokenizer
    try:
        rendered = render_chat(tokenizer, inputs.messages, inputs.tools, inputs.tool_choice)
    except Exception as exc:  # jinja raises for conversations the template refuses
        raise APIError(400, f"the chat template rejected the messages: {exc}",
                       param="messages") from exc
    tools_on = bool(inputs.tools) and inputs.tool_choice != "none"
    constraint = output_format(req)
    if tools_on:
        constraint = tool_constraint(inputs.tools or [], inputs.tool_choice,
                                     req.parallel_tool_calls, constraint)
    prompt_token_ids = list(rendered.prompt_token_ids)
    try:
        params = to_sampling_params(req, None)
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
    if constraint is not None:
        params.structured_outputs = constraint.params
    validate_prompt_len(len(prompt_token_ids), params.max_tokens, engine.max_model_len)
    retention = openai_retention(req.prompt_cache_retention, req.prompt_cache_options,
                                 len(prompt_token_ids))
    return Plan(
        request_id=new_request_id("chatcmpl"), model=model, created=created,
        prompt_token_ids=prompt_token_ids, params=params,
        tool_mode=ToolMode.PARSE if tools_on else ToolMode.OFF, constraint=constraint,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        cache_salt=req.cache_salt, retention=retention, prompt_cache_key=req.prompt_cache_key,
    )


async def complete_chat(plan: Plan, deltas: AsyncIterator[StreamDelta],
                        on_finish: OnFinish) -> ChatCompletion:
    """Collect the whole generation into one ``ChatCompletion``."""
    got = await collect(deltas)
    assembler = ToolCallAssembler(plan.tool_mode)
    parsed = assembler.whole(got.text)
    content, calls = parsed.content, parsed.tool_calls
    finish_reason = _finish_reason(bool(calls), got.last)
    message = ChatCompletionMessage(content=content if content or not calls else None)
    if calls:
        message.tool_calls = [ToolCall(id=c.id, function=FunctionCall(
            name=c.name, arguments=c.arguments_json)) for c in calls]
    on_finish(got.last, finish_reason)
    return ChatCompletion(
        id=plan.request_id, created=plan.created, model=plan.model,
        choices=[ChatCompletionChoice(index=0, message=message, finish_reason=finish_reason)],
        usage=_usage(plan, got.last),
    )


async def stream_chat(plan: Plan, deltas: RequestStream,
                      on_finish: OnFinish) -> AsyncIterator[bytes]:
    """SSE chunks for one submitted generation. Closing this generator early aborts the
    request; so does dropping it unstarted (``RequestStream`` aborts when garbage-collected).
    """

    def chunk(delta: DeltaMessage, finish_reason: str | None = None) -> bytes:
        choice = ChatCompletionChunkChoice(index=0, delta=delta, finish_reason=finish_reason)
        return sse(ChatCompletionChunk(id=plan.request_id, created=plan.created,
                                       model=plan.model, choices=[choice]))

    assembler = ToolCallAssembler(plan.tool_mode)
    try:
        yield chunk(DeltaMessage(role="assistant", content=""))
        last: StreamDelta | None = None
        async for delta in deltas:
            last = delta
            for piece in _delta_messages(assembler.feed(delta.text)):
                yield chunk(piece)
        for piece in _delta_messages(assembler.finish()):
            yield chunk(piece)
        assert last is not None  # the engine always ends a stream with a finished delta
        if last.error is not None:
            yield sse_error(delta_error(last))
        else:
            finish_reason = _finish_reason(bool(assembler.num_calls), last)
            yield chunk(DeltaMessage(), finish_reason)
            if plan.include_usage:
                yield sse(ChatCompletionChunk(id=plan.request_id, created=plan.created,
                                              model=plan.model, choices=[],
                                              usage=_usage(plan, last)))
            on_finish(last, finish_reason)
    except APIError as exc:
        yield sse_error(exc)
    except (ValueError, RuntimeError) as exc:
        yield sse_error(exception_error(exc))
    finally:
        await deltas.aclose()  # aborts it if unfinished
    yield SSE_DONE


def _usage(plan: Plan, last: StreamDelta) -> Usage:
    """OpenAI's usage; ``cache_write_tokens`` only for a request that asked to retain."""
    usage = usage_of(last)
    if plan.retention is not None:
        usage.prompt_tokens_details.cache_write_tokens = cache_usage(last, plan).creation
    return usage


def _finish_reason(has_calls: bool, last: StreamDelta) -> str:
    """OpenAI's: "tool_calls" when the turn ended with calls, "length" when it was cut."""
    return "tool_calls" if has_calls and last.finish_reason == "stop" else str(last.finish_reason)


def _delta_messages(pieces: list[Piece]) -> list[DeltaMessage]:
    out: list[DeltaMessage] = []
    for piece in pieces:
        if isinstance(piece, str):
            out.append(DeltaMessage(content=piece))
        elif isinstance(piece, CallStartEvent):
            out.append(DeltaMessage(tool_calls=[DeltaToolCall(
                index=piece.index, id=piece.id, type="function",
                function=DeltaFunctionCall(name=piece.name, arguments=""))]))
        else:
            out.append(DeltaMessage(tool_calls=[DeltaToolCall(
                index=piece.index, function=DeltaFunctionCall(arguments=piece.text))]))
    return out
