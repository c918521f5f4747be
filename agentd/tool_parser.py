"""Parse ``<tool_call>{json}</tool_call>`` blocks out of generated text, whole or streamed.

Invariant: ``parse_tool_calls(text)`` is ``ToolCallStreamParser`` fed ``text`` at once, and for
any way of cutting ``text`` into chunks the parser's events add up to the same content and the
same calls (ids aside). The rules:

- A block opening with the canonical header ``{"name": "NAME", "arguments": {`` (the layout
  constrained decoding forces, whitespace before it allowed) is a call from that point on: its id
  and name are released at once and its arguments stream as the model writes them, up to the end
  of that JSON object. Generation cut short inside the arguments leaves the call with partial
  arguments (the reply's ``finish_reason`` says it was cut).
- Any other block is ``<tool_call>`` up to the first ``</tool_call>`` after it; it is a call when
  its inside is a JSON object with a string ``name`` and ``arguments`` (or Llama's
  ``parameters``) that is an object or a string holding one; otherwise it stays in the content
  verbatim. Unclosed, it is content.
- Whitespace touching a tool call (the template's newlines around it) is not content.
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
_HEADER_START = '{"name": "'
_ARGUMENT_KEYS = ('", "arguments": ', '", "parameters": ')
_NAME = re.compile(r"[A-Za-z0-9_.-]*")


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
class CallStartEvent:
    """A call begins: its index in the turn, its id and its function name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArgumentsEvent:
    """More of call ``index``'s arguments JSON."""

    index: int
    text: str


StreamEvent = ContentEvent | CallStartEvent | CallArgumentsEvent


def parse_tool_call_json(text: str) -> ParsedToolCall | None:
    """The call that ``text`` spells as ``{"name": ..., "arguments": {...}}``, or None."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
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


def parse_tool_calls(text: str) -> ParsedOutput:
    """Split generated ``text`` into content and tool calls. Never raises on model output."""
    parser = ToolCallStreamParser()
    return assemble(parser.feed(text) + parser.finish())


def assemble(events: list[StreamEvent]) -> ParsedOutput:
    """Content and calls from a turn's events."""
    content: list[str] = []
    calls: dict[int, list[str]] = {}  # index -> [id, name, arguments...]
    for event in events:
        if isinstance(event, ContentEvent):
            content.append(event.text)
        elif isinstance(event, CallStartEvent):
            calls[event.index] = [event.id, event.name]
        else:
            calls[event.index].append(event.text)
    return ParsedOutput(
        content="".join(content),
        tool_calls=[ParsedToolCall(name=parts[1], arguments_json="".join(parts[2:]),
                                   id=parts[0]) for _, parts in sorted(calls.items())],
    )


def _partial_open_len(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


class _JsonObjectEnd:
    """Finds where a JSON object that starts with ``{`` ends, fed piece by piece."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def scan(self, text: str) -> int | None:
        """How much of ``text`` belongs to the object, when it ends in ``text``; else None."""
        for i, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


class ToolCallStreamParser:
    """Incremental tool-call parsing: content is released as soon as it cannot belong to a call;
    only a possible partial ``<tool_call>`` tag, trailing whitespace and an undecided block
    header are held back."""

    def __init__(self) -> None:
        self._buffer = ""  # text not yet classified
        self._held_ws = ""  # whitespace before an open block; dropped if the block is a call
        self._state = "content"  # content | header | arguments | closing | block
        self._after_call = False  # leading whitespace is dropped right after a tool call
        self._num_calls = 0
        self._object_end = _JsonObjectEnd()

    def feed(self, delta_text: str) -> list[StreamEvent]:
        self._buffer += delta_text
        events: list[StreamEvent] = []
        while (step := getattr(self, f"_{self._state}_step")()) is not None:
            events.extend(step)
        return events

    def finish(self) -> list[StreamEvent]:
        events = self.feed("")
        text, self._buffer = self._buffer, ""
        if self._state in ("header", "block"):  # an unclosed block is content
            events += self._content(self._held_ws + TOOL_CALL_OPEN + text)
        elif self._state == "content":
            events += self._content(text.lstrip() if self._after_call else text)
        self._state = "content"
        return events

    def _content_step(self) -> list[StreamEvent] | None:
        if self._after_call:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return None
        start = self._buffer.find(TOOL_CALL_OPEN)
        if start >= 0:
            before = self._buffer[:start]
            self._held_ws = before[len(before.rstrip()):]
            self._buffer = self._buffer[start + len(TOOL_CALL_OPEN):]
            self._state, self._after_call = "header", False
            return self._content(before.rstrip())
        body = self._buffer[: len(self._buffer) - _partial_open_len(self._buffer)]
        ready = body.rstrip()
        if not ready:
            return None
        self._buffer = self._buffer[len(ready):]
        self._after_call = False
        return self._content(ready)

    def _header_step(self) -> list[StreamEvent] | None:
        """Decide whether the block opens with the canonical header (then the call starts now)
        or not (then it is parsed whole once it closes)."""
        text = self._buffer.lstrip()
        if not text or _HEADER_START.startswith(text):
            return None
        name_and_rest = text[len(_HEADER_START):] if text.startswith(_HEADER_START) else None
        if name_and_rest is None:
            self._state = "block"
            return []
        name = _NAME.match(name_and_rest).group()  # type: ignore[union-attr]
        rest = name_and_rest[len(name):]
        if any(key.startswith(rest) for key in _ARGUMENT_KEYS):
            return None  # undecided yet ("" included)
        key = next((k for k in _ARGUMENT_KEYS if rest.startswith(k)), None)
        if key is None or not name or rest[len(key)] != "{":
            self._state = "block"
            return []
        self._buffer = rest[len(key):]
        self._state, self._held_ws = "arguments", ""
        self._object_end = _JsonObjectEnd()
        self._num_calls += 1
        return [CallStartEvent(self._num_calls - 1, new_tool_call_id(), name)]

    def _arguments_step(self) -> list[StreamEvent] | None:
        if not self._buffer:
            return None
        end = self._object_end.scan(self._buffer)
        piece = self._buffer if end is None else self._buffer[:end]
        self._buffer = "" if end is None else self._buffer[end:]
        if end is not None:
            self._state = "closing"
        return [CallArgumentsEvent(self._num_calls - 1, piece)]

    def _closing_step(self) -> list[StreamEvent] | None:
        """After a call's arguments: skip its closing brace and tag."""
        end = self._buffer.find(TOOL_CALL_CLOSE)
        if end < 0:
            return None
        self._buffer = self._buffer[end + len(TOOL_CALL_CLOSE):]
        self._state, self._after_call = "content", True
        return []

    def _block_step(self) -> list[StreamEvent] | None:
        end = self._buffer.find(TOOL_CALL_CLOSE)
        if end < 0:
            return None
        inside = self._buffer[:end]
        self._buffer = self._buffer[end + len(TOOL_CALL_CLOSE):]
        self._state = "content"
        call = parse_tool_call_json(inside)
        if call is None:
            return self._content(self._held_ws + TOOL_CALL_OPEN + inside + TOOL_CALL_CLOSE)
        self._held_ws, self._after_call = "", True
        self._num_calls += 1
        index = self._num_calls - 1
        return [CallStartEvent(index, call.id, call.name),
                CallArgumentsEvent(index, call.arguments_json)]

    @staticmethod
    def _content(text: str) -> list[StreamEvent]:
        return [ContentEvent(text)] if text else []
