"""The OpenAI Chat Completions wire's replies: one ``ChatCompletion``, or a stream of chunks shaped
exactly like OpenAI's, both from the plan's event stream (:mod:`agentd.server.wires.reply_events`).

Invariants: a stream is a role chunk, content (or tool-call) chunks, one chunk with the
``finish_reason``, an optional usage chunk, then ``[DONE]``; a failure is an error chunk then
``[DONE]``; the whole reply is a fold of the same events, so both carry the same content and tool
calls. The usage reports ``cache_write_tokens`` only for a request that asked to retain. Also
the helpers the text completions' replies share (usage, error chunks).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from agentd.engine.outputs import StreamDelta
from agentd.server.errors import APIError, openai_error_body
from agentd.server.wires.cache_control import cache_usage
from agentd.server.wires.chat_types import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from agentd.server.wires.openai_types import Usage
from agentd.server.wires.plan import Plan
from agentd.server.wires.reply_events import (
    CallArguments,
    CallStart,
    Event,
    Failed,
    Finished,
    Text,
    fold,
)
from agentd.server.wires.serving import SSE_DONE, sse


async def complete_chat(plan: Plan, events: AsyncIterator[Event]) -> ChatCompletion:
    """The whole generation as one ``ChatCompletion``."""
    whole = await fold(events)
    finished = whole.finished
    assert finished is not None
    content, calls = whole.content, whole.calls
    message = ChatCompletionMessage(content=content if content or not calls else None)
    if calls:
        message.tool_calls = [ToolCall(id=c.id, function=FunctionCall(
            name=c.name, arguments=c.arguments_json)) for c in calls]
    return ChatCompletion(
        id=plan.request_id, created=plan.created, model=plan.model,
        choices=[ChatCompletionChoice(index=0, message=message,
                                      finish_reason=finished.finish_reason)],
        usage=openai_usage(plan, finished.last),
    )


async def stream_chat(plan: Plan, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    """SSE chunks for one submitted generation. Closing this generator early aborts the
    request; so does dropping it unstarted (``RequestStream`` aborts when garbage-collected).
    """

    def chunk(delta: DeltaMessage, finish_reason: str | None = None) -> bytes:
        choice = ChatCompletionChunkChoice(index=0, delta=delta, finish_reason=finish_reason)
        return sse(ChatCompletionChunk(id=plan.request_id, created=plan.created,
                                       model=plan.model, choices=[choice]))

    async with aclosing(events):  # type: ignore[type-var]
        yield chunk(DeltaMessage(role="assistant", content=""))
        async for event in events:
            if isinstance(event, Failed):
                yield sse_error(event.error)
            elif isinstance(event, Finished):
                yield chunk(DeltaMessage(), event.finish_reason)
                if plan.include_usage:
                    yield sse(ChatCompletionChunk(id=plan.request_id, created=plan.created,
                                                  model=plan.model, choices=[],
                                                  usage=openai_usage(plan, event.last)))
            elif (message := _delta_message(event)) is not None:
                yield chunk(message)
    yield SSE_DONE


def _delta_message(event: Event) -> DeltaMessage | None:
    if isinstance(event, Text):
        return DeltaMessage(content=event.text)
    if isinstance(event, CallStart):
        return DeltaMessage(tool_calls=[DeltaToolCall(
            index=event.index, id=event.id, type="function",
            function=DeltaFunctionCall(name=event.name, arguments=""))])
    if isinstance(event, CallArguments):
        return DeltaMessage(tool_calls=[DeltaToolCall(
            index=event.index, function=DeltaFunctionCall(arguments=event.text))])
    return None  # Started: nothing to say yet


def openai_usage(plan: Plan, last: StreamDelta) -> Usage:
    """OpenAI's usage; ``cache_write_tokens`` only for a request that asked to retain."""
    usage = Usage.build(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)
    if plan.retention is not None:
        usage.prompt_tokens_details.cache_write_tokens = cache_usage(last, plan).creation
    return usage


def sse_error(error: APIError) -> bytes:
    """A failure inside a 200 stream, as OpenAI's SDKs read it: the error envelope."""
    return sse(openai_error_body(error))
