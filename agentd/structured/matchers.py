"""The engine's grammar matchers: one per constrained request, owned by the engine thread.

Invariant: a matcher has accepted exactly the request's output tokens so far, so each step's mask
allows exactly the tokens that keep the output a prefix of a sentence of the grammar. Rows of
unconstrained requests are never touched: their logits, and so their tokens, are what they would
be without any constrained request in the batch.

Two guards keep a small model's constrained output finite (it can loop inside a JSON string until
``max_tokens`` and leave a call that does not parse): a token that would repeat a long run
verbatim is masked (``agentd.structured.repetition``), and once a request has only the budget
it needs to finish (``cost_to_close``, estimated on a fork of its matcher) its mask is held to
one token of the cheapest way on: the open string's quote, a closing brace or bracket, the
shortest value, forced text, or the stop token where the output may end. Optional members are
left out, the forced rest (keys, braces, the call's closing tag) comes by jump-forward, draft
rows are held the same way, and no further call is opened with ``CLOSING_HORIZON`` tokens or
fewer left. Free text (the part of an "auto" turn before a call) is never cut short.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch

from agentd.structured.repetition import loop_tokens

CLOSING_HORIZON = 64  # budgets (tokens left) at which the cost of closing is checked
CLOSING_MARGIN = 6
# the cheapest ways on, in order: end a string, a structure or a number, else start the shortest
# value; in other places (a key, an enum, a string with a format or pattern) the model chooses
_CLOSING_STEPS = ('"', "}", "]", ",", "0", "1", "false", "null",
                  # the way out of an email address (format "email"), a character at a time
                  '@a.co"', 'a.co"', '.co"', 'co"', 'o"')
# for the estimate only, where the model chooses: any printable character on
_ANY_STEPS = (*string.ascii_letters, *string.digits, *string.punctuation, " ")
_MAX_CHOICES = 8  # more first characters than this: content, not a choice of keys or values
_CONTENT_REPEATS = 24  # a step the grammar takes this many times over is content, not a way out
MAX_TOKEN_BYTES = 32
_MAX_CLOSING_STEPS = 64


class StructuredOutputs:
    """Matchers by request id; masks logits rows and advances matchers with sampled tokens."""

    def __init__(self, vocab_size: int,
                 decoded_vocab: Callable[[], Sequence[bytes]] | None = None,
                 stop_token_ids: Sequence[int] = ()) -> None:
        self.vocab_size = vocab_size
        self._matchers: dict[str, Any] = {}
        self._bitmask: torch.Tensor | None = None
        self._decoded_vocab = decoded_vocab
        self._vocab_index: dict[bytes, int] | None = None  # built on first use
        self._vocab_text: dict[int, str] = {}
        self._closing: set[str] = set()
        self._stop_ids = [t for t in stop_token_ids if 0 <= t < vocab_size]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def add(self, request_id: str, grammar: Any) -> None:
        import xgrammar as xgr

        self._matchers[request_id] = xgr.GrammarMatcher(grammar)

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._closing.discard(request_id)

    def needs_closing(self, request_id: str, budget: int) -> bool:
        """True once the request must close its structure to finish within ``budget`` more
        tokens (and from then on)."""
        if request_id in self._closing:
            return True
        matcher = self._matchers.get(request_id)
        if budget > CLOSING_HORIZON or matcher is None:
            return False
        if matcher.is_completed():  # it may end here: between calls, or in free text
            if matcher.fork().accept_string("x"):
                return False  # free text ends as unconstrained text does
            self._closing.add(request_id)  # no new call on what is left
            return True
        cost = self.cost_to_close(request_id)
        # where the model chooses (a key, an enum) it may take a longer way than the estimate's
        if 2 * cost + CLOSING_MARGIN >= budget:
            self._closing.add(request_id)
            return True
        return False

    def cost_to_close(self, request_id: str) -> int:
        """About how many tokens the shortest way to the end of the output takes from here:
        forced text (as many tokens as greedy longest matches in the vocabulary, plus one), one
        token per closing step, and the stop token; estimated on a fork, the matcher is
        untouched."""
        return self._cost_from(self._matchers[request_id].fork())

    def _cost_from(self, fork: Any) -> int:
        """``cost_to_close`` of a forked matcher, which it advances."""
        cost = 1  # the stop token
        for _ in range(_MAX_CLOSING_STEPS):
            if fork.is_completed() or fork.is_terminated():
                return cost
            forced = fork.find_jump_forward_string()
            if forced:
                fork.accept_string(forced)
                cost += self._num_tokens(forced) + 1
                continue
            step = _closing_step(fork, estimate=True)
            if step is None:
                return cost + _MAX_CLOSING_STEPS  # no cheap way on: close at once
            fork.accept_string(step)
            cost += 1
        return cost

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
        (``needs_closing``), whose rows are held to closing tokens where the grammar allows
        one.

        Returns the constrained requests whose grammar allows no token at all (a dead end that
        a correct grammar never reaches); their rows are left unmasked.
        """
        drafts, outputs = drafts or {}, outputs or {}
        rows: list[tuple[str, int, list[int]]] = []  # (request id, first row, draft)
        num_rows = 0
        for rid in request_ids:
            draft = drafts.get(rid, [])
            if rid in self._matchers:
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
                self._close(rid, bitmask[first])
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
        matcher = self._matchers[rid]
        num_accepted = 0
        for i, token_id in enumerate(draft, start=1):
            if num_accepted == i - 1 and self.accept(rid, token_id):
                num_accepted += 1
                if self._fill(rid, bitmask, first + i):
                    if closing:
                        self._close(rid, bitmask[first + i])
                    continue
            bitmask[first + i] = bitmask[first + i - 1]
        if num_accepted:
            matcher.rollback(num_accepted)
        return list(range(first, first + len(draft) + 1))

    def legal_prefix(self, request_id: str, draft: list[int]) -> list[int]:
        """The longest prefix of ``draft`` the request's grammar accepts next."""
        matcher = self._matchers[request_id]
        num_accepted = 0
        for token_id in draft:
            if not self.accept(request_id, token_id):
                break
            num_accepted += 1
        if num_accepted:
            matcher.rollback(num_accepted)
        return draft[:num_accepted]

    def _fill(self, request_id: str, bitmask: torch.Tensor, row: int) -> bool:
        """Fill ``bitmask[row]``; False when no token is legal (or the matcher cannot say: one
        request's grammar must never fail the whole batch's step)."""
        matcher = self._matchers[request_id]
        try:
            if matcher.is_terminated():
                return False
            matcher.fill_next_token_bitmask(bitmask, row)
        except Exception:
            return False
        return bool(bitmask[row].any())

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher; False if the grammar rejects the token."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return True
        try:
            return bool(matcher.accept_token(token_id))
        except Exception:  # a terminated matcher refuses by raising
            return False

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Undo the matcher's last ``num_tokens`` accepted tokens."""
        if num_tokens:
            self._matchers[request_id].rollback(num_tokens)

    def is_terminated(self, request_id: str) -> bool:
        """True once the grammar is complete and its stop token accepted."""
        matcher = self._matchers.get(request_id)
        return matcher is not None and bool(matcher.is_terminated())

    def forced_text(self, request_id: str) -> str:
        """The text the grammar allows next and nothing else ("" when there is a choice)."""
        matcher = self._matchers.get(request_id)
        return "" if matcher is None else matcher.find_jump_forward_string()

    def _close(self, request_id: str, row: torch.Tensor) -> None:
        """Hold a row inside a structure to the token of its cheapest way on, if the row
        allows it."""
        if self._decoded_vocab is None:
            return
        stops = [t for t in self._stop_ids if _allowed(row, t)]
        if stops:  # the output may end here: it does
            token_id: int | None = stops[0]
        else:
            matcher = self._matchers[request_id]
            step = (matcher.find_jump_forward_string() or _closing_step(matcher)
                    or self._cheapest_choice(matcher))
            token_id = self._token_for(step) if step else None
        if token_id is None or not _allowed(row, token_id):
            return
        row.zero_()
        _set_allowed(row, token_id, True)

    def _cheapest_choice(self, matcher: Any) -> str | None:
        """Where the model would choose (a key, an enum value): the first character of the
        choice with the cheapest way to the end (a required key over an optional one)."""
        chars = [c for c in _ANY_STEPS if matcher.fork().accept_string(c)]
        if not chars or len(chars) > _MAX_CHOICES:
            return None  # content, not a choice: the model writes it
        costs = []
        for char in chars:
            fork = matcher.fork()
            fork.accept_string(char)
            costs.append((self._cost_from(fork), char))
        return min(costs)[1]

    def _num_tokens(self, text: str) -> int:
        """Tokens of ``text`` taken as greedy longest matches in the vocabulary."""
        count = 0
        while text:
            token_id = self._token_for(text)
            if token_id is None:
                return count + len(text.encode())
            text = text[len(self._vocab_text[token_id]):] if token_id in self._vocab_text else ""
            count += 1
        return count

    def _token_for(self, text: str) -> int | None:
        """The token whose text is the longest start of ``text``."""
        if self._vocab_index is None:
            assert self._decoded_vocab is not None
            self._vocab_index = {t: i for i, t in enumerate(self._decoded_vocab())
                                 if i < self.vocab_size and t}
            self._vocab_text = {i: t.decode(errors="replace")
                                for t, i in self._vocab_index.items()}
        data = text.encode()[:MAX_TOKEN_BYTES]
        for end in range(len(data), 0, -1):
            token_id = self._vocab_index.get(data[:end])
            if token_id is not None:
                return token_id
        return None

    def _bitmask_rows(self, num_rows: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            import xgrammar as xgr

            self._bitmask = xgr.allocate_token_bitmask(max(num_rows, 8), self.vocab_size)
        return self._bitmask[:num_rows]


def _closing_step(matcher: Any, estimate: bool = False) -> str | None:
    """The first closing step the grammar accepts here that is not content (a brace inside a
    string is content: it is accepted ``_CONTENT_REPEATS`` times over). Tried on forks.
    ``estimate``: failing those, any printable character the grammar accepts."""
    for step in _CLOSING_STEPS:
        if (matcher.fork().accept_string(step)
                and not matcher.fork().accept_string(step * _CONTENT_REPEATS)):
            return step
    if estimate:
        return next((c for c in _ANY_STEPS if matcher.fork().accept_string(c)), None)
    return None


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


def _allowed(row: torch.Tensor, token_id: int) -> bool:
    """Whether ``token_id``'s bit is set in one int32 bitmask row."""
    word, bit = divmod(token_id, 32)
    return bool((int(row[word]) >> bit) & 1)


def _set_allowed(row: torch.Tensor, token_id: int, allowed: bool) -> None:
    """Set or clear ``token_id``'s bit in one int32 bitmask row. The word is handled as
    unsigned and written back in int32's range (bit 31 is the sign bit)."""
    word, bit = divmod(token_id, 32)
    value = int(row[word]) & 0xFFFFFFFF
    value = value | (1 << bit) if allowed else value & ~(1 << bit)
    row[word] = value - (1 << 32) if value >= 1 << 31 else value
