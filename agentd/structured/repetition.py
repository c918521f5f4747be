"""The guards that keep a constrained output finite when a small model loops.

A grammar makes every token legal, not every value finite: SmolLM2-135M, asked for a tool call
over the coding workload's tools, wrote ``"start_line": 1000000…`` and ``"patch": "1.0.0-1.0.0-…"``
until max_tokens in 13 of 50 ``required`` turns, and a call cut there does not parse. Two guards,
for constrained requests only (unconstrained ones are never touched):

- Numbers are bounded in the grammar: at most 16 digits before the point and 15 after it (what
  an IEEE double carries; I-JSON asks for no more), ``bound_numbers`` on the grammar's text.
- A verbatim repeat is cut short: a token that would make the output's last ``MIN_REPEAT``
  tokens plus itself a run that already occurred earlier in the output is masked out (the idea
  of DRY sampling, as a hard ban with a long minimum), so a loop ends within ``MIN_REPEAT``
  tokens of starting its second round and the model takes its next choice — in a string or an
  array usually the one that closes it. Near-loops that vary every few tokens slip through.

Invariant: both only remove tokens that keep a loop or a number going, and never the last legal
one; the rest of the grammar's mask stays.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Sequence

MIN_REPEAT = 16  # a run of this many tokens may recur; the token that would extend it not
_ITEM = array("i").itemsize
MAX_INT_DIGITS = 16  # before the point
MAX_FRACTION_DIGITS = 15

_DIGIT_RULE = re.compile(r"^(\S+) ::= \(\(\[0-9\]\)\)$", re.M)
_BARE_DIGITS = "[0-9]*"


def bound_numbers(grammar_text: str) -> str:
    """``grammar_text`` (xgrammar EBNF of a JSON schema) with every unbounded run of digits
    bounded: ``[0-9]*`` and ``DIGIT_RULE{n, -1}`` (a rule that is one digit, repeated without
    end) get an upper bound of ``MAX_FRACTION_DIGITS`` (the integer part keeps its leading
    ``[1-9]``, so it holds at most ``MAX_INT_DIGITS``)."""
    grammar_text = grammar_text.replace(_BARE_DIGITS, f"[0-9]{{0, {MAX_INT_DIGITS - 1}}}")
    for name in set(_DIGIT_RULE.findall(grammar_text)):
        grammar_text = re.sub(rf"\b{re.escape(name)}\{{(\d+), -1\}}",
                              rf"{name}{{\1, {MAX_FRACTION_DIGITS}}}", grammar_text)
    return grammar_text


def loop_tokens(output_ids: Sequence[int]) -> set[int]:
    """The tokens that followed earlier occurrences of the output's last ``MIN_REPEAT`` tokens:
    each would repeat, verbatim, a run of at least ``MIN_REPEAT + 1`` tokens."""
    num = len(output_ids)
    if num <= MIN_REPEAT:
        return set()
    data = array("i", output_ids).tobytes()
    tail = data[(num - MIN_REPEAT) * _ITEM:]
    found: set[int] = set()
    end = (num - 1) * _ITEM  # an occurrence must end before the last token: one must follow
    while (pos := data.rfind(tail, 0, end)) >= 0:
        if pos % _ITEM == 0:
            found.add(output_ids[pos // _ITEM + MIN_REPEAT])
        end = pos + len(tail) - 1
    return found
