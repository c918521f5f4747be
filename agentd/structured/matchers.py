"""The engine's grammar matchers: one per constrained request, owned by the engine thread.

Invariant: a matcher has accepted exactly the request's output tokens so far, so each step's mask
allows exactly the tokens that keep the output a prefix of a sentence of the grammar. Rows of
unconstrained requests are never touched: their logits, and so their tokens, are what they would
be without any constrained request in the batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


class StructuredOutputs:
    """Matchers by request id; masks logits rows and advances matchers with sampled tokens."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._matchers: dict[str, Any] = {}
        self._bitmask: torch.Tensor | None = None

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def add(self, request_id: str, grammar: Any) -> None:
        import xgrammar as xgr

        self._matchers[request_id] = xgr.GrammarMatcher(grammar)

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def apply(self, logits: torch.Tensor, request_ids: list[str],
              drafts: Mapping[str, list[int]] | None = None) -> list[str]:
        """Mask, in place, the rows of ``logits`` whose request is constrained.

        Rows come in ``request_ids`` order, 1 + ``len(drafts[rid])`` per request: a drafting
        request's row i follows its tokens and ``draft[:i]``, so its mask is the grammar's after
        those draft tokens (accepted, the masks filled, then rolled back).

        Returns the constrained requests whose grammar allows no token at all (a dead end that
        a correct grammar never reaches); their rows are left unmasked.
        """
        drafts = drafts or {}
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
            masked.extend(self._fill_draft_rows(rid, bitmask, first, draft))
        if masked:
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size,
                                            indices=masked)
        return dead

    def _fill_draft_rows(self, rid: str, bitmask: torch.Tensor, first: int,
                         draft: list[int]) -> list[int]:
        """Rows ``first + 1 ..``: the grammar after each draft token; the matcher is left as it
        was. A row after a draft token the grammar refuses repeats the mask before it (the
        verification stops at that token anyway)."""
        matcher = self._matchers[rid]
        num_accepted = 0
        for i, token_id in enumerate(draft, start=1):
            if num_accepted == i - 1 and self.accept(rid, token_id):
                num_accepted += 1
                if self._fill(rid, bitmask, first + i):
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

    def _bitmask_rows(self, num_rows: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            import xgrammar as xgr

            self._bitmask = xgr.allocate_token_bitmask(max(num_rows, 8), self.vocab_size)
        return self._bitmask[:num_rows]
