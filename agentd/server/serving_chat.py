"""Chat completions: a validated request becomes prompt token ids, and the engine's deltas become
one ``ChatCompletion`` or a stream of chunks shaped exactly like OpenAI's.

Invariants: a stream is a role chunk, content (or tool-call) chunks, one chunk with the
``finish_reason``, an optional usage chunk, then ``[DONE]``; the streamed and the non-streamed
reply of the same generation carry the same content and tool calls.

Forced tool calls. A template without tools support gets agentd's own tools block, and small
models seldom open a ``<tool_call>`` on their own even when told to. When ``tool_choice`` is
"required" or names a function, the assistant turn is seeded with the opening of a call —
``<tool_call>\\n{"name": "`` (plus the name and ``", "arguments": `` when named) — appended to
the prompt after the generation prompt, and the same text is put back in front of the
generated text before parsing. This is the usual forced-prefix (constrained-opening) technique:
the model only has to complete a JSON object it has already started.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from agentd.async_engine import AsyncEngine, RequestStream
from agentd.chat import forced_function_name, render_chat, template_supports_tools
from agentd.outputs import StreamDelta
from agentd.sampling_params import SamplingParams
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
    to_sampling_params,
    to_template_inputs,
    validate_chat_request,
    validate_prompt_len,
)
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
from agentd.server.tool_calls import CallPiece, ToolCallAssembler, ToolMode, forced_call_prefix

OnFinish = Callable[[StreamDelta, str], None]


@dataclass(frozen=True)
class ChatPlan:
    """Everything needed to run one chat request and shape its reply."""

    request_id: str
    model: str
    created: int
    prompt_token_ids: list[int]
    params: SamplingParams
    tool_mode: ToolMode
    forced_prefix: str
    include_usage: bool
    cache_salt: str | None


def plan_chat(req: ChatCompletionRequest, engine: AsyncEngine, model: str,
              created: int) -> ChatPlan:
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
    mode = ToolMode.OFF
    prefix = ""
    if tools_on:
        mode = ToolMode.PARSE
        if not template_supports_tools(tokenizer):
            prefix = forced_call_prefix(inputs.tool_choice == "required",
                                        forced_function_name(inputs.tool_choice))
            mode = ToolMode.FORCED if prefix else ToolMode.PARSE
    prompt_token_ids = list(rendered.prompt_token_ids)
    if prefix:
        prompt_token_ids += tokenizer(prefix, add_special_tokens=False).input_ids
    try:
        params = to_sampling_params(req, None)
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
    validate_prompt_len(len(prompt_token_ids), params.max_tokens, engine.max_model_len)
    return ChatPlan(
        request_id=new_request_id("chatcmpl"), model=model, created=created,
        prompt_token_ids=prompt_token_ids, params=params, tool_mode=mode, forced_prefix=prefix,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        cache_salt=req.cache_salt,
    )


async def complete_chat(plan: ChatPlan, deltas: AsyncIterator[StreamDelta],
                        on_finish: OnFinish) -> ChatCompletion:
    """Collect the whole generation into one ``ChatCompletion``."""
    got = await collect(deltas)
    assembler = ToolCallAssembler(plan.tool_mode, plan.forced_prefix)
    parsed = assembler.whole(got.text)
    content, calls = parsed.content, parsed.tool_calls
    finish_reason = "tool_calls" if calls else str(got.last.finish_reason)
    message = ChatCompletionMessage(content=content if content or not calls else None)
    if calls:
        message.tool_calls = [ToolCall(id=c.id, function=FunctionCall(
            name=c.name, arguments=c.arguments_json)) for c in calls]
    on_finish(got.last, finish_reason)
    return ChatCompletion(
        id=plan.request_id, created=plan.created, model=plan.model,
        choices=[ChatCompletionChoice(index=0, message=message, finish_reason=finish_reason)],
        usage=usage_of(got.last),
    )


async def stream_chat(plan: ChatPlan, deltas: RequestStream,
                      on_finish: OnFinish) -> AsyncIterator[bytes]:
    """SSE chunks for one submitted generation. Closing this generator early aborts the
    request; so does dropping it unstarted (``RequestStream`` aborts when garbage-collected).
    """

    def chunk(delta: DeltaMessage, finish_reason: str | None = None) -> bytes:
        choice = ChatCompletionChunkChoice(index=0, delta=delta, finish_reason=finish_reason)
        return sse(ChatCompletionChunk(id=plan.request_id, created=plan.created,
                                       model=plan.model, choices=[choice]))

    assembler = ToolCallAssembler(plan.tool_mode, plan.forced_prefix)
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
            finish_reason = "tool_calls" if assembler.num_calls else str(last.finish_reason)
            yield chunk(DeltaMessage(), finish_reason)
            if plan.include_usage:
                yield sse(ChatCompletionChunk(id=plan.request_id, created=plan.created,
                                              model=plan.model, choices=[],
                                              usage=usage_of(last)))
            on_finish(last, finish_reason)
    except APIError as exc:
        yield sse_error(exc)
    except (ValueError, RuntimeError) as exc:
        yield sse_error(exception_error(exc))
    finally:
        await deltas.aclose()  # aborts it if unfinished
    yield SSE_DONE


def _delta_messages(pieces: list[str | CallPiece]) -> list[DeltaMessage]:
    out: list[DeltaMessage] = []
    for piece in pieces:
        if isinstance(piece, str):
            out.append(DeltaMessage(content=piece))
            continue
        call = piece.call
        out.append(DeltaMessage(tool_calls=[DeltaToolCall(
            index=piece.index, id=call.id, type="function",
            function=DeltaFunctionCall(name=call.name, arguments=call.arguments_json))]))
    return out
