"""Prompts for the wires, from OpenAI-shaped chat messages: the whole conversation rendered, the
tokens up to a cache breakpoint, and a continuation appended to a stored conversation's exact
token ids.

Invariants: every prompt comes from ``agentd.chat.render_chat`` (the chat route's templates,
tools block and special-token guard), so a conversation renders the same on every wire; a
continuation never re-renders what is stored — only the new messages are rendered, as the
template renders them after an assistant turn, and appended to the stored ids; the breakpoint
length is a prefix of the prompt's own ids.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from agentd.cache import common_prefix_len
from agentd.chat import render_chat
from agentd.server.errors import RequestValidationError

Messages = list[dict[str, Any]]
TOOLS_CUT = -1  # a breakpoint on the tools: the prefix ends with the tools block
# A stand-in for the stored turns when rendering what follows them (see ``continuation_ids``).
_EARLIER = [{"role": "user", "content": "."}]


def render_ids(tokenizer: Any, messages: Messages, tools: list[dict[str, Any]] | None,
               tool_choice: Any, param: str, add_generation_prompt: bool = True) -> list[int]:
    """The prompt's token ids; a 400 naming ``param`` when the template refuses them."""
    try:
        rendered = render_chat(tokenizer, messages, tools, tool_choice, add_generation_prompt)
    except Exception as exc:  # jinja raises for conversations the template refuses
        raise RequestValidationError(f"the chat template rejected the {param}: {exc}",
                                     param) from exc
    return list(rendered.prompt_token_ids)


def breakpoint_len(tokenizer: Any, messages: Messages, tools: list[dict[str, Any]] | None,
                   tool_choice: Any, prompt_ids: Sequence[int], cut: tuple[int, int]) -> int:
    """How many of ``prompt_ids`` come before the end of the block at ``cut`` — (message index,
    content part index), or ``(TOOLS_CUT, 0)`` for the tools: the conversation cut there is
    rendered alone and what it shares with the whole prompt is the prefix."""
    index, part = cut
    if index == TOOLS_CUT:
        head: Messages = [{"role": "system", "content": ""}]
    else:
        message = dict(messages[index])
        if isinstance(message.get("content"), list):
            message["content"] = message["content"][:part + 1]
        head = [*messages[:index], message]
    try:
        head_ids = render_chat(tokenizer, head, tools, tool_choice,
                               add_generation_prompt=False).prompt_token_ids
    except Exception:  # a template that refuses a partial conversation: keep the whole prompt
        return len(prompt_ids)
    return common_prefix_len(list(head_ids), list(prompt_ids))


def continuation_ids(tokenizer: Any, stored_ids: Sequence[int], new_messages: Messages,
                     tools: list[dict[str, Any]] | None, tool_choice: Any,
                     last_turn: dict[str, Any], end_ids: Collection[int]) -> list[int]:
    """``stored_ids`` (a prompt and the reply generated for it) followed by ``new_messages`` as
    the template renders them after that reply, and the generation prompt.

    The template renders a stand-in conversation ending in ``last_turn`` (the stored reply's
    shape: its tool calls, if any) with and without the new messages; the tokens past the
    stand-in are the new messages'. What closes the reply's turn comes after its end token
    (``end_ids``: the model's end-of-turn ids): the reply generated that token itself unless
    it was cut short, in which case the closing is added whole.
    """
    before = [*_EARLIER, last_turn]
    head = render_ids(tokenizer, before, tools, tool_choice, "input", False)
    whole = render_ids(tokenizer, before + new_messages, tools, tool_choice, "input")
    if whole[:len(head)] != head:
        raise RequestValidationError("the chat template renders this turn differently after "
                                     "earlier turns; send the whole conversation instead of "
                                     "previous_response_id", "previous_response_id")
    ends = [i for i, token_id in enumerate(head) if token_id in end_ids]
    closing = head[ends[-1]:] if ends else []
    if closing and stored_ids and stored_ids[-1] == closing[0]:
        closing = closing[1:]
    return [*stored_ids, *closing, *whole[len(head):]]
