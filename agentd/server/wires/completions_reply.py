"""The text completions wire's replies: the event stream folded into one ``Completion``, or
encoded as SSE chunks (``echo`` puts the prompt's text first in either).

Invariant: the whole reply is a fold of the streamed events.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from agentd.server.wires.chat_reply import openai_usage, sse_error
from agentd.server.wires.completions_plan import CompletionJob
from agentd.server.wires.completions_types import Completion, CompletionChoice, CompletionChunk
from agentd.server.wires.reply_events import Event, Failed, Finished, Text, fold
from agentd.server.wires.serving import SSE_DONE, sse


async def complete_text(job: CompletionJob, events: AsyncIterator[Event]) -> Completion:
    whole = await fold(events)
    finished = whole.finished
    assert finished is not None
    plan = job.plan
    choice = CompletionChoice(index=0, text=job.echo_text + whole.content,
                              finish_reason=finished.finish_reason)
    return Completion(id=plan.request_id, created=plan.created, model=plan.model,
                      choices=[choice], usage=openai_usage(plan, finished.last))


async def stream_text(job: CompletionJob, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    """SSE chunks for one submitted generation. Closing this generator early aborts the
    request; so does dropping it unstarted (``RequestStream`` aborts when garbage-collected).
    """
    plan = job.plan

    def chunk(text: str, finish_reason: str | None = None) -> bytes:
        choice = CompletionChoice(index=0, text=text, finish_reason=finish_reason)
        return sse(CompletionChunk(id=plan.request_id, created=plan.created, model=plan.model,
                                   choices=[choice]))

    async with aclosing(events):  # type: ignore[type-var]
        if job.echo_text:
            yield chunk(job.echo_text)
        async for event in events:
            if isinstance(event, Text):
                yield chunk(event.text)
            elif isinstance(event, Failed):
                yield sse_error(event.error)
            elif isinstance(event, Finished):
                yield chunk("", event.finish_reason)
                if plan.include_usage:
                    yield sse(CompletionChunk(id=plan.request_id, created=plan.created,
                                              model=plan.model, choices=[],
                                              usage=openai_usage(plan, event.last)))
    yield SSE_DONE
