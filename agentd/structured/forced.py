"""Forced text, bounded: the bytes a grammar allows next and nothing else, found a byte at a
time on a shadow matcher, never more than ``MAX_FORCED_BYTES`` of them in one call.

xgrammar's ``find_jump_forward_string`` has no bound: where a grammar forces text without end (a
JSON schema whose required properties recur, ``root ::= "a" root`` in EBNF) it runs until the
memory is gone (~0.5 GB/s), and a finite grammar can still force 2^30 bytes at once (a required
pair of required pairs, 30 deep). So jump-forward and the closing search walk forced bytes
themselves, on the closing search's shadow matcher: its vocabulary has one token per byte value
and a stop token, so one mask (9 words) says which bytes may come next; exactly one byte, and
no stop, is a forced byte.

Invariant: a walk accepts at most ``MAX_FORCED_BYTES`` bytes, one matcher step each;
``forced_run`` leaves its walker after them (the caller rolls back), ``forced_text`` leaves its
matcher where it was.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

# Forced text in one step. The longest runs agents meet are a call's opening and the keys a
# schema requires (`<tool_call>\n{"name": "get_weather", "arguments": {"city": "` is 56 bytes;
# a 64-character name and a few required keys stay under 200), so 256 bytes jumps them whole;
# a longer run only goes on at the next step (the jump runs after every step), while a step's
# walk stays bounded (~12 us a byte, ~3 ms at most) whatever the grammar forces.
MAX_FORCED_BYTES = 256
# The characters the closing search writes (it tries these as next characters) come first, then
# the stop token, then every other byte value, so that a mask also says when a byte outside
# them (a UTF-8 lead byte, a control character) may come next.
ALPHABET = tuple(bytes([b]) for b in (9, 10, 13, *range(32, 127)))
STOP = len(ALPHABET)  # the shadow vocabulary's stop token
SHADOW_VOCAB = (*ALPHABET, b"<stop>", *(bytes([b]) for b in range(256)
                                        if bytes([b]) not in ALPHABET))
_ALL_TOKENS = (1 << len(SHADOW_VOCAB)) - 1


class ForcedRun(NamedTuple):
    data: bytes  # the forced bytes, accepted by the walker one step each
    sig: bytes  # the shadow mask after them: the state's signature


def forced_run(walker: Any, mask: torch.Tensor) -> ForcedRun:
    """Accept the bytes ``walker`` (a shadow matcher) is forced to take next, at most
    ``MAX_FORCED_BYTES``; ``mask`` is a one-row bitmask of the shadow vocabulary."""
    rows = mask.numpy()
    data = bytearray()
    while True:
        walker.fill_next_token_bitmask(mask, 0)
        sig = rows.tobytes()
        token_id = _only_token(sig)
        if token_id is None or len(data) >= MAX_FORCED_BYTES:
            return ForcedRun(bytes(data), sig)
        byte = SHADOW_VOCAB[token_id]
        if not walker.accept_string(byte):
            return ForcedRun(bytes(data), sig)  # cannot happen: the mask allowed it
        data += byte


def forced_text(shadow: Any, mask: torch.Tensor) -> str:
    """The text ``shadow``'s grammar forces next, whole UTF-8 characters only (as xgrammar's
    ``find_jump_forward_string`` gives it), at most ``MAX_FORCED_BYTES``; ``shadow`` stays
    where it is."""
    return whole_characters(forced_run(shadow.fork(), mask).data)


def whole_characters(data: bytes) -> str:
    """The longest start of ``data`` made of whole UTF-8 characters ("" when it starts inside
    one: the output so far ends within a character)."""
    if data and 0x80 <= data[0] < 0xC0:
        return ""
    for end in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:end].decode()
        except UnicodeDecodeError:
            continue
    return ""


def _only_token(sig: bytes) -> int | None:
    """The one token a mask allows, if it allows exactly one and not the stop token."""
    bits = int.from_bytes(sig, "little") & _ALL_TOKENS
    if not bits or bits & (bits - 1) or bits >> STOP & 1:
        return None
    return bits.bit_length() - 1
