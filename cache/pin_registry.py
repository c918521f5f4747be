"""Pin registry: named prefixes whose blocks are held by a reference, so they are never evicted.

A pin is a reference held by a named owner: pin = touch, unpin = free. Pinned blocks therefore
have ``ref_cnt > 0`` and never reach the free queue; the evictor needs no "pinned" flag.
Pins are scoped by tenant: a pin is found by its ``PinKey`` (tenant, name), so two tenants may
each hold a pin of the same name, and its blocks are hashed under its tenant's cache salt, so
only that tenant's requests ever match it. ``owner=None`` is the server-wide name space.

Retention is the same mechanism (design §9): a retained prefix (:mod:`.retained`) is a hold
with an expiry, counted in the same budget. Pins come first: a pin is checked against pins
alone, and when it is added the retained prefixes make room for it, least recently used first;
a new retained prefix likewise displaces older ones, never a pin.
Invariants: a pin holds exactly one reference on each of its blocks (its owner in the cache
manager's ``holders``, beside requests' tables and retained prefixes); the distinct blocks held by
pins and retained prefixes together never exceed ``max_pinned_blocks``; a refused pin or
retention changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .hashing import BlockHash
from .holders import PIN, Owner
from .kv_cache_manager import KVCacheManager
from .retained import RetainedPrefix, RetainedPrefixes
from .tails import KeptTail


class PinError(Exception):
    """A pin request that cannot be honoured; ``status`` is the HTTP status that fits."""

    status = 400


class PinExistsError(PinError):
    status = 409


class PinNotFoundError(PinError):
    status = 404


class PinBudgetError(PinError):
    status = 409

    def __init__(self, name: str, num_needed: int, num_left: int, max_blocks: int) -> None:
        super().__init__(
            f"pin {name!r} needs {num_needed} more pinned blocks but only {num_left} of the "
            f"{max_blocks}-block pin budget are left; unpin something or raise "
            "--max-pinned-fraction"
        )
        self.num_needed = num_needed
        self.num_left = num_left


class PinKey(NamedTuple):
    """Who a pin belongs to and its name within that tenant's name space."""

    owner: str | None  # the tenant that registered it; None: the server-wide name space
    name: str


def pin_key(key: PinKey | str) -> PinKey:
    """A bare name is the server-wide pin of that name."""
    return key if isinstance(key, PinKey) else PinKey(None, key)


@dataclass
class Pin:
    name: str
    token_ids: list[int]
    block_ids: list[int]
    block_hashes: list[BlockHash]
    created_s: float  # wall-clock time of registration
    ttl_s: float | None
    last_hit_s: float  # monotonic time of registration or of the latest hit
    num_hits: int = 0
    num_tokens_served: int = 0
    meta: dict[str, Any] = field(default_factory=dict)  # opaque to the cache (source text...)
    # The prefix's last partial block: its tokens and the block holding their KV (the pin holds
    # a reference on it; it is never in the prefix cache, which keeps full blocks only).
    tail_token_ids: list[int] = field(default_factory=list)
    tail_block: int | None = None
    owner: str | None = None  # the tenant whose name space and cache salt the pin lives in
    cache_salt: str | None = None  # the salt its blocks were hashed with (its owner's)

    @property
    def key(self) -> PinKey:
        return PinKey(self.owner, self.name)

    @property
    def all_token_ids(self) -> list[int]:
        return self.token_ids + self.tail_token_ids

    @property
    def num_tokens(self) -> int:
        """Every token the pin serves: its full blocks' and its tail's."""
        return len(self.token_ids) + len(self.tail_token_ids)

    @property
    def num_blocks(self) -> int:
        """Full blocks (the ones in the prefix cache)."""
        return len(self.block_ids)

    @property
    def held_block_ids(self) -> list[int]:
        """Every block the pin holds a reference on: its full blocks, then its tail block."""
        return self.block_ids + ([self.tail_block] if self.tail_block is not None else [])

    @property
    def num_blocks_held(self) -> int:
        return len(self.held_block_ids)


@dataclass(frozen=True)
class PinCounts:
    """What pins and retained prefixes hold, copied at one moment."""

    num_pins: int
    num_blocks_pinned: int
    num_retained: int  # prefixes held by cache control (retention), not by name
    num_blocks_retained: int  # blocks they hold that no pin holds too
    num_retained_displaced: int  # decayed early: the pin budget needed room


class PinRegistry:
    def __init__(self, kv_cache: KVCacheManager, max_pinned_blocks: int) -> None:
        self.kv_cache = kv_cache
        self.max_pinned_blocks = max_pinned_blocks
        self.holders = kv_cache.holders  # a pin's owner holds its blocks (kind PIN)
        self._pins: dict[PinKey, Pin] = {}
        self.retained = RetainedPrefixes(kv_cache)
        self.num_retained_displaced = 0  # retained prefixes decayed early to fit the budget

    def __iter__(self) -> Iterator[Pin]:
        return iter(list(self._pins.values()))

    def __len__(self) -> int:
        return len(self._pins)

    def __contains__(self, key: PinKey | str) -> bool:
        return pin_key(key) in self._pins

    def get(self, key: PinKey | str) -> Pin:
        key = pin_key(key)
        if key not in self._pins:
            raise PinNotFoundError(f"no pin named {key.name!r}")
        return self._pins[key]

    def holds(self, block_id: int) -> bool:
        return self.holders.holds(PIN, block_id)

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct blocks held by pins (pins sharing a prefix share its blocks)."""
        return self.holders.num_distinct(PIN)

    @property
    def num_retained_blocks(self) -> int:
        """Distinct blocks held by retained prefixes and by no pin."""
        return sum(1 for b in self.retained.block_ids() if not self.holds(b))

    @property
    def num_held_blocks(self) -> int:
        """Distinct blocks held by pins or retained prefixes: what the budget bounds."""
        return self.num_pinned_blocks + self.num_retained_blocks

    def counts(self) -> PinCounts:
        return PinCounts(len(self), self.num_pinned_blocks, len(self.retained),
                        self.num_retained_blocks, self.num_retained_displaced)

    def check_can_add(self, key: PinKey | str, block_ids: Sequence[int] | None = None,
                      num_blocks: int = 0) -> None:
        """Raise if ``key`` is taken or the blocks would exceed the budget; changes nothing.

        Args:
            key: the pin's tenant and name.
            block_ids: the exact blocks, when known (shared ones cost nothing).
            num_blocks: otherwise, an upper bound on the new blocks.
        """
        key = pin_key(key)
        if key in self._pins:
            raise PinExistsError(f"a pin named {key.name!r} already exists; unpin it first")
        if block_ids is not None:
            num_blocks = len({b for b in block_ids if not self.holds(b)})
        num_left = self.max_pinned_blocks - self.num_pinned_blocks
        if num_blocks > num_left:
            raise PinBudgetError(key.name, num_blocks, num_left, self.max_pinned_blocks)

    def add(self, name: str, token_ids: Sequence[int], block_ids: Sequence[int],
            block_hashes: Sequence[BlockHash], now_s: float, created_s: float,
            ttl_s: float | None = None, meta: dict[str, Any] | None = None,
            tail_token_ids: Sequence[int] = (), tail_block: int | None = None,
            owner: str | None = None, cache_salt: str | None = None) -> Pin:
        """Pin ``block_ids`` (the full blocks of ``token_ids``) under ``name`` in ``owner``'s name
        space; ``block_hashes`` were computed with ``cache_salt``.

        ``tail_block`` holds the KV of ``tail_token_ids`` (fewer than a block), the tokens that
        follow; the pin takes a reference on it too (the caller drops its own) and indexes it in
        ``kv_cache.tails``, so that requests hit it.

        Returns:
            The new pin. Raises PinError (nothing changes) on a taken name or budget overrun.
        """
        if len(block_ids) != len(block_hashes) or len(token_ids) != len(block_ids) * (
                self.kv_cache.block_size):
            raise ValueError("a pin covers whole blocks: token, block and hash counts disagree")
        if (tail_block is None) != (not tail_token_ids) or len(tail_token_ids) >= (
                self.kv_cache.block_size):
            raise ValueError("a pin's tail is a partial block: fewer tokens than a block, and "
                             "a block exactly when there are tokens")
        pin = Pin(name, list(token_ids), list(block_ids), list(block_hashes), created_s, ttl_s,
                  now_s, meta=dict(meta or {}), tail_token_ids=list(tail_token_ids),
                  tail_block=tail_block, owner=owner, cache_salt=cache_salt)
        self.check_can_add(pin.key, pin.held_block_ids)
        self.holders.hold(Owner(PIN, pin.key), pin.held_block_ids)
        if tail_block is not None:
            self.kv_cache.tails.add(Owner(PIN, pin.key), KeptTail(
                tail_block, pin.num_blocks, pin.block_hashes[-1], tuple(tail_token_ids)),
                preferred=True)
        self._pins[pin.key] = pin
        self._fit_retention(set())
        return pin

    def remove(self, key: PinKey | str) -> Pin:
        """Unpin: drop the pin's references; its full blocks become ordinary cached (LRU)
        blocks, its tail block a free one."""
        pin = self.get(key)
        del self._pins[pin.key]
        self.kv_cache.tails.remove(Owner(PIN, pin.key))
        self.holders.release(Owner(PIN, pin.key))  # the tail block first, then the prefix's
        return pin

    def match(self, block_hashes: Sequence[BlockHash]) -> Pin | None:
        """The longest pin whose whole prefix starts ``block_hashes`` (a request's chain)."""
        best: Pin | None = None
        for pin in self._pins.values():
            n = pin.num_blocks
            if n <= len(block_hashes) and block_hashes[n - 1] == pin.block_hashes[-1]:
                if best is None or n > best.num_blocks:
                    best = pin
        return best

    def record_hit(self, pin: Pin, num_tokens: int, now_s: float) -> None:
        pin.num_hits += 1
        pin.num_tokens_served += num_tokens
        pin.last_hit_s = now_s

    def expired(self, now_s: float) -> list[PinKey]:
        """Pins whose TTL passed without a hit (they should decay to LRU)."""
        return [p.key for p in self._pins.values()
                if p.ttl_s is not None and now_s - p.last_hit_s > p.ttl_s]

    # --- retention -------------------------------------------------------------------------
    def retain(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash],
               num_tokens: int, ttl_s: float, now_s: float, created_s: float,
               owner: str | None = None, preview: str = "") -> RetainedPrefix | None:
        """Hold the cached full blocks ``block_ids`` (a prefix whose chain is ``block_hashes``)
        until ``now_s + ttl_s``; the same prefix retained again is refreshed instead.

        Older retained prefixes decay, least recently used first, until the budget has room;
        pins are never displaced.

        Returns:
            The retained prefix, or None when even without any retention the pins leave no room
            for it (nothing changes then: the blocks stay ordinary cached blocks).
        """
        if not block_ids or len(block_ids) != len(block_hashes):
            raise ValueError("a retained prefix is one or more whole blocks, each with its hash")
        existing = self.retained.get(block_hashes[-1])
        if existing is not None:
            existing.refresh(now_s, ttl_s)
            return existing
        beyond_pins = {b for b in block_ids if not self.holds(b)}
        if self.num_pinned_blocks + len(beyond_pins) > self.max_pinned_blocks:
            return None
        self._fit_retention(beyond_pins)
        prefix = RetainedPrefix(list(block_ids), list(block_hashes), num_tokens, ttl_s,
                                now_s + ttl_s, now_s, created_s, owner, preview=preview)
        self.retained.add(prefix)
        return prefix

    def release_retained(self, key: BlockHash) -> RetainedPrefix:
        """Let a retained prefix decay to LRU now (its TTL passed)."""
        return self.retained.remove(key)

    def _fit_retention(self, wanted: set[int]) -> None:
        """Decay retained prefixes, least recently used first, until the blocks of ``wanted``
        that nothing holds yet fit the budget too (pins alone always fit: they were checked on
        their own, and so was ``wanted`` beside them)."""
        while self.num_held_blocks + sum(1 for b in wanted if not self.retained.holds(b) and (
                not self.holds(b))) > self.max_pinned_blocks:
            oldest = self.retained.oldest()
            if oldest is None:
                return
            self.retained.remove(oldest.key)
            self.num_retained_displaced += 1
