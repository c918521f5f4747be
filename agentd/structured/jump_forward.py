"""Jump-forward: where the grammar allows exactly one continuation (the rest of a call's header,
the keys a schema requires, the closing braces), append its tokens without a decoding step each.

Invariant: the output's tokens after a jump are exactly what the tokenizer produces for the
output text with the forced text after it — checked by tokenizing the last output tokens' text
together with the forced text: the output's own tokens must come back unchanged (all of them, or
all but the token sampled this step, whose KV no step has computed yet, so it may be replaced
by the tokens that spell it together with the forced text), and the forced text's tokens are
taken from that same tokenization, less the last one (the model's next token may merge with
it). When neither holds nothing changes and decoding goes on one token at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

WINDOW_TOKENS = 16  # output tokens re-tokenized with the forced text (BPE merges are local)


@dataclass(frozen=True)
class Jump:
    num_replaced: int  # trailing output tokens to drop first: 0, or 1 (the one just sampled)
    token_ids: list[int]  # then append these


def plan_jump(tokenizer: Any, output_ids: list[int], forced_text: str) -> Jump | None:
    """How to extend ``output_ids`` by a prefix of ``forced_text``; None if it cannot be done
    token-exactly or would add nothing."""
    if not forced_text or not output_ids:
        return None
    window = output_ids[-WINDOW_TOKENS:]
    window_text = tokenizer.decode(window, skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    if "\ufffd" in window_text:
        return None  # the window starts or ends inside a UTF-8 character
    ids = tokenizer(window_text + forced_text, add_special_tokens=False).input_ids
    for num_replaced in (0, 1):
        kept = len(window) - num_replaced
        tail = list(ids[kept:-1])
        if ids[:kept] == window[:kept] and len(tail) > num_replaced:
            return Jump(num_replaced, tail)
    return None
