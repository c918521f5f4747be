"""Turn generated text into content and tool calls, whole or piece by piece, for one request.

Invariant: for the same generated text, ``whole`` and the concatenation of ``feed``/``finish``
give the same content and the same calls (ids aside). In FORCED mode the text the server seeded
the assistant turn with (see ``agentd.server.serving_chat``) is parsed as if the model had
written it, and a call the model completed but did not close (it stopped right after the JSON)
is still a call.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from agentd.tool_parser import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ContentEvent,
    ParsedOutput,
    ParsedToolCall,
    ToolCallStreamParser,
    parse_tool_calls,
)


class ToolMode(enum.Enum):
    OFF = "off"  # no tools, or tool_choice "none": the text is all content
    PARSE = "parse"  # tools offered: <tool_call> blocks become calls, streamed as they close
    FORCED = "forced"  # the assistant turn was seeded with the opening of a call


def forced_call_prefix(required: bool, function_name: str | None) -> str:
    """The opening of a call to seed the assistant turn with, or "" when no call is forced."""
    if function_name is not None:
        # validated names are [A-Za-z0-9_-]{1,64}: nothing to escape inside the JSON string
        return f'{TOOL_CALL_OPEN}\n{{"name": "{function_name}", "arguments": '
    if required:
        return f'{TOOL_CALL_OPEN}\n{{"name": "'
    return ""


@dataclass(frozen=True)
class CallPiece:
    index: int
    call: ParsedToolCall


def parse_forced(text: str) -> ParsedOutput:
    """``parse_tool_calls`` for a seeded call, accepting a last block the model left unclosed."""
    parsed = parse_tool_calls(text, allow_bare_json=True)
    if parsed.tool_calls:
        return parsed
    start = text.rfind(TOOL_CALL_OPEN)
    if start >= 0 and TOOL_CALL_CLOSE not in text[start:]:
        closed = parse_tool_calls(text.rstrip() + "\n" + TOOL_CALL_CLOSE)
        if closed.tool_calls:
            return closed
    return parsed


class ToolCallAssembler:
    """One request's view of its output: content strings and numbered tool calls."""

    def __init__(self, mode: ToolMode, forced_prefix: str = "") -> None:
        self.mode = mode
        self.forced_prefix = forced_prefix
        self.num_calls = 0
        self._parser = ToolCallStreamParser() if mode is ToolMode.PARSE else None
        self._forced_text: list[str] = []

    def whole(self, text: str) -> ParsedOutput:
        """Content and calls of a complete generation."""
        if self.mode is ToolMode.OFF:
            return ParsedOutput(content=text, tool_calls=[])
        if self.mode is ToolMode.FORCED:
            parsed = parse_forced(self.forced_prefix + text)
        else:
            parsed = parse_tool_calls(text)
        self.num_calls = len(parsed.tool_calls)
        return parsed

    def feed(self, text: str) -> list[str | CallPiece]:
        """What can be released after ``text`` arrives (a forced call waits for the end)."""
        if self.mode is ToolMode.OFF:
            return [text] if text else []
        if self._parser is None:
            self._forced_text.append(text)
            return []
        return self._pieces(self._parser.feed(text))

    def finish(self) -> list[str | CallPiece]:
        """Whatever was held back, once the generation has ended."""
        if self.mode is ToolMode.OFF:
            return []
        if self._parser is not None:
            return self._pieces(self._parser.finish())
        parsed = self.whole("".join(self._forced_text))
        pieces: list[str | CallPiece] = [parsed.content] if parsed.content else []
        return pieces + [CallPiece(i, call) for i, call in enumerate(parsed.tool_calls)]

    def _pieces(self, events: list) -> list[str | CallPiece]:
        pieces: list[str | CallPiece] = []
        for event in events:
            if isinstance(event, ContentEvent):
                pieces.append(event.text)
            else:
                pieces.append(CallPiece(event.index, event.tool_call))
                self.num_calls = event.index + 1
        return pieces
