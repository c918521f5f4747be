"""Turn generated text into content and tool calls, whole or piece by piece, for one request.

Invariant: for the same generated text, ``whole`` and the concatenation of ``feed``/``finish``
give the same content and the same calls (ids aside). With tools on, the output is constrained
by a grammar (``agentd.structured``), so every call opens with the canonical header and its
arguments are JSON valid against the function's schema; its id and name are released as soon as
the header is complete, its arguments as they are generated (as OpenAI streams them).
"""

from __future__ import annotations

import enum

from agentd.tool_parser import (
    CallArgumentsEvent,
    CallStartEvent,
    ContentEvent,
    ParsedOutput,
    StreamEvent,
    ToolCallStreamParser,
    assemble,
)


class ToolMode(enum.Enum):
    OFF = "off"  # no tools, or tool_choice "none": the text is all content
    PARSE = "parse"  # tools offered: <tool_call> blocks become calls, streamed as they come


Piece = str | CallStartEvent | CallArgumentsEvent


class ToolCallAssembler:
    """One request's view of its output: content strings and numbered tool calls."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.num_calls = 0
        self._parser = ToolCallStreamParser() if mode is ToolMode.PARSE else None

    def whole(self, text: str) -> ParsedOutput:
        """Content and calls of a complete generation."""
        events = self._events(text) + self._finish_events()
        parsed = assemble(events)
        self.num_calls = len(parsed.tool_calls)
        return parsed

    def feed(self, text: str) -> list[Piece]:
        """What can be released after ``text`` arrives."""
        return self._pieces(self._events(text))

    def finish(self) -> list[Piece]:
        """Whatever was held back, once the generation has ended."""
        return self._pieces(self._finish_events())

    def _events(self, text: str) -> list[StreamEvent]:
        if self._parser is None:
            return [ContentEvent(text)] if text else []
        return self._parser.feed(text)

    def _finish_events(self) -> list[StreamEvent]:
        return [] if self._parser is None else self._parser.finish()

    def _pieces(self, events: list[StreamEvent]) -> list[Piece]:
        pieces: list[Piece] = []
        for event in events:
            if isinstance(event, ContentEvent):
                pieces.append(event.text)
                continue
            if isinstance(event, CallStartEvent):
                self.num_calls = event.index + 1
            pieces.append(event)
        return pieces
