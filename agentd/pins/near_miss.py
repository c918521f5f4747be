"""Near misses: prompts that lost the cache a little before they could have hit it, and the
cause a person reads.

Cache-busters: two prompts equal but for a short span (a per-request hash, a timestamp), after
which they agree again for a long run that the prefix cache could have served and did not (pure
functions on token ids). Claude Code, for one, puts a billing line with a per-request hash
(``x-anthropic-billing-header: ...; cch=...``) first in its system prompt, so a cache keyed on
prefixes never hits past it; the cure is a client setting. Pins' near misses
(``PinNearMisses``): a request that shares a long prefix with a pin but leaves it before its end,
recorded with the first differing token, the text on both sides and a guessed cause.

Invariants: a ``Span`` is reported only when both prompts agree for ``MIN_RUN`` tokens right
after it, and a span is at most ``MAX_SPAN`` tokens on either side; a pin's near miss is
another tenant's prompt never; a date or time is guessed by one pattern (``_DATE_TIME``).
"""

from __future__ import annotations

import re
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from agentd.cache import Pin, PinKey, common_prefix_len
from agentd.engine.request import Request

MAX_SPAN = 64  # tokens a varying span may take on either side
RESYNC = 8  # equal tokens that show where the prompts agree again
MIN_RUN = 32  # equal tokens after the span that make it worth a report (two blocks)
_CONTEXT_CHARS = 40

CLAUDE_CODE_HEADER = ("Claude Code's billing header (x-anthropic-billing-header: ...; cch=...) "
                      "carries a per-request hash at the start of the system prompt")
CLAUDE_CODE_FIX = "run Claude Code with CLAUDE_CODE_ATTRIBUTION_HEADER=0"
_HASH = re.compile(r"\b(?=[0-9a-fA-F]*[0-9])(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{6,}\b|"
                   r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-|\b(?=\w*\d)(?=\w*[A-Za-z])[\w-]{16,}\b")
# A date or time in a prompt (the commonest cache-buster): dates, clock times, years, Unix
# timestamps, weekday and month names, "today", "date". The one guess of it, for both reports.
_DATE_TIME = re.compile(
    r"\d{4}-\d{2}-\d{2}|\d{1,2}:\d{2}|\b(?:19|20)\d{2}\b|\b\d{10,13}\b|"
    r"\b(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)[a-z]*\b|"
    r"\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\b|\btoday\b|\bdate\b",
    re.IGNORECASE)
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
_NEAR_MISS_KEEP = 256
_NEAR_MISS_RECENT = 10  # how many of the latest near misses observers see
_PIN_CONTEXT_CHARS = 48
CAUSE_DATE_TIME = "a date or time in the prompt changes between requests"
CAUSE_TOOLS = "the tools differ (another order, or changed schemas)"
CAUSE_TEMPLATE = "a different chat template or message layout"
CAUSE_TEXT_ADDED = "text was added to or removed from the prompt here"
CAUSE_TEXT = "the prompt text changed"
# JSON keys of an OpenAI tool and its parameter schema, as templates render them. Before the
# divergence, "name"/"type" are left out: agentd's own tools block ends with a call example that
# has them, right before the system text.
_TOOL_KEYS = re.compile(r'"(?:type|function|name|parameters|description|properties)":|<tools>')
_TOOL_KEYS_BEFORE = re.compile(
    r'"(?:function|parameters|description|properties|required|enum)":|<tools>')
# where a turn or a special token starts (ChatML, Llama 3, Mistral, Gemma)
_MARKER = re.compile(r"\s*(?:<\||\[/?INST\]|<start_of_turn>|<end_of_turn>|</?s>)")
_MARKER_END = re.compile(r"(?:<\|[A-Za-z_]+\|>|\[/?INST\]|<start_of_turn>)\s*$")


# --- near misses of pins: a request that left a pin before its end ---------------------------


@dataclass
class NearMiss:
    pin: str
    request_id: str
    divergence_token: int  # index of the first token that differs from the pin
    pin_num_tokens: int
    pin_text: str  # decoded text around the divergence, the pin's side
    request_text: str  # the same for the request
    cause: str
    time_s: float
    owner: str | None = None  # the pin's tenant

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class NearMissCount:
    owner: str | None  # the pin's tenant
    pin: str
    cause: str
    count: int


class PinNearMisses:
    """The near misses recorded against pins: the latest ``_NEAR_MISS_KEEP``, and a count per
    pin and cause. Runs on the engine thread."""

    def __init__(self, tokenizer, block_size: int) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.recent: deque[NearMiss] = deque(maxlen=_NEAR_MISS_KEEP)
        self.counts: Counter[tuple[PinKey, str]] = Counter()

    def __len__(self) -> int:
        return len(self.recent)

    def __iter__(self) -> Iterator[NearMiss]:
        return iter(self.recent)

    def check(self, pin: Pin, request: Request, hashes: list[bytes]) -> None:
        """Record ``request`` (which hit no pin whole; ``hashes``: its prompt's chain) as a
        near miss of ``pin`` when it shares a long prefix with it, or all of it but a short
        span."""
        if request.cache_salt != pin.cache_salt:
            return  # another tenant's (or salt's) prompt is none of this pin's business
        num_equal = 0
        for mine, theirs in zip(pin.block_hashes, hashes, strict=False):
            if mine != theirs:
                break
            num_equal += 1
        tokens = request.all_token_ids
        pin_tokens = pin.all_token_ids
        start = num_equal * self.block_size
        index = start + common_prefix_len(tokens, pin_tokens, start, start)
        if index >= pin.num_tokens:
            return  # the request is simply shorter than the pin
        # A short span that varies (a per-request hash, a timestamp), then the pin again: named
        # with its span wherever it is, even in the first block.
        span = find_span(tokens, pin_tokens[:pin.num_tokens], index)
        if span is not None and span.num_equal_after >= pin.num_tokens // 4:
            self._record_span(pin, request, span)
        elif num_equal and start >= pin.num_tokens // 4:
            pin_text = self._context(pin_tokens, index)
            request_text = self._context(tokens, index)
            self._record(NearMiss(pin.name, request.request_id, index, pin.num_tokens, pin_text,
                                  request_text, guess_cause(pin_text, request_text),
                                  time.time(), pin.owner), pin.key)
        # else: a different prompt, not a near miss

    def _record_span(self, pin: Pin, request: Request, span: Span) -> None:
        why = describe(self.tokenizer, request.all_token_ids, pin.all_token_ids, span)
        cause = why.cause if why.fix is None else f"{why.cause}; {why.fix}"
        before, old, new = (text.replace("\n", "\\n")
                            for text in (why.before, why.old_text, why.new_text))
        self._record(NearMiss(pin.name, request.request_id, span.start, pin.num_tokens,
                              f"{before}⟦{old}⟧", f"{before}⟦{new}⟧", cause, time.time(),
                              pin.owner), pin.key)

    def _record(self, miss: NearMiss, key: PinKey) -> None:
        self.recent.append(miss)
        self.counts[(key, miss.cause)] += 1

    def _context(self, token_ids: list[int], index: int) -> str:
        before = self.tokenizer.decode(token_ids[max(0, index - 24):index])
        after = self.tokenizer.decode(token_ids[index:index + 12])
        return (before[-_PIN_CONTEXT_CHARS:] + "⟦" + after[:_PIN_CONTEXT_CHARS]).replace(
            "\n", "\\n")


    def top(self) -> tuple[NearMissCount, ...]:
        """Counts by pin and cause, the commonest first."""
        return tuple(NearMissCount(key.owner, key.name, cause, n)
                     for (key, cause), n in self.counts.most_common())

    def latest(self) -> tuple[NearMiss, ...]:
        return tuple(self.recent)[-_NEAR_MISS_RECENT:]


def guess_cause(pin_text: str, request_text: str) -> str:
    """A short human guess at why a prompt diverged from a pin (texts hold ``⟦`` where the first
    differing token starts)."""
    pin_before, pin_after = _split_at_divergence(pin_text)
    req_before, req_after = _split_at_divergence(request_text)
    if _DATE_TIME.search(pin_after) or _DATE_TIME.search(req_after):
        return CAUSE_DATE_TIME
    if _TOOL_KEYS.search(pin_after + req_after) or _TOOL_KEYS_BEFORE.search(pin_before):
        return CAUSE_TOOLS
    pin_marks, req_marks = bool(_MARKER.match(pin_after)), bool(_MARKER.match(req_after))
    if (pin_marks and req_marks) or _MARKER_END.search(pin_before):
        return CAUSE_TEMPLATE
    if pin_marks != req_marks:
        return CAUSE_TEXT_ADDED
    return CAUSE_TEXT


def _split_at_divergence(text: str) -> tuple[str, str]:
    before, _, after = text.partition("⟦")
    return before, after
