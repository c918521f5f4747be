"""Cache-busters: two prompts equal but for a short span (a per-request hash, a timestamp), after
which they agree again for a long run that the prefix cache could have served and did not.

Pure functions on token ids, and the cause a person reads. Claude Code, for one, puts a billing
line with a per-request hash (``x-anthropic-billing-header: ...; cch=...``) first in its system
prompt, so a cache keyed on prefixes never hits past it; the cure is a client setting.
Invariant: a ``Span`` is reported only when both prompts agree for ``MIN_RUN`` tokens right
after it, and a span is at most ``MAX_SPAN`` tokens on either side.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from agentd.cache import common_prefix_len

MAX_SPAN = 64  # tokens a varying span may take on either side
RESYNC = 8  # equal tokens that show where the prompts agree again
MIN_RUN = 32  # equal tokens after the span that make it worth a report (two blocks)
_CONTEXT_CHARS = 40

CLAUDE_CODE_HEADER = ("Claude Code's billing header (x-anthropic-billing-header: ...; cch=...) "
                      "carries a per-request hash at the start of the system prompt")
CLAUDE_CODE_FIX = "run Claude Code with CLAUDE_CODE_ATTRIBUTION_HEADER=0"
_HASH = re.compile(r"\b(?=[0-9a-fA-F]*[0-9])(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{6,}\b|"
                   r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-|\b(?=\w*\d)(?=\w*[A-Za-z])[\w-]{16,}\b")
_DATE_TIME = re.compile(
    r"\d{4}-\d{2}-\d{2}|\d{1,2}:\d{2}|\b(?:19|20)\d{2}\b|\b\d{10,13}\b|"
    r"\b(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)[a-z]*\b|"
    r"\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\b", re.IGNORECASE)
# where a turn ends or starts (ChatML, Llama 3, Mistral, Gemma)
_TURN_MARK = re.compile(r"<\|im_end\|>|<\|eot_id\|>|<\|im_start\|>|\[/?INST\]|<end_of_turn>|"
                        r"<start_of_turn>|<\|start_header_id\|>")
_SPECIAL = re.compile(r"<\|[^|>\s]*\|>|<s>|\[INST\]|<start_of_turn>|<bos>")


@dataclass(frozen=True)
class Span:
    """Where ``new`` and ``old`` differ, and the run of equal tokens after it."""

    start: int  # the first differing token, in both
    new_end: int  # where ``new`` agrees with ``old`` again
    old_end: int
    num_equal_after: int  # tokens the cache could have served after the span


@dataclass(frozen=True)
class SpanCause:
    cause: str  # a short human guess
    fix: str | None  # the client setting that turns it off, when the client is known
    new_text: str  # the varying span, the new prompt's side
    old_text: str
    before: str  # the text just before the span


def find_span(new: Sequence[int], old: Sequence[int], start: int) -> Span | None:
    """The shortest span from ``start`` (the first differing token) after which ``new`` and
    ``old`` agree for at least ``MIN_RUN`` tokens; None when they do not agree again soon
    (another prompt, or a new turn: no cache was lost to a span)."""
    grams: dict[tuple[int, ...], int] = {}
    for j in range(min(len(old) - RESYNC, start + MAX_SPAN), start - 1, -1):
        grams[tuple(old[j:j + RESYNC])] = j  # the earliest position wins
    for i in range(start, min(len(new) - RESYNC, start + MAX_SPAN) + 1):
        j = grams.get(tuple(new[i:i + RESYNC]))
        if j is None:
            continue
        run = common_prefix_len(new, old, i, j)
        if run >= MIN_RUN:
            return Span(start, i, j, run)
    return None


def describe(tokenizer, new: Sequence[int], old: Sequence[int], span: Span) -> SpanCause:
    """Decode the span on both sides and guess what varies, and where."""
    new_text = tokenizer.decode(list(new[span.start:span.new_end]))
    old_text = tokenizer.decode(list(old[span.start:span.old_end]))
    before = tokenizer.decode(list(new[max(0, span.start - 128):span.start]))
    after = tokenizer.decode(list(new[span.new_end:span.new_end + 8]))
    if "x-anthropic-billing-header" in _line_around(before, new_text):
        return SpanCause(CLAUDE_CODE_HEADER, CLAUDE_CODE_FIX, new_text, old_text,
                         before[-_CONTEXT_CHARS:])
    both = new_text + " " + old_text
    if _DATE_TIME.search(both) and not _HASH.search(both):
        what = "a date or time"
    elif _HASH.search(both):
        what = "a per-request hash or id"
    else:
        what = "text that changes between requests"
    return SpanCause(f"{what} {_where(tokenizer, new, span.start, after)}", None, new_text,
                     old_text, before[-_CONTEXT_CHARS:])


def _where(tokenizer, new: Sequence[int], start: int, after: str) -> str:
    """Where the span sits: at the prompt's start (only template markers before it), at the end
    of a message (a turn marker right after it), or inside the prompt."""
    if _TURN_MARK.match(after.lstrip()):
        return "at the end of a message (the system prompt's, if it is the first)"
    head = _SPECIAL.sub("", tokenizer.decode(list(new[:start]))).lstrip()
    head = head.removeprefix("system").lstrip()
    if "\n" not in head and len(head) < 64:
        return "at the start of the prompt (its first line)"
    return "inside the prompt"


def _line_around(before: str, span_text: str) -> str:
    return before.rsplit("\n", 1)[-1] + span_text.split("\n", 1)[0]
