"""Engine-side pins: prefill a named prefix (or restore it from a snapshot), hold its blocks,
credit hits and record near misses (:mod:`agentd.pins.near_miss`), and copy the pins' numbers for
observers. Snapshots' KV and files are :mod:`agentd.pins.snapshots`.

Runs on the engine thread only. Invariants: a pin is registered only after every one of its
blocks holds computed KV; a pin lives in its owner's name space and is hashed with its owner's
cache salt; a prefilled tail is held (``PIN_PREFILL``) until the pin holds it or is refused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from agentd.cache import (
    PIN_PREFILL,
    KVCacheManager,
    Owner,
    Pin,
    PinError,
    PinExistsError,
    PinKey,
    PinRegistry,
)
from agentd.engine.model_runner import copy_kv
from agentd.engine.request import Request
from agentd.engine.retention import RetainedStat, retained_stats
from agentd.engine.scheduler import ScheduledRequest
from agentd.pins.near_miss import NearMiss, NearMissCount, PinNearMisses
from agentd.pins.snapshots import check_snapshot, put_snapshot, snapshot_tail


def tenant_salt(tenant: str | None) -> str | None:
    """The cache salt of a tenant's requests and pins (None: the shared, unsalted cache)."""
    return None if tenant is None else f"tenant:{tenant}"


@dataclass(frozen=True)
class PinStat:
    """One pin's numbers, copied on the engine thread for readers on other threads."""

    name: str
    num_tokens: int
    num_blocks: int
    num_hits: int
    num_tokens_served: int
    ttl_s: float | None
    last_hit_s: float  # monotonic
    created_s: float  # wall clock
    owner: str | None = None


@dataclass(frozen=True)
class PinSummary:
    """Everything observers need about pins, immutable so it can cross threads as is."""

    pins: tuple[PinStat, ...] = ()
    near_miss_counts: tuple[NearMissCount, ...] = ()  # top first
    recent_near_misses: tuple[NearMiss, ...] = ()  # newest last
    num_near_misses: int = 0
    expired: tuple[PinKey, ...] = ()  # pins decayed by TTL that the registry owner has not synced
    retained: tuple[RetainedStat, ...] = ()  # prefixes held by cache control, newest use first


@dataclass
class PendingPin:
    name: str
    token_ids: list[int]  # whole blocks, then the tail (fewer than a block)
    ttl_s: float | None
    meta: dict[str, Any]
    started_s: float
    tail_block: int | None = None  # once its KV is computed: the block, with our reference
    owner: str | None = None
    cache_salt: str | None = None

    @property
    def key(self) -> PinKey:
        return PinKey(self.owner, self.name)


@dataclass
class PinResult:
    pin: Pin | None
    error: Exception | None
    elapsed_s: float
    restored: bool  # KV came from a snapshot instead of a prefill


_EMPTY_SUMMARY = PinSummary()


class PinManager:
    def __init__(self, kv_cache: KVCacheManager, tokenizer, max_pinned_blocks: int) -> None:
        self.kv_cache = kv_cache
        self.tokenizer = tokenizer
        self.registry = PinRegistry(kv_cache, max_pinned_blocks)
        self.pending: dict[str, PendingPin] = {}  # request id -> pin being prefilled
        self.near_misses = PinNearMisses(tokenizer, kv_cache.block_size)

    # --- registration ----------------------------------------------------------------------
    def check_can_add(self, key: PinKey, token_ids: list[int],
                      cache_salt: str | None = None) -> None:
        """Raise PinError (409/400) before any work when the pin cannot be added."""
        if key in self.registry:
            raise PinExistsError(f"a pin named {key.name!r} already exists; unpin it first")
        if any(p.key == key for p in self.pending.values()):
            raise PinExistsError(f"a pin named {key.name!r} is being registered already")
        num_blocks = len(token_ids) // self.kv_cache.block_size
        if num_blocks == 0:
            raise PinError(f"the prefix is shorter than one block ({self.kv_cache.block_size} "
                           "tokens): nothing to pin")
        cached = self.kv_cache.find_cached_prefix(token_ids, cache_salt)
        already = sum(1 for b in cached.block_ids if self.registry.holds(b))
        has_tail = len(token_ids) % self.kv_cache.block_size != 0
        self.registry.check_can_add(key, num_blocks=num_blocks + has_tail - already)

    def keep_tails(self, scheduled: list[ScheduledRequest]) -> None:
        """After a forward: a pin prefill that just computed its last tokens keeps a reference
        on its partial last block (its request frees its own when it finishes), for the pin."""
        for item in scheduled:
            pending = self.pending.get(item.request_id)
            if pending is None or not item.sample:
                continue
            num_full, num_tail = divmod(len(pending.token_ids), self.kv_cache.block_size)
            if num_tail and pending.tail_block is None:
                self._hold_tail(item.request_id, pending, item.block_table[num_full])

    def _hold_tail(self, request_id: str, pending: PendingPin, block_id: int) -> None:
        pending.tail_block = block_id
        self.kv_cache.holders.hold(Owner(PIN_PREFILL, request_id), [block_id])

    def _drop_tail(self, request_id: str, pending: PendingPin) -> None:
        """The pin holds its tail now, or will never: the prefill's own reference goes."""
        self.kv_cache.holders.release(Owner(PIN_PREFILL, request_id))
        pending.tail_block = None

    def complete(self, request_id: str, failed: str | bool = False) -> PinResult | None:
        """Called when a pin's prefill request finishes: take references on its blocks."""
        pending = self.pending.pop(request_id, None)
        if pending is None:
            return None
        if failed:
            self._drop_tail(request_id, pending)
            reason = failed if isinstance(failed, str) else "the prefill was aborted"
            return PinResult(None, RuntimeError(reason), time.monotonic() - pending.started_s,
                             restored=False)
        return self._register(request_id, pending, restored=False)

    def _register(self, request_id: str, pending: PendingPin, restored: bool) -> PinResult:
        """Pin the prefilled (or restored) prefix; ``request_id`` holds its tail until then."""
        cached = self.kv_cache.find_cached_prefix(pending.token_ids, pending.cache_salt)
        num_blocks = len(pending.token_ids) // self.kv_cache.block_size
        elapsed = time.monotonic() - pending.started_s
        if len(cached.block_ids) < num_blocks:
            self._drop_tail(request_id, pending)
            return PinResult(None, RuntimeError("the pin's blocks were not all cached after its "
                                                "prefill (is prefix caching disabled?)"),
                             elapsed, restored)
        full = num_blocks * self.kv_cache.block_size
        tail = pending.token_ids[full:] if pending.tail_block is not None else []
        try:
            pin = self.registry.add(pending.name, pending.token_ids[:full],
                                    cached.block_ids, cached.block_hashes[:num_blocks],
                                    now_s=time.monotonic(), created_s=time.time(),
                                    ttl_s=pending.ttl_s, meta=pending.meta,
                                    tail_token_ids=tail, tail_block=pending.tail_block,
                                    owner=pending.owner, cache_salt=pending.cache_salt)
        except Exception as exc:
            self._drop_tail(request_id, pending)
            return PinResult(None, exc, elapsed, restored)
        self._drop_tail(request_id, pending)  # the pin took its own reference
        pin.meta["prefill_s" if not restored else "restore_s"] = elapsed
        return PinResult(pin, None, elapsed, restored)

    # --- snapshots -------------------------------------------------------------------------
    def restore_snapshot(self, pending: PendingPin, kv_caches: list[torch.Tensor],
                         payload: dict[str, Any], fingerprint: str) -> PinResult:
        """Copy a loaded snapshot into fresh blocks and pin them.

        Raises SnapshotMismatch (nothing changes) when it does not fit this pin and model, and
        PinError when the pin cannot be added.
        """
        block_size = self.kv_cache.block_size
        num_blocks = len(pending.token_ids) // block_size
        num_full = num_blocks * block_size
        kv = check_snapshot(payload, pending.token_ids, pending.cache_salt, kv_caches,
                            fingerprint, num_full)
        tail_kv = snapshot_tail(payload, pending.token_ids[num_full:], kv_caches)
        if tail_kv is None:  # an older snapshot: the pin goes without its tail
            pending.token_ids = pending.token_ids[:num_full]
        self.registry.check_can_add(pending.key, num_blocks=num_blocks + (tail_kv is not None))
        request_id = f"pin-restore-{pending.name}"
        cached = self.kv_cache.find_cached_prefix(pending.token_ids, pending.cache_salt)
        if self.kv_cache.allocate(request_id, len(pending.token_ids), cached) is None:
            raise PinError("the pool has no room for the snapshot's blocks")
        copy_kv(kv_caches, self.kv_cache.take_copies())  # before the snapshot writes over them
        table = self.kv_cache.block_table(request_id)
        num_reused = len(cached.block_ids)
        if tail_kv is not None:
            self._hold_tail(request_id, pending, table[num_blocks])
        put_snapshot(kv_caches, table[num_reused:num_blocks], kv[:, num_reused:],
                     None if tail_kv is None else (table[num_blocks], tail_kv))
        self.kv_cache.cache_blocks(request_id, pending.token_ids, num_full,
                                   pending.cache_salt, cached.block_hashes)
        result = self._register(request_id, pending, restored=True)
        self.kv_cache.free(request_id)  # the pin's own references keep the blocks
        return result

    # --- observability ---------------------------------------------------------------------
    def summary(self, expired: tuple[str, ...] = ()) -> PinSummary:
        """An immutable copy of the pins' counters and the latest near misses (cheap: a few
        pins, a small counter)."""
        near = self.near_misses
        if (not len(self.registry) and not len(near) and not expired
                and not len(self.registry.retained)):
            return _EMPTY_SUMMARY
        pins = tuple(PinStat(p.name, p.num_tokens, p.num_blocks_held, p.num_hits,
                             p.num_tokens_served, p.ttl_s, p.last_hit_s, p.created_s, p.owner)
                     for p in self.registry)
        return PinSummary(pins, near.top(), near.latest(), sum(near.counts.values()), expired,
                          retained_stats(self.registry))

    # --- accounting ------------------------------------------------------------------------
    def on_admitted(self, request: Request) -> None:
        """Credit a pin hit, or record a near miss, for a request admitted for the first time."""
        if not len(self.registry) or request.request_id in self.pending:
            return
        hashes = request.prompt_block_hashes(self.kv_cache.block_size)
        pin = self.registry.match(hashes)
        if pin is not None:
            request.pin_name = pin.name
            served = min(request.num_cached_tokens or 0, pin.num_tokens)
            self.registry.record_hit(pin, served, time.monotonic())
            return
        for candidate in self.registry:
            self.near_misses.check(candidate, request, hashes)
