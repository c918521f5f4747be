"""The Anthropic Messages API's replies: a whole ``message``, or Anthropic's event stream
(``message_start``, ``ping``, ``content_block_start``, ``content_block_delta`` with
``text_delta`` / ``input_json_delta``, ``content_block_stop``, ``message_delta``,
``message_stop``).

Invariants: the streamed and the whole reply of one generation hold the same content blocks
(ids aside): text, then ``tool_use`` blocks whose ``input`` is the call's arguments; text that
is only whitespace makes no block; every block started is stopped before ``message_delta``; the
``stop_reason`` is ``tool_use`` when the turn ended with calls, ``max_tokens`` when cut,
``stop_sequence`` (naming it) when a stop sequence ended it, else ``end_turn``; usage counts
``input_tokens`` as the prompt tokens neither read from nor written to the cache. A failure
mid-stream is an ``error`` event. The streamed reply encodes the plan's event stream
(:mod:`agentd.server.wires.reply_events`) and the whole one folds it. Errors on this wire,
mid-stream or not, are in Anthropic's shape (``agentd.server.errors.anthropic_error_body``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import msgspec

from agentd.engine.outputs import StreamDelta
from agentd.server.errors import anthropic_error_body
from agentd.server.wires.cache_control import cache_usage
from agentd.server.wires.messages_plan import MessagesJob
from agentd.server.wires.reply_events import (
    CallArguments,
    CallStart,
    Event,
    Failed,
    Finished,
    Started,
    Text,
    fold,
)

_encoder = msgspec.json.Encoder()


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def usage(job: MessagesJob, last: StreamDelta, output_tokens: int | None = None
          ) -> dict[str, int]:
    cache = cache_usage(last, job.plan)
    return {"input_tokens": last.num_prompt_tokens - cache.read - cache.creation,
            "cache_creation_input_tokens": cache.creation,
            "cache_read_input_tokens": cache.read,
            "output_tokens": last.num_output_tokens if output_tokens is None else output_tokens}


def stop(job: MessagesJob, calls: bool, last: StreamDelta) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)``."""
    if calls and last.finish_reason == "stop":
        return "tool_use", None
    if last.finish_reason == "length":
        return "max_tokens", None
    if isinstance(last.stop_reason, str) and last.stop_reason in job.stop_sequences:
        return "stop_sequence", last.stop_reason
    return "end_turn", None


def message(job: MessagesJob, content: list[dict[str, Any]], stop_reason: str | None,
            stop_sequence: str | None, usage_: dict[str, int]) -> dict[str, Any]:
    return {"id": job.plan.request_id, "type": "message", "role": "assistant",
            "model": job.plan.model, "content": content, "stop_reason": stop_reason,
            "stop_sequence": stop_sequence, "usage": usage_}


def prewarmed(job: MessagesJob, last: StreamDelta) -> dict[str, Any]:
    """The reply to ``max_tokens: 0``: no content, what the cache read and now holds."""
    return message(job, [], "max_tokens", None, usage(job, last, output_tokens=0))


async def complete_message(job: MessagesJob, events: AsyncIterator[Event]) -> dict[str, Any]:
    whole = await fold(events)
    finished = whole.finished
    assert finished is not None
    content: list[dict[str, Any]] = []
    if whole.content and whole.content.strip():
        content.append({"type": "text", "text": whole.content})
    content += [{"type": "tool_use", "id": tool_use_id(c.id), "name": c.name,
                 "input": json.loads(c.arguments_json or "{}")} for c in whole.calls]
    stop_reason, stop_sequence = stop(job, bool(whole.calls), finished.last)
    return message(job, content, stop_reason, stop_sequence, usage(job, finished.last))


def event(kind: str, **fields: Any) -> bytes:
    return (b"event: " + kind.encode() + b"\ndata: " +
            _encoder.encode({"type": kind, **fields}) + b"\n\n")


@dataclass
class _Blocks:
    """Content blocks as they stream: the open one, and how many there were."""

    num_blocks: int = 0
    open_kind: str | None = None
    pending_space: str = ""
    num_calls: int = 0
    out: list[bytes] = field(default_factory=list)

    def close(self) -> list[bytes]:
        if self.open_kind is not None:
            self.out.append(event("content_block_stop", index=self.num_blocks - 1))
            self.open_kind = None
        return self.flush()

    def open(self, block: dict[str, Any]) -> None:
        self.close()
        self.out.append(event("content_block_start", index=self.num_blocks,
                              content_block=block))
        self.open_kind = block["type"]
        self.num_blocks += 1

    def text(self, text: str) -> None:
        if self.open_kind != "text":
            text, self.pending_space = self.pending_space + text, ""
            if not text.strip():
                self.pending_space = text
                return
            self.open({"type": "text", "text": ""})
        self.out.append(event("content_block_delta", index=self.num_blocks - 1,
                              delta={"type": "text_delta", "text": text}))

    def feed(self, piece: Event) -> list[bytes]:
        if isinstance(piece, Text):
            self.text(piece.text)
        elif isinstance(piece, CallStart):
            self.num_calls += 1
            self.open({"type": "tool_use", "id": tool_use_id(piece.id), "name": piece.name,
                       "input": {}})
        elif isinstance(piece, CallArguments):
            self.out.append(event("content_block_delta", index=self.num_blocks - 1,
                                  delta={"type": "input_json_delta",
                                         "partial_json": piece.text}))
        return self.flush()

    def flush(self) -> list[bytes]:
        out, self.out = self.out, []
        return out


async def stream_message(job: MessagesJob, events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    """The event stream of one submitted generation; closing it early aborts the request.
    ``message_start`` waits for the first delta, so its usage says what the cache served."""
    blocks = _Blocks()
    async with aclosing(events):  # type: ignore[type-var]
        async for item in events:
            if isinstance(item, Started):
                yield event("message_start", message=message(
                    job, [], None, None, usage(job, item.first, output_tokens=0)))
                yield event("ping")
            elif isinstance(item, Finished):
                for chunk in blocks.close():
                    yield chunk
                stop_reason, stop_sequence = stop(job, blocks.num_calls > 0, item.last)
                yield event("message_delta", delta={"stop_reason": stop_reason,
                                                    "stop_sequence": stop_sequence},
                            usage=usage(job, item.last))
                yield event("message_stop")
            elif isinstance(item, Failed):
                for chunk in blocks.close() if item.complete else []:
                    yield chunk
                yield event("error", error=anthropic_error_body(item.error)["error"])
            else:
                for chunk in blocks.feed(item):
                    yield chunk
