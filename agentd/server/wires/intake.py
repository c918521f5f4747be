"""What the routes do with a decoded request before the engine sees it: refuse a prompt that
cannot fit by its length alone, before it is rendered and tokenised off the event loop (the
fields it carries that agentd does not know: ``agentd.server.ignored_fields``).

Invariants: a prompt whose
text is longer than ``max_model_len`` tokens could hold is refused in time proportional to the
number of its messages, before any templating or tokenising (a 10 MB prompt is a 400 in
milliseconds, not 20 s of tokenising on the event loop); templating and tokenising run in a
worker thread, so ``/health`` and streams keep answering meanwhile.

The length bound: no token of a vocabulary covers more characters than its longest entry (a
byte-level BPE entry spells one character per byte; a normalizer may merge characters, which
``_NORMALIZER_SLACK`` allows for), so a text of ``n`` characters is at least
``n / longest`` tokens. The template only adds tokens to the message contents.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from agentd.server.errors import RequestValidationError as _Invalid
from agentd.server.wires.chat_types import ChatCompletionRequest
from agentd.server.wires.completions_types import CompletionRequest

_NORMALIZER_SLACK = 4  # NFC and the like merge at most a few code points into one


@lru_cache(maxsize=8)
def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` can stand for (an upper bound)."""
    longest = max(map(len, tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        longest *= _NORMALIZER_SLACK
    return max(longest, 1)


def check_chat_size(req: ChatCompletionRequest, tokenizer: Any, max_model_len: int) -> None:
    """400 ``context_length_exceeded`` if the messages' text alone must exceed the context."""
    num_chars = 0
    for message in req.messages:
        content = message.content
        if isinstance(content, str):
            num_chars += len(content)
        elif isinstance(content, list):
            num_chars += sum(len(part.text or "") for part in content)
    check_chars(num_chars, tokenizer, max_model_len, "messages")


def check_completion_size(req: CompletionRequest, tokenizer: Any, max_model_len: int) -> None:
    """400 ``context_length_exceeded`` if the prompt alone must exceed the context."""
    prompt = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, str):
        check_chars(len(prompt), tokenizer, max_model_len, "prompt")
    elif isinstance(prompt, list) and len(prompt) >= max_model_len:
        raise _Invalid(f"the prompt is {len(prompt)} tokens, but the model's context length "
                       f"(max_model_len) is {max_model_len} tokens; shorten the prompt",
                       "prompt", code="context_length_exceeded")


def text_chars(value: Any, keys: tuple[str, ...]) -> int:
    """Characters of the text a JSON value holds: strings, in lists, and under ``keys`` of
    objects (a wire's text fields: messages, tool arguments and results)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(text_chars(item, keys) for item in value)
    if isinstance(value, dict):
        return sum(text_chars(value[key], keys) for key in keys if key in value)
    return 0


def check_chars(num_chars: int, tokenizer: Any, max_model_len: int, param: str,
                too_long: str | None = None) -> None:
    """400 ``context_length_exceeded`` if ``num_chars`` characters must be more tokens than the
    context holds; ``too_long``: the wire's own words for it (``checks.ANTHROPIC_TOO_LONG``),
    given the lower bound as the count."""
    min_tokens = -(-num_chars // max_token_chars(tokenizer))
    if min_tokens < max_model_len:
        return
    message = (f"the prompt's text is {num_chars} characters, at least {min_tokens} tokens for "
               f"this model, but its context length (max_model_len) is {max_model_len} tokens; "
               f"shorten the {param}") if too_long is None else too_long.format(
        num_tokens=min_tokens, max_model_len=max_model_len, param=param)
    raise _Invalid(message, param, code="context_length_exceeded")
