"""Kept partial blocks ("tails"): the tokens right after a cached full-block chain, whose KV sits
in the first slots of a block of their own. A pin keeps its prefix's last partial block, a
stored conversation its last one; a request whose cached chain is one of theirs starts with
their slots copied into its own first new block (the scheduler's ``KVCopy``), so it computes
only what is really new.

Invariants: a tail is found only by the exact chain it hangs on (``parent_hash`` is the hash of
its chain's last full block, ``num_full_blocks`` its length) and only for the tokens it shares
with the request; the index holds no references (the tail's owner does, in ``BlockHolders``)
and its block is never written again while it is kept. Offered one tail per admission: the one
sharing the most tokens, a pin's before a conversation's when equal.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from .hashing import BlockHash

_CHUNK = 256


def common_prefix_len(a: Sequence[int], b: Sequence[int], i: int = 0, j: int = 0) -> int:
    """How many tokens ``a[i:]`` and ``b[j:]`` share at their start (slices compare in C)."""
    n = min(len(a) - i, len(b) - j)
    done = 0
    while done < n:
        end = min(done + _CHUNK, n)
        if a[i + done:i + end] == b[j + done:j + end]:
            done = end
            continue
        while done < end and a[i + done] == b[j + done]:  # (a list and a tuple: never equal)
            done += 1
        if done < end:
            return done
    return n


@dataclass(frozen=True)
class KeptTail:
    block_id: int
    num_full_blocks: int
    parent_hash: BlockHash
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class TailHit:
    block_id: int  # its first ``num_tokens`` slots hold the KV of the request's next tokens
    num_tokens: int


class TailIndex:
    """Every kept tail, by its owner, found by the chain it hangs on."""

    def __init__(self) -> None:
        self._tails: dict[Hashable, KeptTail] = {}
        self._by_parent: dict[BlockHash, dict[Hashable, None]] = {}
        self._use_order: OrderedDict[Hashable, None] = OrderedDict()  # least recent first

    def __len__(self) -> int:
        return len(self._tails)

    def add(self, owner: Hashable, tail: KeptTail, preferred: bool = False) -> None:
        """Index ``owner``'s tail; ``preferred`` (a pin's) wins a tie with the others."""
        self._tails[owner] = tail
        siblings = self._by_parent.setdefault(tail.parent_hash, {})
        if preferred:
            self._by_parent[tail.parent_hash] = {owner: None, **siblings}
        else:
            siblings[owner] = None
        self._use_order[owner] = None

    def remove(self, owner: Hashable) -> KeptTail | None:
        tail = self._tails.pop(owner, None)
        if tail is None:
            return None
        siblings = self._by_parent[tail.parent_hash]
        del siblings[owner]
        if not siblings:
            del self._by_parent[tail.parent_hash]
        del self._use_order[owner]
        return tail

    def least_recently_used(self, owners: Sequence[Hashable] | set[Hashable]) -> Hashable | None:
        """Of ``owners``, the one whose tail was kept or hit longest ago."""
        return next((owner for owner in self._use_order if owner in owners), None)

    def best(self, block_hashes: Sequence[BlockHash], next_tokens: list[int]) -> TailHit | None:
        """The tail hung on exactly ``block_hashes`` (a request's cached chain) that shares the
        most (at least one) leading tokens with ``next_tokens``; it becomes the most recently
        used."""
        best: tuple[Hashable, TailHit] | None = None
        for owner in self._by_parent.get(block_hashes[-1], ()) if block_hashes else ():
            tail = self._tails[owner]
            if tail.num_full_blocks != len(block_hashes):
                continue
            num_equal = common_prefix_len(list(tail.token_ids), next_tokens)
            if num_equal and (best is None or num_equal > best[1].num_tokens):
                best = (owner, TailHit(tail.block_id, num_equal))
        if best is None:
            return None
        self._use_order.move_to_end(best[0])
        return best[1]
