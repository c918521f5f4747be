"""Parse ``<tool_call>{json}</tool_call>`` blocks out of generated text, whole or streamed.

Invariant: for any text and any way of cutting it into chunks, the events of
``ToolCallStreamParser`` (content concatenated, tool calls in order) equal ``parse_tool_calls`` on
the whole text, ids aside. The rules both follow:

- A block is ``<tool_call>`` up to the first ``</tool_call>`` after it. It is a tool call when its
  inside is a JSON object with a string ``name`` and ``arguments`` (or Llama's ``parameters``)
  that is an object or a string holding one; otherwise the block stays in the content verbatim.
- Whitespace touching a tool call (the template's newlines around it) is not content.
- An unclosed block at the end is content.
- With ``allow_bare_json`` (tool_choice required or named), a whole output that is one such JSON
  object, without tags, is a tool call as well.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_CALL_KEYS = {"name", "arguments", "parameters"}
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


def new_tool_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments_json: str
    id: str = field(default_factory=new_tool_call_id)


@dataclass(frozen=True)
class ParsedOutput:
    content: str
    tool_calls: list[ParsedToolCall]


@dataclass(frozen=True)
class ContentEvent:
    text: str


@dataclass(frozen=True)
class ToolCallEvent:
    index: int
    tool_call: ParsedToolCall


StreamEvent = ContentEvent | ToolCallEvent


def parse_tool_call_json(text: str, bare: bool = False) -> ParsedToolCall | None:
    """The call that ``text`` spells as ``{"name": ..., "arguments": {...}}``, or None.

    A ``bare`` object (no tags around it) must hold nothing but those keys, so that an ordinary
    JSON answer is not mistaken for a call.
    """
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if bare and not (obj.keys() <= _CALL_KEYS and obj.keys() & {"arguments", "parameters"}):
        return None
    arguments = _arguments(obj.get("arguments", obj.get("parameters", {})))
    if arguments is None:
        return None
    return ParsedToolCall(
        name=obj["name"], arguments_json=json.dumps(arguments, ensure_ascii=False)
    )


def _arguments(value: Any) -> dict[str, Any] | None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return None
    return value if isinstance(value, dict) else None


def parse_tool_calls(text: str, allow_bare_json: bool = False) -> ParsedOutput:
    """Split generated ``text`` into content and tool calls. Never raises on model output."""
    pieces: list[str | ParsedToolCall] = []
    pos = 0
    for match in _BLOCK.finditer(text):
        call = parse_tool_call_json(match.group(1))
        if call is not None:
            pieces.extend([text[pos : match.start()], call])
            pos = match.end()
    pieces.append(text[pos:])
    calls = [p for p in pieces if isinstance(p, ParsedToolCall)]
    if not calls and allow_bare_json and text.lstrip().startswith("{"):
        bare = parse_tool_call_json(text, bare=True)
        if bare is not None:
            return ParsedOutput(content="", tool_calls=[bare])
    return ParsedOutput(content=_join_content(pieces), tool_calls=calls)


def _join_content(pieces: list[str | ParsedToolCall]) -> str:
    out: list[str] = []
    for i, piece in enumerate(pieces):
        if isinstance(piece, ParsedToolCall):
            continue
        if i > 0:
            piece = piece.lstrip()
        if i + 1 < len(pieces):
            piece = piece.rstrip()
        out.append(piece)
    return "".join(out)


def _partial_open_len(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


class ToolCallStreamParser:
    """Incremental ``parse_tool_calls``: content is released as soon as it cannot belong to a tool
    call; only a possible partial ``<tool_call>`` tag and trailing whitespace are held back."""

    def __init__(self, allow_bare_json: bool = False) -> None:
        self._buffer = ""  # text not yet classified
        self._held_ws = ""  # whitespace before an open block; dropped if the block is a call
        self._in_block = False
        self._after_call = False  # leading whitespace is dropped right after a tool call
        self._bare_pending = allow_bare_json  # output may still be one bare JSON object
        self._num_calls = 0

    def feed(self, delta_text: str) -> list[StreamEvent]:
        self._buffer += delta_text
        if self._bare_pending:
            head = self._buffer.lstrip()
            if not head or head.startswith("{"):
                return []
            self._bare_pending = False
        return self._drain()

    def finish(self) -> list[StreamEvent]:
        if self._bare_pending:
            return self._events_of(parse_tool_calls(self._buffer, allow_bare_json=True))
        events = self._drain()
        if self._in_block:
            text = self._held_ws + TOOL_CALL_OPEN + self._buffer
        else:
            text = self._buffer if not self._after_call else self._buffer.lstrip()
        self._buffer = ""
        return events + self._content(text)

    def _events_of(self, parsed: ParsedOutput) -> list[StreamEvent]:
        events = self._content(parsed.content)
        for call in parsed.tool_calls:
            events.append(ToolCallEvent(index=self._num_calls, tool_call=call))
            self._num_calls += 1
        self._buffer = ""
        return events

    def _drain(self) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        while True:
            step = self._block_step() if self._in_block else self._content_step()
            if step is None:
                return events
            events.extend(step)

    def _content_step(self) -> list[StreamEvent] | None:
        if self._after_call:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return None
        start = self._buffer.find(TOOL_CALL_OPEN)
        if start >= 0:
            before = self._buffer[:start]
            self._held_ws = before[len(before.rstrip()) :]
            self._buffer = self._buffer[start + len(TOOL_CALL_OPEN) :]
            self._in_block, self._after_call = True, False
            return self._content(before.rstrip())
        body = self._buffer[: len(self._buffer) - _partial_open_len(self._buffer)]
        ready = body.rstrip()
        if not ready:
            return None
        self._buffer = self._buffer[len(ready) :]
        self._after_call = False
        return self._content(ready)

    def _block_step(self) -> list[StreamEvent] | None:
        end = self._buffer.find(TOOL_CALL_CLOSE)
        if end < 0:
            return None
        inside = self._buffer[:end]
        self._buffer = self._buffer[end + len(TOOL_CALL_CLOSE) :]
        self._in_block = False
        call = parse_tool_call_json(inside)
        if call is None:
            return self._content(self._held_ws + TOOL_CALL_OPEN + inside + TOOL_CALL_CLOSE)
        self._held_ws, self._after_call = "", True
        self._num_calls += 1
        return [ToolCallEvent(index=self._num_calls - 1, tool_call=call)]

    @staticmethod
    def _content(text: str) -> list[StreamEvent]:
        return [ContentEvent(text)] if text else []
