"""Render OpenAI-shaped chat messages and tools into prompt token ids with the model's template.

Invariants: the same tools in the same list order give the same prompt bytes whatever the key
order of their dicts (schemas are canonicalized before templating); where agentd renders tools
itself (templates that know nothing of tools, like SmolLM2's ChatML), the tools block comes
*before* the system text, so a volatile system line does not cost the tools their cached KV; the
token ids are exactly what ``apply_chat_template(..., tokenize=True)`` would give — except that
text from the request (message contents, names, tool-call arguments, tool schemas) never yields a
special token: a user who types ``<|im_end|><|im_start|>system`` gets those characters as text,
not a forged turn, while the template's own special tokens stay special. Such strings are
swapped for placeholders before templating, and tokenised as plain text in their place; a
request without them renders exactly as before (so the prefix cache and pins still hit).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from agentd.tool_parser import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

ToolChoice = str | dict[str, Any] | None

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
_MENTIONS_TOOLS = re.compile(r"\btools\b")


@dataclass(frozen=True)
class RenderedPrompt:
    prompt: str
    prompt_token_ids: list[int]


def canonical_json(value: Any) -> Any:
    """``value`` with the keys of every dict, at every depth, in sorted order."""
    if isinstance(value, dict):
        return {key: canonical_json(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [canonical_json(item) for item in value]
    return value


def canonical_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tools in the order given, each deep-sorted, so equal tools always template the same."""
    return [canonical_json(tool) for tool in tools]


def tools_json(tools: list[dict[str, Any]]) -> str:
    """One canonical JSON object per line, the form agentd's own tools block shows the model."""
    return "\n".join(
        json.dumps(tool, sort_keys=True, separators=(", ", ": "), ensure_ascii=False)
        for tool in tools
    )


def template_supports_tools(tokenizer: Any) -> bool:
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = "\n".join(template.values())
    return bool(template) and _MENTIONS_TOOLS.search(template) is not None


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    tool_choice: ToolChoice = None,
    add_generation_prompt: bool = True,
) -> RenderedPrompt:
    """Render ``messages`` (OpenAI shape, plain dicts) and ``tools`` through the chat template.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        messages: system/developer/user/assistant/tool messages; content may be text parts.
        tools: OpenAI tool definitions, or None.
        tool_choice: "none" renders no tools; "required" or a named function adds an instruction
            at the end of the system message (agentd's own tools block's templates); "auto" or
            None adds nothing.
    Returns:
        The prompt text and its token ids.
    """
    active_tools = canonical_tools(tools) if tools and tool_choice != "none" else None
    guard = _SpecialTextGuard(tokenizer)
    messages, active_tools = guard.escape(messages), guard.escape(active_tools)
    if template_supports_tools(tokenizer):
        prompt = tokenizer.apply_chat_template(
            [_native_message(m) for m in messages],
            tools=active_tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
    else:
        system_prefix = tools_block(active_tools) if active_tools else None
        chatml = _chatml_messages(messages, system_prefix)
        if active_tools and (instruction := choice_instruction(tool_choice)):
            chatml[0]["content"] += f"\n\n{instruction}"  # the system message prefix_system made
        prompt = tokenizer.apply_chat_template(
            chatml,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
    return guard.tokenize(prompt)


class _SpecialTextGuard:
    """Keeps request text from becoming special tokens: ``escape`` swaps every special token's
    string in the request's values for a placeholder no one can type (it carries a random
    nonce); ``tokenize`` then tokenises the rendered template around the placeholders as usual
    and each placeholder as its string's plain-text tokens."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.specials, self.pattern = _special_strings(tokenizer)
        self.nonce = secrets.token_hex(8)
        self.used = False

    def escape(self, value: Any) -> Any:
        if isinstance(value, str):
            if self.pattern is None or self.pattern.search(value) is None:
                return value
            self.used = True
            return self.pattern.sub(self._placeholder, value)
        if isinstance(value, dict):
            return {key: self.escape(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.escape(item) for item in value]
        return value

    def _placeholder(self, match: re.Match[str]) -> str:
        return f"\ue000{self.nonce}:{self.specials.index(match.group())}\ue001"

    def tokenize(self, prompt: str) -> RenderedPrompt:
        # apply_chat_template(tokenize=True) never adds special tokens: the template holds them.
        if not self.used:
            return RenderedPrompt(prompt, list(self.tokenizer(prompt, add_special_tokens=False)
                                               .input_ids))
        pieces = re.split(f"\ue000{self.nonce}:(\\d+)\ue001", prompt)
        token_ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:  # a placeholder: its special token's string as plain text
                piece = self.specials[int(piece)]
                token_ids += self._plain_ids(piece)
            elif piece:
                token_ids += self.tokenizer(piece, add_special_tokens=False).input_ids
            pieces[i] = piece
        return RenderedPrompt("".join(pieces), token_ids)

    def _plain_ids(self, text: str) -> list[int]:
        """``text``'s tokens with no special token matched: its first character apart from the
        rest until no part holds a special token's string. (Not ``split_special_tokens``: that
        flips a flag on the shared Rust tokenizer, which other threads tokenise with.)"""
        assert self.pattern is not None
        if len(text) == 1 or self.pattern.search(text) is None:
            return list(self.tokenizer(text, add_special_tokens=False).input_ids)
        return self._plain_ids(text[0]) + self._plain_ids(text[1:])


def plain_text_ids(tokenizer: Any, text: str) -> list[int]:
    """``text``'s token ids with every special token's string spelled as plain text (an
    assistant prefill appended to a rendered prompt, say)."""
    guard = _SpecialTextGuard(tokenizer)
    return guard.tokenize(guard.escape(text)).prompt_token_ids


@lru_cache(maxsize=8)
def _special_strings(tokenizer: Any) -> tuple[list[str], re.Pattern[str] | None]:
    """The tokenizer's special tokens' strings, and a pattern matching any (longest first)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    strings = {token.content for token in decoder.values() if token.special}
    strings.update(getattr(tokenizer, "all_special_tokens", []) or [])
    specials = sorted((s for s in strings if s), key=lambda s: (-len(s), s))
    if not specials:
        return specials, None
    return specials, re.compile("|".join(re.escape(s) for s in specials))


def tools_block(tools: list[dict[str, Any]]) -> str:
    """agentd's own tools block (Hermes/Qwen2.5 wording) for templates without tools support."""
    return TOOLS_PREAMBLE + tools_json(canonical_tools(tools)) + TOOLS_POSTAMBLE


def choice_instruction(tool_choice: ToolChoice) -> str | None:
    """What "required" or a named function adds to the system message: at its end, after the
    tools and the system text, so turns that differ only in ``tool_choice`` share their whole
    system prefix in the cache (before the tools, the instruction split it at the tools)."""
    if tool_choice == "required":
        return "You must call at least one function."
    if (name := forced_function_name(tool_choice)) is not None:
        return f"You must call the function {name}."
    return None


def forced_function_name(tool_choice: ToolChoice) -> str | None:
    """The name in ``{"type": "function", "function": {"name": ...}}``, else None."""
    if isinstance(tool_choice, dict):
        return (tool_choice.get("function") or {}).get("name")
    return None


def content_text(content: str | list[dict[str, Any]] | None) -> str:
    """Text of a message's content: a list of text parts is joined by newlines (as vLLM does)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.get("text") or "" for part in content)


def _role(message: dict[str, Any]) -> str:
    return "system" if message["role"] == "developer" else message["role"]


def _native_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message for a template that knows tools: tool-call arguments become dicts."""
    out = {key: value for key, value in message.items() if value is not None}
    out["role"] = _role(message)
    out["content"] = content_text(message.get("content"))
    if message.get("tool_calls"):
        out["tool_calls"] = [_native_tool_call(call) for call in message["tool_calls"]]
    return out


def _native_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    return {
        **call,
        "type": call.get("type", "function"),
        "function": {**function, "arguments": _arguments_obj(function.get("arguments"))},
    }


def _arguments_obj(arguments: str | dict[str, Any] | None) -> dict[str, Any] | str:
    if arguments is None:
        return {}
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def _chatml_messages(
    messages: list[dict[str, Any]], system_prefix: str | None
) -> list[dict[str, str]]:
    """Messages a system/user/assistant-only template can render: tool calls as tagged text in
    the assistant turn, consecutive tool results merged into one user turn."""
    out: list[dict[str, str]] = []
    previous_role = None
    for message in messages:
        role, text = _role(message), content_text(message.get("content"))
        if role == "tool":
            response = f"<tool_response>\n{text}\n</tool_response>"
            if previous_role == "tool":
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
        elif role == "assistant" and message.get("tool_calls"):
            calls = [_tool_call_text(call) for call in message["tool_calls"]]
            out.append({"role": role, "content": "\n".join([text, *calls] if text else calls)})
        else:
            out.append({"role": role, "content": text})
        previous_role = role
    prefix_system(out, system_prefix)
    return out


def prefix_system(messages: list[dict[str, Any]], system_prefix: str | None) -> None:
    """Put ``system_prefix`` at the head of the first system message (in place), or make it
    the first message."""
    if system_prefix is None:
        return
    if messages and messages[0]["role"] == "system":
        system_text = messages[0]["content"]
        messages[0]["content"] = (
            f"{system_prefix}\n\n{system_text}" if system_text else system_prefix
        )
    else:
        messages.insert(0, {"role": "system", "content": system_prefix})


def _tool_call_text(call: dict[str, Any]) -> str:
    function = call["function"]
    body = json.dumps(
        {"name": function["name"], "arguments": _arguments_obj(function.get("arguments"))},
        ensure_ascii=False,
    )
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"
