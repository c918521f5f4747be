"""The synchronous engine: requests in, one scheduled step at a time, deltas out.

A step is schedule -> run -> process, as nano-vllm and vLLM v1 do it: the scheduler picks the
rows and the KV copies they need (:mod:`agentd.engine.scheduler`), the runner copies and runs one
forward (:mod:`agentd.engine.model_runner`), the sampler draws under the output constraints, the
output processor appends the tokens and decides who finished
(:mod:`agentd.engine.output_processor`), and the scheduler then caches and frees blocks. What
else a request's life touches (its grammar, retention, kept tail, pin, generator, drafts) is the
components' hooks (:mod:`agentd.engine.hooks`), called in the order of ``LLMEngine.hooks``.
``docs/lifecycle.md`` follows one request through it.

Invariant: every request added ends with exactly one delta whose ``finish_reason`` is set, and by
then its blocks are back in the pool. Not thread-safe: :mod:`agentd.engine.async_engine` drives
it from one thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch

from agentd.cache import (
    BlockHash,
    DiskKVStore,
    KVCacheManager,
    Pin,
    PinCounts,
    PinKey,
    PoolStats,
    hash_blocks,
    hash_partial_block,
)
from agentd.config import EngineConfig
from agentd.engine.conversation_tails import TailKeeper
from agentd.engine.free_memory import free_memory
from agentd.engine.hooks import RequestHooks
from agentd.engine.kv_publisher import KVEventPublisher, open_kv_events
from agentd.engine.kv_sizing import (
    KVPlan,
    MemoryProbe,
    kv_fingerprint,
    load_timed,
    log_plan,
    plan_pool,
    resolve_kv_dtype,
)
from agentd.engine.kv_tier import DiskTierStats, open_disk_tier, open_store
from agentd.engine.model_runner import ModelRunner
from agentd.engine.output_processor import OutputProcessor
from agentd.engine.outputs import StreamDelta
from agentd.engine.request import (
    EngineRequest,
    Request,
    RequestStatus,
    RetentionRequest,
    check_prompt,
)
from agentd.engine.retention import Retained, RetentionManager
from agentd.engine.sampler import Sampler
from agentd.engine.sampling_params import SamplingParams
from agentd.engine.scheduler import ScheduledRequest, Scheduler, SchedulerStats
from agentd.engine.spec_decode import SpecStats, make_speculator
from agentd.kernels import get_attention_backend, kv_quant
from agentd.model.build import LoadedModel
from agentd.model.dispatch import KernelChoice
from agentd.pins.manager import PinManager, PinResult
from agentd.pins.pin_request import PinRequest
from agentd.pins.snapshots import gather_snapshot, snapshot_shape
from agentd.structured.compiler import GrammarCompiler
from agentd.structured.matchers import StructuredOutputs

logger = logging.getLogger("agentd")
DOES_NOT_FIT = "the request does not fit in the KV cache pool"


@dataclass
class EngineTotals:
    """The engine's own running counts since start."""

    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_requests_finished: int = 0
    num_steps: int = 0
    num_model_tokens: int = 0  # tokens that actually went through the model (prefill + decode)


@dataclass(frozen=True)
class EngineStats:
    """The engine's numbers after a step, each part copied from the component that keeps it;
    ``flat()`` is the one-level mapping ``/v1/stats`` and ``/metrics`` publish."""

    num_requests_running: int
    num_requests_waiting: int
    totals: EngineTotals
    scheduler: SchedulerStats  # prefix-cache queries and hits, preemptions
    pool: PoolStats
    pins: PinCounts  # pinned and retained blocks
    spec: SpecStats
    num_retained_expired: int = 0  # retained prefixes decayed at their TTL
    num_jump_forward_tokens: int = 0  # output tokens a grammar forced, appended without a step
    num_tail_blocks: int = 0  # stored conversations' last partial blocks (conversation_tails)
    kv_cache: KVPlan | None = None  # the pool's dtype and size, the context and any cap reason
    load_s: float | None = None  # how long loading the model took (None: it was handed in)
    kv_disk: DiskTierStats | None = None  # the disk tier under the pool (None: off)

    def flat(self) -> dict[str, Any]:
        """Every number under one name (speculation's prefixed ``spec_``); ``kv_cache`` as a
        dict."""
        out: dict[str, Any] = {"num_requests_running": self.num_requests_running,
                               "num_requests_waiting": self.num_requests_waiting}
        for part in (self.totals, self.scheduler, self.pool, self.pins):
            out.update(dataclasses.asdict(part))
        out.update({f"spec_{k}": v for k, v in dataclasses.asdict(self.spec).items()})
        out.update(num_retained_expired=self.num_retained_expired,
                   num_jump_forward_tokens=self.num_jump_forward_tokens,
                   num_tail_blocks=self.num_tail_blocks,
                   kv_cache=None if self.kv_cache is None else dataclasses.asdict(self.kv_cache),
                   load_s=self.load_s,
                   kv_disk=None if self.kv_disk is None else dataclasses.asdict(self.kv_disk))
        return out


class _Sampled(NamedTuple):
    token_ids: dict[str, list[int]]  # per sampling request: accepted drafts, then its token
    dead_ends: set[str]  # constrained requests whose grammar allowed no token


# How much slower a multiply-add of prompt attention runs than one of the linear layers.
# benchmarks/prefill_steps.py measures it: on the default model (float32, 2 AVX2 cores, chunks
# of 256) a step's time grows 0.574 s per 1,000 tokens of depth over 1.751 s at the start, a
# measured attention_context of 3,051 tokens against 3,072 from the shape: 1.0.
ATTENTION_SLOWDOWN = 1.0


def attention_context(dims: Any) -> float:
    """The context length at which one prompt row's attention costs what its linear layers do:
    the scheduler counts a row at position p as ``1 + p / attention_context`` of a step's
    prefill budget. From the model's shape: the linear layers' multiply-adds per row (q, k, v,
    o and the gated MLP) over attention's per context token (scores and values, every query
    head), times ``ATTENTION_SLOWDOWN``. SmolLM2-135M: ~3,100 tokens; a 1.7B without GQA:
    ~16,000."""
    q_rows = dims.num_heads * dims.head_dim
    kv_rows = dims.num_kv_heads * dims.head_dim
    linear = dims.hidden_size * (2 * q_rows + 2 * kv_rows + 3 * dims.intermediate_size)
    attention = 2 * q_rows * ATTENTION_SLOWDOWN
    return linear / attention


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 memory_probe: MemoryProbe = free_memory) -> None:
        """``memory_probe``: the free memory the auto-sized pool is budgeted from, and that an
        explicit pool must fit in (injectable, so a test can size for any machine)."""
        self.config = config
        self.load_s: float | None = None  # how long load_model took here (None: handed one)
        unresident = 0
        if loaded is None:
            loaded, self.load_s, unresident = load_timed(config)
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.files.name
        self.vocab_size = loaded.model.dims.vocab_size
        kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, loaded.dtype, loaded.weights,
                                    loaded.device)
        # The pool's content is keyed by what produced it, its dtype included.
        self.fingerprint = kv_fingerprint(loaded.fingerprint, loaded.dtype, kv_dtype)
        self.kv_plan = plan_pool(
            config, loaded, kv_dtype,
            ModelRunner.kv_bytes_per_block(loaded.model, config.block_size, kv_dtype),
            memory_probe, unresident)
        self.num_blocks = self.kv_plan.num_blocks
        self.max_model_len = self.kv_plan.max_model_len
        loaded.model.fit_context(self.max_model_len)  # the rotary table for the context served
        backend = get_attention_backend(config.attention_backend, loaded.device)
        if kv_quant.is_q8(kv_dtype) and backend.name == "triton":
            raise ValueError("--kv-cache-dtype q8_0 needs the cpu or torch attention backend")
        if backend.name == "cpu" and loaded.dtype == torch.float32:
            from agentd.kernels.cpu.fused import prefill_products

            products = prefill_products(kv_dtype, loaded.model.dims.head_dim)
            loaded.kernels["attention"] = KernelChoice(
                f"agentd's C++ decode and prefill attention, prefill products in {products}",
                None, "")
        # routers' KV events: every hash the pool stores or evicts (a null sink unless asked)
        self.kv_events = open_kv_events(config.kv_events, self.model_name, config.block_size,
                                        loaded.device.type)
        self.kv_cache = KVCacheManager(self.num_blocks, config.block_size,
                                       config.enable_prefix_caching,
                                       extra_key=self.fingerprint.encode(),
                                       move_cached_blocks=True,  # runs of consecutive blocks
                                       events=self.kv_events)
        self.pins = PinManager(self.kv_cache, self.tokenizer,
                               int(config.max_pinned_fraction * self.num_blocks))
        # conversations continued by token ids (stored responses) keep their last partial block
        self.tails = TailKeeper(self.kv_cache, max(1, self.num_blocks // 8))
        self.retention = RetentionManager(self.kv_cache, self.pins.registry, self.tokenizer)
        self.runner = ModelRunner(loaded.model, self.num_blocks, config.block_size,
                                  loaded.device, kv_dtype, backend)
        # blocks written behind the pool and read back into it (off without a directory)
        self.disk = open_disk_tier(config.kv_disk_dir, config.kv_disk_budget_bytes,
                                   self.fingerprint, config.block_size, self.runner.kv_caches,
                                   config.enable_prefix_caching)
        self._pin_stores: dict[Path, DiskKVStore] = {}  # pins' own, when the tier is off
        self._pin_store_lock = threading.Lock()
        if self.disk.enabled:
            self.kv_cache.on_cached = self.disk.stage
            self.kv_cache.pool.on_evicted = self.disk.restage  # a dropped write's last chance
            self.retention.on_held = partial(self.disk.stage, keep=True)  # kept for their TTL
            if isinstance(self.kv_events, KVEventPublisher):
                self.disk.publish(self.kv_events)
        self.scheduler = Scheduler(self.kv_cache, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.max_model_len,
                                   config.long_prefill_chunk,
                                   attention_context(loaded.model.dims), self.disk)
        self.sampler = Sampler(loaded.device)
        self.speculator = make_speculator(config.speculative)
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, loaded.eos_token_ids)
        self.structured = StructuredOutputs(self.vocab_size, self.grammars.decoded_vocab,
                                            loaded.eos_token_ids)
        self.processor = OutputProcessor(loaded.eos_token_ids, self.max_model_len,
                                         self.tokenizer, self.structured, config.jump_forward)
        # What each request's life touches besides its tokens, called in this order.
        self.hooks: tuple[RequestHooks, ...] = (self.structured, self.retention, self.tails,
                                                self.pins, self.sampler, self.speculator)
        self.expired_pins: list[PinKey] = []  # pins whose TTL lapsed, for the registry owner
        self._ids = itertools.count()
        self.totals = EngineTotals()
        log_plan(self.kv_plan, backend.name)

    def add_request(self, request: EngineRequest) -> str:
        """Queue a request; returns its id (``request.request_id``, or one made here).

        Raises ValueError for a prompt ``check_prompt`` refuses or an id in use,
        GrammarError for a constraint that does not compile (nothing changes either way). A
        request without its compiled ``grammar`` gets its constraint compiled here. Its
        ``retention`` is held once its prompt is computed (its deltas report
        ``num_retained_tokens``); with ``keep_tail`` its partial last block is held once it
        finishes, until ``tails.release(request_id)``; with a ``pin`` it is registered as the
        request ends (the last delta's ``pin_result``).
        """
        request_id = request.request_id or f"req-{next(self._ids)}"
        if request_id in self.processor:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_prompt(request.prompt_token_ids, self.max_model_len, self.vocab_size)
        params = request.params
        if params.structured_outputs is not None and request.grammar is None:
            request = dataclasses.replace(
                request, grammar=self.grammars.compile(params.structured_outputs))
        room = self.max_model_len - len(request.prompt_token_ids)
        max_output = room if params.max_tokens is None else min(params.max_tokens, room)
        running = Request.of(request_id, request, max(max_output, 1))
        self.scheduler.add_request(running)
        self.processor.add(running)
        for hooks in self.hooks:
            hooks.added(running)
        self.totals.prompt_tokens_total += running.num_prompt_tokens
        return request_id

    def abort_request(self, request_id: str) -> StreamDelta | None:
        """Stop a request now and free its blocks; returns its final delta if it was live."""
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        return None if request is None else self._last_delta(request, None)

    # --- pins ------------------------------------------------------------------------------
    def add_pin(self, pin: PinRequest, request_id: str | None = None) -> str:
        """Start prefilling ``pin``; returns its request's id. Its ``PinResult`` comes on that
        request's last delta (``pin_result``).

        Raises PinError (nothing changes) when the name is taken or the budget would overflow.
        """
        self.pins.check_can_add(pin.key, list(pin.token_ids), pin.cache_salt)
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        return self.add_request(EngineRequest(
            list(pin.token_ids), params, request_id or f"pin-{pin.name}-{next(self._ids)}",
            pin.cache_salt, pin.owner, pin=pin))

    def cancel_pin(self, request_id: str, key: PinKey) -> None:
        """Undo ``add_pin``'s request ``request_id`` whatever it reached: its prefill aborted,
        or the pin it registered removed."""
        self.abort_request(request_id)
        if key in self.pins.registry and self.pins.registry.get(key).meta.get(
                "request_id") == request_id:
            self.pins.registry.remove(key)

    def restore_pin(self, pin: PinRequest, payload: dict) -> PinResult:
        """Pin from a loaded KV snapshot without recomputing. Raises SnapshotMismatch when it
        does not fit (nothing changes), PinError when the pin cannot be added."""
        return self.pins.restore_snapshot(pin, self.runner.kv_caches, payload, self.fingerprint)

    def pin_snapshot_shape(self, key: PinKey | str) -> tuple[tuple[int, ...], torch.dtype]:
        return snapshot_shape(self.pins.registry.get(key), self.runner.kv_caches)

    def gather_pin_snapshot(self, key: PinKey | str, out: torch.Tensor | None = None) -> dict:
        """A copy of the pin's KV (into ``out`` when it fits) and what identifies it, for a
        snapshot written elsewhere."""
        return gather_snapshot(self.pins.registry.get(key), self.runner.kv_caches,
                               self.fingerprint, out)

    def get_pin(self, key: PinKey | str) -> Pin:
        """Raises PinNotFoundError."""
        return self.pins.registry.get(key)

    def list_pins(self) -> list[Pin]:
        return list(self.pins.registry)

    def unpin(self, key: PinKey | str) -> None:
        """Drop a pin; its blocks become ordinary cached blocks. Raises PinNotFoundError."""
        self.pins.registry.remove(key)

    def take_expired_pins(self) -> list[PinKey]:
        """The pins whose TTL lapsed since the last call (they decayed to LRU blocks)."""
        expired, self.expired_pins = self.expired_pins, []
        return expired

    def expire_pins(self) -> None:
        """Let pins and retained prefixes whose TTL lapsed decay to ordinary LRU blocks."""
        now = time.monotonic()
        for key in self.pins.registry.expired(now):
            self.pins.registry.remove(key)
            self.expired_pins.append(key)
        self.retention.expire(now)

    def retain(self, token_ids: list[int], hold: RetentionRequest, cache_salt: str | None = None,
               owner: str | None = None) -> Retained | None:
        """Hold the cached whole blocks of ``token_ids[:hold.num_tokens]`` now, for ``owner``
        (see ``RetentionManager.retain``); None when nothing could be held."""
        return self.retention.retain(token_ids, hold, cache_salt, owner)

    def close(self) -> None:
        """Release what outlives a step: the KV-event publisher sends what it has queued, the
        disk tier writes what it has."""
        if isinstance(self.kv_events, KVEventPublisher):
            self.kv_events.close()
        self.disk.close()
        for store in self._pin_stores.values():
            store.close()

    # --- pins' KV on disk (any thread) -----------------------------------------------------
    def pin_store(self, state_dir: Path) -> DiskKVStore:
        """The block store pins keep their KV in: the disk tier's when it is on, else one of
        their own at ``state_dir/kv-store`` (opened once a state dir), so pins persist without
        the tier."""
        if self.disk.enabled:
            return self.disk.store
        root = Path(state_dir).absolute() / "kv-store"
        with self._pin_store_lock:
            if root not in self._pin_stores:
                self._pin_stores[root] = open_store(root, self.fingerprint,
                                                    self.config.block_size, self.runner.kv_caches)
            return self._pin_stores[root]

    def pin_record_keys(self, token_ids: Sequence[int], cache_salt: str | None
                        ) -> list[BlockHash]:
        """The store keys of a pin's KV: its full blocks' chain hashes (the pool's), then its
        tail's (``hash_partial_block``) when it has one."""
        block_size = self.config.block_size
        keys = hash_blocks(token_ids, block_size, self.kv_cache.extra_key, cache_salt)
        tail = hash_partial_block(token_ids, block_size, self.kv_cache.extra_key, cache_salt,
                                  keys[-1] if keys else None)
        return keys + ([tail] if tail is not None else [])

    def kv_block_layout(self) -> tuple[int, tuple[int, ...], torch.dtype]:
        """(layers, one block's shape in a layer [2, block size, Hkv, D], the pool's dtype)."""
        first = self.runner.kv_caches[0]
        return len(self.runner.kv_caches), tuple(first.shape[1:]), first.dtype

    # --- the step --------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[StreamDelta]:
        """Schedule, run, process: one forward over the batch, then each request's news."""
        out = self.scheduler.schedule()
        for request in (self.scheduler.requests[rid] for rid in out.admitted_ids):
            for hooks in self.hooks:
                hooks.admitted(request)
        deltas = [self._failed(request_id) for request_id in out.failed_ids]
        self.runner.copy_kv(out.kv_copies)
        for job in out.loads:  # after the copies: one may touch a block the job writes
            self.disk.load(job)
        for block_ids, block_hashes in out.keeps:  # likewise: read once they hold their KV
            self.disk.stage(block_ids, block_hashes, keep=True)
        if out.empty:
            if self.scheduler.loading:  # nothing to run until a load lands: no busy loop
                self.disk.wait_for_landing(0.05)
            return deltas
        result = self.runner.execute(out.scheduled)
        self.totals.num_steps += 1
        self.totals.num_model_tokens += result.num_tokens
        requests = [self.scheduler.requests[rid] for rid in result.request_ids]
        sampled = self._sample(requests, result.logits, out.scheduled)
        self.processor.process(requests, sampled.token_ids, sampled.dead_ends)
        self.scheduler.update_from_output(out, sampled.token_ids)
        items, now = {item.request_id: item for item in out.scheduled}, time.monotonic()
        deltas += [self._news(request, items[request.request_id], now) for request in requests]
        self._propose_drafts()
        return deltas

    def _failed(self, request_id: str) -> StreamDelta:
        """The scheduler finished this request: it can never fit in the pool."""
        self.processor.fail(request_id, DOES_NOT_FIT)
        return self._last_delta(self.processor.request(request_id), None)

    def _sample(self, requests: list[Request], logits: torch.Tensor,
                scheduled: list[ScheduledRequest]) -> _Sampled:
        """Each request's new tokens (its accepted drafts, then one sampled token), the output
        constraints applied to its rows first."""
        drafts = {s.request_id: s.token_ids[len(s.token_ids) - s.num_draft_tokens:]
                  for s in scheduled if s.num_draft_tokens}
        constrained = [r for r in requests if r.request_id in self.structured]
        outputs = {r.request_id: r.output_token_ids for r in constrained}
        closing = {r.request_id for r in constrained if self.structured.needs_closing(
            r.request_id, r.max_output_tokens - r.num_output_tokens)}
        dead_ends = set(self.structured.apply(logits, [r.request_id for r in requests], drafts,
                                              outputs, closing))
        return _Sampled(self.speculator.sample(self.sampler, logits, requests, drafts),
                        dead_ends)

    def _news(self, request: Request, item: ScheduledRequest, now: float) -> StreamDelta:
        """A processed request's delta, once every component has seen what it computed."""
        for hooks in self.hooks:
            hooks.computed(request, item)
        if request.first_token_time_s is None:
            request.first_token_time_s = now
        if not request.status.finished:
            return self.processor.delta(request.request_id, finished=False)
        return self._last_delta(request, item)

    def _propose_drafts(self) -> None:
        self.speculator.propose(self.scheduler.running, self.scheduler.num_waiting)
        for request in self.scheduler.running:  # a constrained request drafts what it may write
            if request.spec_token_ids and request.request_id in self.structured:
                room = self.structured.draft_room(
                    request.request_id, request.max_output_tokens - request.num_output_tokens)
                request.spec_token_ids = self.structured.legal_prefix(
                    request.request_id, request.spec_token_ids[:room])

    def _last_delta(self, request: Request, item: ScheduledRequest | None) -> StreamDelta:
        """A finished request's last delta, once every component has let it go."""
        delta = self.processor.delta(request.request_id, finished=True)
        for hooks in self.hooks:
            hooks.finished(request, item, delta)
        self.totals.num_requests_finished += 1
        self.totals.generation_tokens_total += delta.num_output_tokens
        return delta

    def stats(self) -> EngineStats:
        return EngineStats(
            num_requests_running=self.scheduler.num_running,
            num_requests_waiting=self.scheduler.num_waiting,
            totals=dataclasses.replace(self.totals),
            scheduler=dataclasses.replace(self.scheduler.stats),
            pool=self.kv_cache.pool.stats(),
            pins=self.pins.registry.counts(),
            spec=dataclasses.replace(self.speculator.stats),
            num_retained_expired=self.retention.num_expired,
            num_jump_forward_tokens=self.processor.num_jump_forward_tokens,
            num_tail_blocks=len(self.tails),
            kv_cache=self.kv_plan,
            load_s=self.load_s,
            kv_disk=self.disk.stats(),
        )
