"""Engine-side pins: prefill a named prefix, hold its blocks, credit hits, diagnose near misses,
and gather/restore the pinned KV of a snapshot (the files are :mod:`agentd.pin_snapshots`).

Runs on the engine thread only. Invariants: a pin is registered only after every one of its
blocks holds computed KV; a snapshot is restored only when the model fingerprint, the cache salt,
the token ids and every tensor shape match (else ``SnapshotMismatch``, and the caller
recomputes); a pin lives in its owner's name space and is hashed with its owner's cache salt.
"""

from __future__ import annotations

import re
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass
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
    common_prefix_len,
)
from agentd.near_miss import Span, describe, find_span
from agentd.request import Request
from agentd.retention import RetainedStat, retained_stats
from agentd.runner import copy_kv
from agentd.scheduler import ScheduledRequest

_NEAR_MISS_KEEP = 256
_NEAR_MISS_RECENT = 10  # how many of the latest near misses observers see
_CONTEXT_CHARS = 48
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
_DATE_TIME = re.compile(
    r"\d{4}-\d{2}-\d{2}|\d{1,2}:\d{2}|\b(?:19|20)\d{2}\b|"
    r"\b(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)[a-z]*\b|"
    r"\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\b|\btoday\b|\bdate\b",
    re.IGNORECASE,
)


def tenant_salt(tenant: str | None) -> str | None:
    """The cache salt of a tenant's requests and pins (None: the shared, unsalted cache)."""
    return None if tenant is None else f"tenant:{tenant}"


class SnapshotMismatch(ValueError):
    """A snapshot that loaded but does not fit this pin, model or pool; the pin is recomputed."""


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
class NearMissCount:
    owner: str | None  # the pin's tenant
    pin: str
    cause: str
    count: int


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
        self.near_misses: deque[NearMiss] = deque(maxlen=_NEAR_MISS_KEEP)
        self.near_miss_counts: Counter[tuple[PinKey, str]] = Counter()

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
    @staticmethod
    def snapshot_shape(pin: Pin, kv_caches: list[torch.Tensor]
                       ) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of the buffer ``gather_snapshot`` fills with the pin's full blocks."""
        first = kv_caches[0]
        return (len(kv_caches), pin.num_blocks, *first.shape[1:]), first.dtype

    def gather_snapshot(self, pin: Pin, kv_caches: list[torch.Tensor], fingerprint: str,
                        out: torch.Tensor | None = None) -> dict[str, Any]:
        """Copy the pin's KV out of the pool (on the engine thread, so no step writes under it);
        :func:`agentd.pin_snapshots.write_snapshot` writes the result from another thread.

        ``out``: a buffer of ``snapshot_shape`` whose pages another thread has touched already,
        so the engine thread only copies (a fresh 100 MB buffer cost it 4x as long, page faults
        included).
        """
        first = kv_caches[0]
        index = torch.tensor(pin.block_ids, dtype=torch.long, device=first.device)
        shape, dtype = self.snapshot_shape(pin, kv_caches)
        if out is None or tuple(out.shape) != shape or out.dtype != dtype or out.is_cuda:
            out = torch.empty(shape, dtype=dtype)
        # One layer at a time into one buffer: stacking per-layer copies held the pin's KV twice
        # (+95 MB of RSS for a 2,064-token pin of the default model).
        for saved, layer in zip(out, kv_caches, strict=True):
            if layer.device == out.device:
                torch.index_select(layer, 0, index, out=saved)
            else:
                saved.copy_(layer.index_select(0, index))
        kv = out
        payload = {"fingerprint": fingerprint, "cache_salt": pin.cache_salt,
                   "token_ids": pin.token_ids, "kv": kv}
        if pin.tail_block is not None:  # [layers, 2, tail tokens, Hkv, D]
            num_tail = len(pin.tail_token_ids)
            payload["tail_token_ids"] = pin.tail_token_ids
            payload["tail_kv"] = torch.stack([layer[pin.tail_block, :, :num_tail].cpu()
                                              for layer in kv_caches])
        return payload

    def restore_snapshot(self, pending: PendingPin, kv_caches: list[torch.Tensor],
                         payload: dict[str, Any], fingerprint: str) -> PinResult:
        """Copy a loaded snapshot into fresh blocks and pin them.

        Raises SnapshotMismatch (nothing changes) when it does not fit this pin and model, and
        PinError when the pin cannot be added.
        """
        block_size = self.kv_cache.block_size
        num_blocks = len(pending.token_ids) // block_size
        kv = _check_snapshot(payload, pending, kv_caches, fingerprint, num_blocks * block_size)
        tail = pending.token_ids[num_blocks * block_size:]
        tail_kv = payload.get("tail_kv")
        if not tail or payload.get("tail_token_ids") != tail or not isinstance(
                tail_kv, torch.Tensor) or tuple(tail_kv.shape) != (
                len(kv_caches), 2, len(tail), *kv_caches[0].shape[3:]):
            tail, tail_kv = [], None  # an older snapshot: the pin goes without its tail
            pending.token_ids = pending.token_ids[:num_blocks * block_size]
        self.registry.check_can_add(pending.key, num_blocks=num_blocks + bool(tail))
        request_id = f"pin-restore-{pending.name}"
        cached = self.kv_cache.find_cached_prefix(pending.token_ids, pending.cache_salt)
        if self.kv_cache.allocate(request_id, len(pending.token_ids), cached) is None:
            raise PinError("the pool has no room for the snapshot's blocks")
        copy_kv(kv_caches, self.kv_cache.take_copies())  # before the snapshot writes over them
        table = self.kv_cache.block_table(request_id)
        num_reused = len(cached.block_ids)
        new_ids = torch.tensor(table[num_reused:num_blocks], dtype=torch.long)
        for layer, saved in zip(kv_caches, kv, strict=True):
            layer.index_copy_(0, new_ids.to(layer.device),
                              saved[num_reused:].to(device=layer.device, dtype=layer.dtype))
        if tail_kv is not None:
            self._hold_tail(request_id, pending, table[num_blocks])
            for layer, saved in zip(kv_caches, tail_kv, strict=True):
                layer[table[num_blocks], :, :len(tail)] = saved.to(device=layer.device,
                                                                   dtype=layer.dtype)
        self.kv_cache.cache_blocks(request_id, pending.token_ids, num_blocks * block_size,
                                   pending.cache_salt, cached.block_hashes)
        result = self._register(request_id, pending, restored=True)
        self.kv_cache.free(request_id)  # the pin's own references keep the blocks
        return result

    # --- observability ---------------------------------------------------------------------
    def summary(self, expired: tuple[str, ...] = ()) -> PinSummary:
        """An immutable copy of the pins' counters and the latest near misses (cheap: a few
        pins, a small counter)."""
        if (not len(self.registry) and not self.near_misses and not expired
                and not len(self.registry.retained)):
            return _EMPTY_SUMMARY
        pins = tuple(PinStat(p.name, p.num_tokens, p.num_blocks_held, p.num_hits,
                             p.num_tokens_served, p.ttl_s, p.last_hit_s, p.created_s, p.owner)
                     for p in self.registry)
        counts = tuple(NearMissCount(key.owner, key.name, cause, n)
                       for (key, cause), n in self.near_miss_counts.most_common())
        recent = tuple(self.near_misses)[-_NEAR_MISS_RECENT:]
        return PinSummary(pins, counts, recent, sum(self.near_miss_counts.values()), expired,
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
            self._check_near_miss(candidate, request, hashes)

    def _check_near_miss(self, pin: Pin, request: Request, hashes: list[bytes]) -> None:
        if request.cache_salt != pin.cache_salt:
            return  # another tenant's (or salt's) prompt is none of this pin's business
        num_equal = 0
        for mine, theirs in zip(pin.block_hashes, hashes, strict=False):
            if mine != theirs:
                break
            num_equal += 1
        tokens = request.all_token_ids
        pin_tokens = pin.all_token_ids
        start = num_equal * self.kv_cache.block_size
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
        self.near_misses.append(miss)
        self.near_miss_counts[(key, miss.cause)] += 1

    def _context(self, token_ids: list[int], index: int) -> str:
        before = self.tokenizer.decode(token_ids[max(0, index - 24):index])
        after = self.tokenizer.decode(token_ids[index:index + 12])
        return (before[-_CONTEXT_CHARS:] + "⟦" + after[:_CONTEXT_CHARS]).replace("\n", "\\n")


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


def _check_snapshot(payload: dict[str, Any], pending: PendingPin, kv_caches: list[torch.Tensor],
                    fingerprint: str, num_full_tokens: int) -> torch.Tensor:
    """The snapshot's full-block KV, once it is known to fit; else SnapshotMismatch."""
    kv = payload.get("kv")
    num_blocks = num_full_tokens // kv_caches[0].shape[2]
    if payload.get("fingerprint") != fingerprint:
        raise SnapshotMismatch("it was taken with another model, dtype or tokenizer")
    if payload.get("cache_salt") != pending.cache_salt:
        raise SnapshotMismatch("it was taken under another cache salt (tenant)")
    if payload.get("token_ids") != pending.token_ids[:num_full_tokens]:
        raise SnapshotMismatch("its tokens differ from the pin's (the template changed?)")
    if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != (
            len(kv_caches), num_blocks, *kv_caches[0].shape[1:]):
        raise SnapshotMismatch("its KV tensor has the wrong shape for this model and pool")
    if kv.dtype != kv_caches[0].dtype:  # the fingerprint says so too; never convert silently
        raise SnapshotMismatch(f"its KV is {kv.dtype}, the pool's {kv_caches[0].dtype} "
                               "(another --kv-cache-dtype)")
    return kv


def _split_at_divergence(text: str) -> tuple[str, str]:
    before, _, after = text.partition("⟦")
    return before, after

