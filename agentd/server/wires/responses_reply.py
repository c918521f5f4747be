"""The Responses API's replies: a whole ``Response``, or the semantic event stream the official
SDK parses (``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``/``.done``,
``response.function_call_arguments.delta``/``.done``, ``response.output_item.done``,
``response.completed``), each with its ``sequence_number``.

Invariants: the streamed and the whole reply of one generation hold the same output items (ids
aside); every item that is added is done before the response completes; text that is only
whitespace opens no message item; a failure mid-stream is an ``error`` event then
``response.failed``. The output's exact token ids are handed to ``on_stored`` with the finished
reply, for the response store.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import msgspec

from agentd.engine.outputs import StreamDelta
from agentd.server.errors import APIError
from agentd.server.wires.cache_control import cache_usage
from agentd.server.wires.reply_events import (
    CallArguments,
    CallStart,
    Event,
    Failed,
    Finished,
    Text,
    fold,
)
from agentd.server.wires.responses_plan import ResponsesJob
from agentd.server.wires.responses_tools import call_item, custom_input
from agentd.server.wires.responses_types import (
    CallItem,
    CustomToolCallItem,
    FunctionCallItem,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    Response,
    ResponseUsage,
)

# Called once per request: with the finished reply and its output token ids, or with None when
# the request ended without a reply to store (failed, or its client went away).
OnStored = Callable[[Response | None, list[int]], None]
_encoder = msgspec.json.Encoder()


def _item_id(prefix: str, source_id: str) -> str:
    """An item id from the call id or the response id it belongs to."""
    return prefix + "_" + source_id.split("_", 1)[-1]


def finished_response(job: ResponsesJob, output: list[OutputItem], last: StreamDelta,
                      calls: bool) -> Response:
    """The shell with its output, status and usage."""
    usage = cache_usage(last, job.plan)
    incomplete = last.finish_reason == "length" or (last.finish_reason == "abort")
    details = {"reason": "max_output_tokens" if last.finish_reason == "length" else "cancelled"}
    return msgspec.structs.replace(
        job.shell, output=output, status="incomplete" if incomplete and not calls else "completed",
        incomplete_details=details if incomplete and not calls else None,
        completed_at=job.shell.created_at,
        usage=ResponseUsage(
            input_tokens=last.num_prompt_tokens, output_tokens=last.num_output_tokens,
            total_tokens=last.num_prompt_tokens + last.num_output_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=usage.read,
                                                    cache_write_tokens=usage.creation)))


async def complete_response(job: ResponsesJob, events: AsyncIterator[Event],
                            on_stored: OnStored) -> Response:
    try:
        whole = await fold(events)
    except BaseException:  # failed or cancelled (the client went away)
        on_stored(None, [])
        raise
    finished = whole.finished
    assert finished is not None
    output: list[OutputItem] = []
    if whole.content and whole.content.strip():
        output.append(OutputMessage(id=_item_id("msg", job.plan.request_id),
                                    content=[OutputText(text=whole.content)]))
    output += [call_item(job.tools, _item_id("fc", c.id), c.id, c.name, c.arguments_json)
               for c in whole.calls]
    response = finished_response(job, output, finished.last, bool(whole.calls))
    on_stored(response, finished.token_ids)
    return response


@dataclass
class _Streamer:
    """Turns text and call pieces into events, tracking the open item."""

    job: ResponsesJob
    num_events: int = 0
    output: list[OutputItem] = field(default_factory=list)
    open_text: list[str] | None = None  # the open message's text so far
    message_id: str = ""
    open_call: FunctionCallItem | None = None  # streamed as function_call deltas
    custom_call: CustomToolCallItem | None = None  # its text is sent whole, once written
    custom_arguments: list[str] = field(default_factory=list)
    pending_space: str = ""

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.num_events, **fields}
        self.num_events += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encoder.encode(body) + b"\n\n"

    @property
    def index(self) -> int:
        return len(self.output)

    def text(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self.open_text is None:
            text, self.pending_space = self.pending_space + text, ""
            if not text.strip():
                self.pending_space = text
                return out
            out += self.close()
            self.open_text = []
            self.message_id = _item_id("msg", self.job.plan.request_id) + (
                f"_{self.index}" if self.index else "")
            item = OutputMessage(id=self.message_id, content=[], status="in_progress")
            out.append(self.event("response.output_item.added", output_index=self.index,
                                  item=item))
            out.append(self.event("response.content_part.added", item_id=item.id,
                                  output_index=self.index, content_index=0,
                                  part=OutputText(text="")))
        self.open_text.append(text)
        out.append(self.event("response.output_text.delta", item_id=self.message_id,
                              output_index=self.index, content_index=0, delta=text,
                              logprobs=[]))
        return out

    def call_start(self, piece: CallStart) -> list[bytes]:
        out = self.close()
        item = call_item(self.job.tools, _item_id("fc", piece.id), piece.id, piece.name, "",
                         "in_progress")
        if isinstance(item, CustomToolCallItem):
            self.custom_call, self.custom_arguments = item, []
        else:
            self.open_call = item
        out.append(self.event("response.output_item.added", output_index=self.index,
                              item=item))
        return out

    def call_arguments(self, text: str) -> list[bytes]:
        if self.custom_call is not None:
            self.custom_arguments.append(text)
            return []
        assert self.open_call is not None  # the parser starts a call before its arguments
        self.open_call.arguments += text
        return [self.event("response.function_call_arguments.delta", item_id=self.open_call.id,
                           output_index=self.index, delta=text)]

    def close_custom(self) -> list[bytes]:
        """A custom call's text, sent whole: the model wrote it as one JSON string."""
        call = self.custom_call
        assert call is not None
        call.input = custom_input("".join(self.custom_arguments))
        call.status = "completed"
        self.output.append(call)
        self.custom_call = None
        index = self.index - 1
        return [self.event("response.custom_tool_call_input.delta", item_id=call.id,
                           output_index=index, delta=call.input),
                self.event("response.custom_tool_call_input.done", item_id=call.id,
                           output_index=index, input=call.input),
                self.event("response.output_item.done", output_index=index, item=call)]

    def close(self) -> list[bytes]:
        """Finish the open item (message or call): its done events."""
        out: list[bytes] = []
        if self.open_text is not None:
            part = OutputText(text="".join(self.open_text))
            item = OutputMessage(id=self.message_id, content=[part])
            out.append(self.event("response.output_text.done", item_id=item.id,
                                  output_index=self.index, content_index=0, text=part.text,
                                  logprobs=[]))
            out.append(self.event("response.content_part.done", item_id=item.id,
                                  output_index=self.index, content_index=0, part=part))
            out.append(self.event("response.output_item.done", output_index=self.index,
                                  item=item))
            self.output.append(item)
            self.open_text = None
        if self.open_call is not None:
            call = self.open_call
            call.status = "completed"
            out.append(self.event("response.function_call_arguments.done", item_id=call.id,
                                  output_index=self.index, name=call.name,
                                  arguments=call.arguments))
            out.append(self.event("response.output_item.done", output_index=self.index,
                                  item=call))
            self.output.append(call)
            self.open_call = None
        if self.custom_call is not None:
            out += self.close_custom()
        return out

    def piece(self, piece: Event) -> list[bytes]:
        if isinstance(piece, Text):
            return self.text(piece.text)
        if isinstance(piece, CallStart):
            return self.call_start(piece)
        if isinstance(piece, CallArguments):
            return self.call_arguments(piece.text)
        return []  # Started: the shell was sent already


async def stream_response(job: ResponsesJob, events: AsyncIterator[Event],
                          on_stored: OnStored) -> AsyncIterator[bytes]:
    """The event stream of one submitted generation; closing it early aborts the request."""
    streamer = _Streamer(job)
    stored = False
    try:
        async with aclosing(events):  # type: ignore[type-var]
            yield streamer.event("response.created", response=job.shell)
            yield streamer.event("response.in_progress", response=job.shell)
            async for item in events:
                if isinstance(item, Finished):
                    for chunk in streamer.close():
                        yield chunk
                    calls = any(isinstance(i, CallItem) for i in streamer.output)
                    response = finished_response(job, streamer.output, item.last, calls)
                    on_stored(response, item.token_ids)
                    stored = True
                    yield streamer.event("response.completed" if response.status == "completed"
                                         else "response.incomplete", response=response)
                elif isinstance(item, Failed):
                    for chunk in [*(streamer.close() if item.complete else []),
                                  *_failed(streamer, job, item.error)]:
                        yield chunk
                else:
                    for chunk in streamer.piece(item):
                        yield chunk
    finally:
        if not stored:
            on_stored(None, [])


def _failed(events: _Streamer, job: ResponsesJob, error: APIError) -> list[bytes]:
    failed = msgspec.structs.replace(job.shell, status="failed", output=events.output,
                                     error={"code": error.code or "server_error",
                                            "message": error.message})
    return [events.event("error", code=error.code, message=error.message, param=error.param),
            events.event("response.failed", response=failed)]
