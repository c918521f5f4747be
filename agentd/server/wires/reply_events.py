"""One internal event stream for every wire's reply: what the engine generated for one plan, as
text, tool-call starts and arguments, then how it finished or failed.

``events`` reads a submitted request's deltas through the plan's tool-call parsing and yields
``Started`` (the first delta, for wires whose first event reports the cache), ``Text``,
``CallStart`` and ``CallArguments`` pieces as soon as they can be released, then exactly one of
``Finished`` and ``Failed``. A wire's streamed reply is a pure encoder of these events and its
whole reply a ``fold`` of the same events, so the two hold the same content and calls by
construction.

Invariants: the request's stream is closed when the events end or are closed early (which
aborts an unfinished request); the finish is recorded (``on_finish``) once, before ``Finished``;
``Failed.complete`` says whether the output had reached its end (the engine failed the request:
what was generated is all there) or the stream broke off.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from agentd.engine.outputs import StreamDelta
from agentd.engine.request_stream import RequestStream
from agentd.server.errors import APIError
from agentd.server.wires.serving import delta_error, exception_error
from agentd.server.wires.tool_calls import Piece, ToolCallAssembler, ToolMode
from agentd.tool_parser import CallArgumentsEvent as CallArguments
from agentd.tool_parser import CallStartEvent as CallStart
from agentd.tool_parser import ContentEvent as Text
from agentd.tool_parser import ParsedToolCall

OnFinish = Callable[[StreamDelta, str], None]  # (last delta, finish reason): metrics, key stats


@dataclass(frozen=True)
class Started:
    first: StreamDelta  # what the cache served is known from the first delta on


@dataclass(frozen=True)
class Finished:
    last: StreamDelta
    finish_reason: str  # "tool_calls" when the turn ended with calls, else the engine's
    num_calls: int
    token_ids: list[int]  # every output token id, as the engine produced them


@dataclass(frozen=True)
class Failed:
    error: APIError
    complete: bool  # the output reached its end first (open blocks are closed before it)


# Text, CallStart and CallArguments are agentd.tool_parser's events, as the parser releases them.
Event = Started | Text | CallStart | CallArguments | Finished | Failed


def finish_reason(num_calls: int, last: StreamDelta) -> str:
    """OpenAI's: "tool_calls" when the turn ended with calls, "length" when it was cut."""
    return "tool_calls" if num_calls and last.finish_reason == "stop" else str(last.finish_reason)


async def events(deltas: RequestStream, tool_mode: ToolMode,
                 on_finish: OnFinish) -> AsyncIterator[Event]:
    """The events of one submitted generation (module docstring)."""
    assembler = ToolCallAssembler(tool_mode)
    token_ids: list[int] = []
    last: StreamDelta | None = None
    try:
        async for delta in deltas:
            if last is None:
                yield Started(delta)
            last = delta
            token_ids += delta.token_ids
            for piece in assembler.feed(delta.text):
                yield _event(piece)
        for piece in assembler.finish():
            yield _event(piece)
        assert last is not None  # the engine always ends a stream with a finished delta
        if last.error is not None:
            yield Failed(delta_error(last), complete=True)
            return
        reason = finish_reason(assembler.num_calls, last)
        on_finish(last, reason)
        yield Finished(last, reason, assembler.num_calls, token_ids)
    except (ValueError, RuntimeError) as exc:
        yield Failed(exception_error(exc), complete=False)
    finally:
        await deltas.aclose()  # aborts it if unfinished


def _event(piece: Piece) -> Event:
    """The tool-call parser's pieces are the stream's: text, a call's start, its arguments."""
    return Text(piece) if isinstance(piece, str) else piece


@dataclass
class Whole:
    """A finished generation folded whole: its content, its calls, and how it finished."""

    content: str = ""
    calls: list[ParsedToolCall] = field(default_factory=list)
    finished: Finished | None = None
    first: StreamDelta | None = None


async def fold(stream: AsyncIterator[Event]) -> Whole:
    """Read the events to their end; raises the ``Failed`` event's error."""
    whole = Whole()
    pieces: list[str] = []
    arguments: dict[int, list[str]] = {}
    async with aclosing(stream):  # type: ignore[type-var]
        async for event in stream:
            if isinstance(event, Text):
                pieces.append(event.text)
            elif isinstance(event, CallStart):
                whole.calls.append(ParsedToolCall(event.name, "", event.id))
                arguments[event.index] = []
            elif isinstance(event, CallArguments):
                arguments[event.index].append(event.text)
            elif isinstance(event, Started):
                whole.first = event.first
            elif isinstance(event, Failed):
                raise event.error
            else:
                whole.finished = event
    whole.content = "".join(pieces)
    whole.calls = [ParsedToolCall(c.name, "".join(arguments[i]), c.id)
                   for i, c in enumerate(whole.calls)]
    assert whole.finished is not None  # the events always end with Finished or Failed
    return whole
