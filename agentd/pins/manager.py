"""Engine-side pins: prefill a named prefix (or restore its stored KV), hold its blocks, credit
hits and record near misses (:mod:`agentd.pins.near_miss`), and copy the pins' numbers for
observers. A pin's KV out of and into the pool is :mod:`agentd.pins.snapshots`; on disk,
:mod:`agentd.pins.stored_kv`.

Runs on the engine thread only. Invariants: a pin is registered only after every one of its
blocks holds computed KV; a pin lives in its owner's name space and is hashed with its owner's
cache salt; a prefill's last partial block is taken by the pin as the prefill ends (freed just
now, nothing allocated since), or left free when the pin is refused.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agentd.cache import (
    KVCacheManager,
    PinError,
    PinExistsError,
    PinKey,
    PinRegistry,
)
from agentd.engine.hooks import RequestHooks
from agentd.engine.model_runner import copy_kv
from agentd.engine.outputs import StreamDelta
from agentd.engine.request import Request
from agentd.engine.retention import RetainedStat, retained_stats
from agentd.engine.scheduler import ScheduledRequest
from agentd.pins.near_miss import NearMiss, NearMissCount, PinNearMisses
from agentd.pins.pin_request import PinRequest, PinResult
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


@dataclass(frozen=True)
class PendingPin:
    """A pin whose prefill request is running."""

    pin: PinRequest
    started_s: float  # monotonic


_EMPTY_SUMMARY = PinSummary()


class PinManager(RequestHooks):
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
        if any(p.pin.key == key for p in self.pending.values()):
            raise PinExistsError(f"a pin named {key.name!r} is being registered already")
        num_blocks = len(token_ids) // self.kv_cache.block_size
        if num_blocks == 0:
            raise PinError(f"the prefix is shorter than one block ({self.kv_cache.block_size} "
                           "tokens): nothing to pin")
        cached = self.kv_cache.find_cached_prefix(token_ids, cache_salt)
        already = sum(1 for b in cached.block_ids if self.registry.holds(b))
        has_tail = len(token_ids) % self.kv_cache.block_size != 0
        self.registry.check_can_add(key, num_blocks=num_blocks + has_tail - already)

    def added(self, request: Request) -> None:
        if request.pin is not None:
            self.pending[request.request_id] = PendingPin(request.pin, time.monotonic())

    def finished(self, request: Request, item: ScheduledRequest | None,
                 delta: StreamDelta) -> None:
        """A pin's prefill ended: pin its blocks (its last partial block too, freed just now and
        nothing allocated since) and say how on its last delta."""
        pending = self.pending.pop(request.request_id, None)
        if pending is None:
            return
        if item is None or delta.error or delta.finish_reason == "abort":
            reason = delta.error or "the prefill was aborted"
            delta.pin_result = PinResult(None, RuntimeError(reason),
                                         time.monotonic() - pending.started_s, restored=False)
            return
        num_full = len(pending.pin.token_ids) // self.kv_cache.block_size
        tail_block = item.block_table[num_full] if len(item.block_table) > num_full else None
        delta.pin_result = self._register(request.request_id, pending.pin, pending.started_s,
                                          pending.pin.token_ids, tail_block, restored=False)

    def _register(self, request_id: str, pin: PinRequest, started_s: float,
                  token_ids: Sequence[int], tail_block: int | None,
                  restored: bool) -> PinResult:
        """Pin ``token_ids``, prefilled (or restored) by ``request_id``: its cached full blocks
        and, past them, ``tail_block``."""
        cached = self.kv_cache.find_cached_prefix(list(token_ids), pin.cache_salt)
        num_blocks = len(token_ids) // self.kv_cache.block_size
        elapsed = time.monotonic() - started_s
        if len(cached.block_ids) < num_blocks:
            return PinResult(None, RuntimeError("the pin's blocks were not all cached after its "
                                                "prefill (is prefix caching disabled?)"),
                             elapsed, restored)
        full = num_blocks * self.kv_cache.block_size
        tail = list(token_ids[full:]) if tail_block is not None else []
        meta = {**pin.meta, "request_id": request_id,
                "prefill_s" if not restored else "restore_s": elapsed}
        try:
            registered = self.registry.add(
                pin.name, list(token_ids[:full]), cached.block_ids,
                cached.block_hashes[:num_blocks], now_s=time.monotonic(),
                created_s=time.time(), ttl_s=pin.ttl_s, meta=meta, tail_token_ids=tail,
                tail_block=tail_block if tail else None, owner=pin.owner,
                cache_salt=pin.cache_salt)
        except Exception as exc:
            return PinResult(None, exc, elapsed, restored)
        return PinResult(registered, None, elapsed, restored)

    # --- snapshots -------------------------------------------------------------------------
    def restore_snapshot(self, pin: PinRequest, kv_caches: list[torch.Tensor],
                         payload: dict[str, Any], fingerprint: str) -> PinResult:
        """Copy a loaded snapshot into fresh blocks and pin them.

        Raises SnapshotMismatch (nothing changes) when it does not fit this pin and model, and
        PinError when the pin cannot be added.
        """
        started_s = time.monotonic()
        block_size = self.kv_cache.block_size
        token_ids = list(pin.token_ids)
        num_blocks = len(token_ids) // block_size
        num_full = num_blocks * block_size
        kv = check_snapshot(payload, token_ids, pin.cache_salt, kv_caches, fingerprint, num_full)
        tail_kv = snapshot_tail(payload, token_ids[num_full:], kv_caches)
        if tail_kv is None:  # an older snapshot: the pin goes without its tail
            token_ids = token_ids[:num_full]
        self.registry.check_can_add(pin.key, num_blocks=num_blocks + (tail_kv is not None))
        request_id = f"pin-restore-{pin.name}"
        cached = self.kv_cache.find_cached_prefix(token_ids, pin.cache_salt)
        if self.kv_cache.allocate(request_id, len(token_ids), cached) is None:
            raise PinError("the pool has no room for the snapshot's blocks")
        copy_kv(kv_caches, self.kv_cache.take_copies())  # before the snapshot writes over them
        table = self.kv_cache.block_table(request_id)
        num_reused = len(cached.block_ids)
        tail_block = table[num_blocks] if tail_kv is not None else None
        put_snapshot(kv_caches, table[num_reused:num_blocks], kv[:, num_reused:],
                     None if tail_kv is None else (table[num_blocks], tail_kv))
        self.kv_cache.cache_blocks(request_id, token_ids, num_full, pin.cache_salt,
                                   cached.block_hashes)
        result = self._register(request_id, pin, started_s, token_ids, tail_block,
                                restored=True)
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
    def admitted(self, request: Request) -> None:
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
