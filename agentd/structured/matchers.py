"""The engine's grammar matchers: one per constrained request, owned by the engine thread.

Invariant: a matcher has accepted exactly the request's output tokens so far, so each step's mask
allows exactly the tokens that keep the output a prefix of a sentence of the grammar. Rows of
unconstrained requests are never touched: their logits, and so their tokens, are what they would
be without any constrained request in the batch.

Two guards keep a small model's constrained output finite (it can loop inside a JSON string, a
date-time's fraction or a URL until ``max_tokens`` and leave a call that does not parse): a token
that would repeat a long run verbatim is masked (``agentd.structured.repetition``), and a request
near its budget is closed by one rule, the shortest way to the end of its grammar
(``agentd.structured.closing``), whose length in tokens is what closing costs:

- ``GUARD_TOKENS`` before it has only that cost left, the request may write only content (what
  leaves the way out as it is: a string's letters, a fraction's digits) or the way's next token:
  it opens no new structure (a key, an item, a call), so the cost cannot rise.
- With the cost plus a margin left (``CLOSING_MARGIN``, and a tenth of a long way: jump-forward
  splits forced text as the tokenizer does), each row allows one token: the longest start of
  the way (free choices, forced text: keys, braces, the call's closing tag), then the stop token.
  A guarded row with nothing left to allow is held so too.

The costs are checked within ``CLOSING_HORIZON`` tokens of the budget (or twice the last known
cost, if that is more), once a step on the step's first row: so a request's speculative drafts
stop short of the guard's start, and a held request drafts nothing (``draft_room``); a step of
accepted drafts would otherwise carry it past the margin. A search result is reused while the
output follows its way or adds only content. Free text (the part of an "auto" turn before a
call) is never cut short.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

from agentd.engine.hooks import RequestHooks
from agentd.structured.closing import Closing, ClosingSearch, Vocab, allowed
from agentd.structured.repetition import loop_tokens

if TYPE_CHECKING:
    from agentd.engine.outputs import StreamDelta
    from agentd.engine.request import Request
    from agentd.engine.scheduler import ScheduledRequest

CLOSING_HORIZON = 64  # budgets (tokens left) at which the cost of closing is checked
CLOSING_MARGIN = 4  # tokens left beyond the estimate (jump-forward may split text otherwise),
MARGIN_PER_TOKEN = 0.1  # and a tenth more of a long way
GUARD_TOKENS = 16  # before closing: content only, no new structure


class Hold(Enum):
    """How a request near its budget is held (it only ever goes from guard to close)."""

    GUARD = "guard"
    CLOSE = "close"


@dataclass
class _Constrained:
    """A constrained request: its matcher, and what closing it needs."""

    matcher: Any
    grammar: Any
    token_ids: list[int] = field(default_factory=list)  # accepted so far
    shadow: Any = None  # the closing search's matcher, fed the same tokens from shadow_base on
    shadow_base: int = 0
    plan: Closing | None = None  # the last search's result, from token_ids[:plan_base]
    plan_base: int = 0
    last_cost: int | None = None
    hold: Hold | None = None


class StructuredOutputs(RequestHooks):
    """Matchers by request id; masks logits rows and advances matchers with sampled tokens."""

    def __init__(self, vocab_size: int,
                 decoded_vocab: Callable[[], Sequence[bytes]] | None = None,
                 stop_token_ids: Sequence[int] = ()) -> None:
        self.vocab_size = vocab_size
        self._requests: dict[str, _Constrained] = {}
        self._bitmask: torch.Tensor | None = None
        self._decoded_vocab = decoded_vocab
        self._search: ClosingSearch | None = None  # built on first use
        self._stop_ids = [t for t in stop_token_ids if 0 <= t < vocab_size]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    @property
    def closing_search(self) -> ClosingSearch | None:
        """The closing search (None without a vocabulary: then nothing is closed)."""
        if self._search is None and self._decoded_vocab is not None:
            self._search = ClosingSearch(Vocab(self._decoded_vocab(), self.vocab_size))
        return self._search

    def add(self, request_id: str, grammar: Any) -> None:
        import xgrammar as xgr

        self._requests[request_id] = _Constrained(xgr.GrammarMatcher(grammar), grammar)

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def added(self, request: Request) -> None:
        if request.grammar is not None:
            self.add(request.request_id, request.grammar)

    def finished(self, request: Request, item: ScheduledRequest | None,
                 delta: StreamDelta) -> None:
        self.remove(request.request_id)

    def needs_closing(self, request_id: str, budget: int) -> bool:
        """True once the request must be held to finish within ``budget`` more tokens (and from
        then on); how it is held (guard or close) is kept for ``apply``."""
        req = self._requests.get(request_id)
        if req is None or self.closing_search is None:
            return False
        if req.hold is Hold.CLOSE:
            return True
        if req.hold is None:
            if req.last_cost is None and budget > CLOSING_HORIZON:  # learn what closing costs
                plan = None if self._is_free_text(req) else self._plan(req)
                req.last_cost = 0 if plan is None else plan.num_tokens
            horizon = 2 * (req.last_cost or 0) + _margin(req.last_cost or 0) + GUARD_TOKENS
            if budget > max(CLOSING_HORIZON, horizon):
                return False
        if req.matcher.is_completed():  # it may end here: between calls, or in free text
            if self._is_free_text(req):
                return False  # free text ends as unconstrained text does
            req.hold = Hold.CLOSE  # no new call on what is left
            return True
        plan = self._plan(req)
        if plan is None or budget <= plan.num_tokens + _margin(plan.num_tokens):
            req.hold = Hold.CLOSE  # (no way known: close at once)
        elif budget <= plan.num_tokens + _margin(plan.num_tokens) + GUARD_TOKENS:
            req.hold = Hold.GUARD
        return req.hold is not None

    def draft_room(self, request_id: str, budget: int) -> int:
        """The draft tokens the request may have verified in its next step, ``budget`` tokens
        before its end. Holds are decided once a step, on its first row, so a step must not
        carry the request past the point where it would be held: none once it is held, and
        while it is not, no more than leaves it above its guard's start (the last known cost)."""
        req = self._requests.get(request_id)
        if req is None or self.closing_search is None:
            return budget
        if req.hold is not None:
            return 0
        cost = req.last_cost or 0
        return max(0, budget - 1 - (cost + _margin(cost) + GUARD_TOKENS))

    def cost_to_close(self, request_id: str) -> int | None:
        """The tokens the shortest way to the end of the output takes from here, the stop token
        included; None when the search found none."""
        req = self._requests[request_id]
        if req.matcher.is_completed():
            return 1
        plan = self._plan(req)
        return None if plan is None else plan.num_tokens

    def _is_free_text(self, req: _Constrained) -> bool:
        return bool(req.matcher.is_completed()) and bool(req.matcher.fork().accept_string("x"))

    def _plan(self, req: _Constrained, exact: bool = False) -> Closing | None:
        """The way out from the request's state: the last search's while the output has
        followed its way (or, unless ``exact``, added only content since); else a new one."""
        search = self.closing_search
        assert search is not None
        if req.plan is not None and req.plan_base <= len(req.token_ids):
            since = search.vocab.text(req.token_ids[req.plan_base:])
            rest = req.plan.after(since, search.vocab, exact)
            if rest is not None:
                return rest
        plan = search.search(self._shadow(req), req.grammar, at_start=not req.token_ids)
        req.plan, req.plan_base = plan, len(req.token_ids)
        if plan is not None:
            req.last_cost = plan.num_tokens
        return plan

    def _shadow(self, req: _Constrained) -> Any:
        """The search's matcher, brought to the request's output so far."""
        search = self.closing_search
        assert search is not None
        if req.shadow is None:
            req.shadow = search.shadow(req.grammar)
            req.shadow_base = len(req.token_ids)
            text = search.vocab.text(req.token_ids)
            if text and not req.shadow.accept_string(text):
                req.shadow = None  # cannot happen: the grammar took these tokens
                return search.shadow(req.grammar)
        return req.shadow

    def apply(self, logits: torch.Tensor, request_ids: list[str],
              drafts: Mapping[str, list[int]] | None = None,
              outputs: Mapping[str, Sequence[int]] | None = None,
              closing: Collection[str] = ()) -> list[str]:
        """Mask, in place, the rows of ``logits`` whose request is constrained.

        Rows come in ``request_ids`` order, 1 + ``len(drafts[rid])`` per request: a drafting
        request's row i follows its tokens and ``draft[:i]``, so its mask is the grammar's after
        those draft tokens (accepted, the masks filled, then rolled back).

        ``outputs``: the requests' output token ids so far; a verbatim loop at their end has
        the token that would continue it masked out of the first row
        (``agentd.structured.repetition``). ``closing``: requests near their budget
        (``needs_closing``), whose rows are held as it decided, where the grammar allows.

        Returns the constrained requests whose grammar allows no token at all (a dead end that
        a correct grammar never reaches); their rows are left unmasked.
        """
        drafts, outputs = drafts or {}, outputs or {}
        rows: list[tuple[str, int, list[int]]] = []  # (request id, first row, draft)
        num_rows = 0
        for rid in request_ids:
            draft = drafts.get(rid, [])
            if rid in self._requests:
                rows.append((rid, num_rows, draft))
            num_rows += 1 + len(draft)
        if not rows:
            return []
        import xgrammar as xgr

        bitmask = self._bitmask_rows(num_rows)
        masked, dead = [], []
        for rid, first, draft in rows:
            if not self._fill(rid, bitmask, first):
                dead.append(rid)
                continue
            _ban_loop(bitmask[first], outputs.get(rid, ()))
            if rid in closing:
                self._hold(rid, bitmask[first])
            masked.extend(self._fill_draft_rows(rid, bitmask, first, draft, rid in closing))
        if masked:
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size,
                                            indices=masked)
        return dead

    def _fill_draft_rows(self, rid: str, bitmask: torch.Tensor, first: int,
                         draft: list[int], closing: bool = False) -> list[int]:
        """Rows ``first + 1 ..``: the grammar after each draft token; the matcher is left as it
        was. A row after a draft token the grammar refuses repeats the mask before it (the
        verification stops at that token anyway)."""
        num_accepted = 0
        for i, token_id in enumerate(draft, start=1):
            if num_accepted == i - 1 and self.accept(rid, token_id):
                num_accepted += 1
                if self._fill(rid, bitmask, first + i):
                    if closing:
                        self._hold(rid, bitmask[first + i])
                    continue
            bitmask[first + i] = bitmask[first + i - 1]
        self.rollback(rid, num_accepted)
        return list(range(first, first + len(draft) + 1))

    def legal_prefix(self, request_id: str, draft: list[int]) -> list[int]:
        """The longest prefix of ``draft`` the request's grammar accepts next."""
        num_accepted = 0
        for token_id in draft:
            if not self.accept(request_id, token_id):
                break
            num_accepted += 1
        self.rollback(request_id, num_accepted)
        return draft[:num_accepted]

    def _fill(self, request_id: str, bitmask: torch.Tensor, row: int) -> bool:
        """Fill ``bitmask[row]``; False when no token is legal (or the matcher cannot say: one
        request's grammar must never fail the whole batch's step)."""
        matcher = self._requests[request_id].matcher
        try:
            if matcher.is_terminated():
                return False
            matcher.fill_next_token_bitmask(bitmask, row)
        except Exception:
            return False
        return bool(bitmask[row].any())

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher; False if the grammar rejects the token."""
        req = self._requests.get(request_id)
        if req is None:
            return True
        if req.matcher.is_terminated():
            return False  # asked here, not by feeding it: xgrammar logs a warning for each
        try:
            ok = bool(req.matcher.accept_token(token_id))
        except Exception:  # a matcher that refuses by raising
            return False
        if ok:
            req.token_ids.append(token_id)
            if req.shadow is not None and self._search is not None:
                text = self._search.vocab.text([token_id])
                if text and not req.shadow.accept_string(text):
                    req.shadow = None  # out of step (cannot happen): built again when needed
        return ok

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Undo the matcher's last ``num_tokens`` accepted tokens."""
        if not num_tokens:
            return
        req = self._requests[request_id]
        req.matcher.rollback(num_tokens)
        undone = req.token_ids[len(req.token_ids) - num_tokens:]
        del req.token_ids[len(req.token_ids) - num_tokens:]
        if req.shadow is not None and self._search is not None:
            if len(req.token_ids) < req.shadow_base:
                req.shadow = None  # built again when needed
            else:
                num_steps = sum(1 for t in undone if self._search.vocab.text([t]))
                if num_steps:
                    req.shadow.rollback(num_steps)

    def is_terminated(self, request_id: str) -> bool:
        """True once the grammar is complete and its stop token accepted."""
        req = self._requests.get(request_id)
        return req is not None and bool(req.matcher.is_terminated())

    def forced_text(self, request_id: str) -> str:
        """The text the grammar allows next and nothing else ("" when there is a choice, or
        without a vocabulary), at most ``agentd.structured.forced.MAX_FORCED_BYTES`` of it:
        walked on the request's shadow matcher, as xgrammar's own walk has no bound."""
        req = self._requests.get(request_id)
        search = self.closing_search
        if req is None or search is None:
            return ""
        return search.forced_text(self._shadow(req))

    def _hold(self, request_id: str, row: torch.Tensor) -> None:
        """Hold a row of a request near its budget as ``needs_closing`` decided: to the next
        token of the way out (close), or to content and that token (guard). Where the way
        cannot go on, the row keeps the grammar's mask."""
        req = self._requests[request_id]
        stops = [t for t in self._stop_ids if allowed(row, t)]
        if stops:
            keep = torch.zeros_like(row)  # the output may end here: it does
            _set_allowed(keep, stops[0], True)
            row.copy_(keep)
            return
        vocab = self.closing_search.vocab if self.closing_search is not None else None
        if vocab is None:
            return
        if req.hold is Hold.GUARD:
            plan = self._plan(req)
            if plan is not None:
                keep = row & vocab.content_mask(plan.content)
                for token_id in vocab.prefix_ids(plan.text):
                    _set_allowed(keep, token_id, allowed(row, token_id))
                if bool(keep.any()):
                    row.copy_(keep)
                    return
        plan = self._plan(req, exact=True)  # (a guard with nothing left: the way from here)
        token_id = None if plan is None else vocab.longest(plan.text, row)
        if token_id is not None:
            row.zero_()
            _set_allowed(row, token_id, True)

    def _bitmask_rows(self, num_rows: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            import xgrammar as xgr

            self._bitmask = xgr.allocate_token_bitmask(max(num_rows, 8), self.vocab_size)
        return self._bitmask[:num_rows]


def _margin(cost: int) -> int:
    return CLOSING_MARGIN + int(MARGIN_PER_TOKEN * cost)


def _ban_loop(row: torch.Tensor, output_ids: Sequence[int]) -> None:
    """Clear the bits of the tokens that would repeat an earlier run verbatim, unless nothing
    would be left (then the grammar itself ends the value soon)."""
    tokens = loop_tokens(output_ids)
    if not tokens:
        return
    kept = row.clone()
    for token_id in tokens:
        _set_allowed(kept, token_id, False)
    if bool(kept.any()):
        row.copy_(kept)


def _set_allowed(row: torch.Tensor, token_id: int, allowed: bool) -> None:
    """Set or clear ``token_id``'s bit in one int32 bitmask row. The word is handled as
    unsigned and written back in int32's range (bit 31 is the sign bit)."""
    word, bit = divmod(token_id, 32)
    value = int(row[word]) & 0xFFFFFFFF
    value = value | (1 << bit) if allowed else value & ~(1 << bit)
    row[word] = value - (1 << 32) if value >= 1 << 31 else value
