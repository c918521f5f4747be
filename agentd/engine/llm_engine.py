"""The synchronous engine: requests in, one scheduled step at a time, deltas out.

A step is schedule -> run -> process, as nano-vllm and vLLM v1 do it: the scheduler picks the
rows and the KV copies they need (:mod:`agentd.engine.scheduler`), the runner copies and runs one
forward (:mod:`agentd.engine.model_runner`), the sampler draws under the output constraints, the
output processor appends the tokens and decides who finished
(:mod:`agentd.engine.output_processor`), and the scheduler then caches and frees blocks.
``docs/lifecycle.md`` follows one request through it.

Invariant: every request added ends with exactly one delta whose ``finish_reason`` is set, and by
then its blocks are back in the pool. Not thread-safe: :mod:`agentd.engine.async_engine` drives it
from one thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from agentd.cache import KVCacheManager, PinKey
from agentd.config import EngineConfig
from agentd.engine.conversation_tails import TailKeeper
from agentd.engine.kv_publisher import KVEventPublisher, open_kv_events
from agentd.engine.kv_sizing import (
    KVPlan,
    KVRequest,
    MemoryProbe,
    dtype_name,
    free_memory_bytes,
    kv_fingerprint,
    plan_kv_cache,
    proc_status_bytes,
    resolve_kv_dtype,
    tensor_bytes,
)
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
from agentd.engine.scheduler import ScheduledRequest, Scheduler
from agentd.engine.spec_decode import make_speculator
from agentd.kernels import get_attention_backend
from agentd.model.build import LoadedModel, load_model
from agentd.model.llama import ModelDims
from agentd.pins.manager import PendingPin, PinManager, PinResult
from agentd.pins.snapshots import gather_snapshot, snapshot_shape
from agentd.structured.compiler import GrammarCompiler
from agentd.structured.matchers import StructuredOutputs

logger = logging.getLogger("agentd")
DOES_NOT_FIT = "the request does not fit in the KV cache pool"


@dataclass
class EngineStats:
    num_requests_running: int
    num_requests_waiting: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_blocks_total: int
    num_blocks_free: int
    num_blocks_cached: int
    num_blocks_used: int
    kv_cache_usage: float
    prompt_tokens_total: int
    generation_tokens_total: int
    num_requests_finished: int
    num_steps: int
    num_model_tokens: int  # tokens that actually went through the model (prefill + decode)
    num_blocks_pinned: int
    num_pins: int
    num_jump_forward_tokens: int = 0  # output tokens a grammar forced, appended without a step
    num_retained: int = 0  # prefixes held by cache control (retention), not by name
    num_blocks_retained: int = 0  # blocks they hold that no pin holds too
    num_retained_expired: int = 0  # decayed at their TTL
    num_retained_displaced: int = 0  # decayed early: the pin budget needed room
    spec_num_drafts: int = 0  # request-steps that verified draft tokens
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    num_tail_blocks: int = 0  # stored conversations' last partial blocks (conversation_tails)
    kv_cache: KVPlan | None = None  # the pool's dtype and size, the context and any cap reason
    load_s: float | None = None  # how long loading the model took (None: it was handed in)


def _model_len(dims: ModelDims) -> int:
    """The longest context the model attends over (full attention equals a sliding window up
    to the window's length, not past it)."""
    if dims.sliding_window is not None:
        return min(dims.max_position_embeddings, dims.sliding_window)
    return dims.max_position_embeddings


class _Sampled(NamedTuple):
    token_ids: dict[str, list[int]]  # per sampling request: accepted drafts, then its token
    dead_ends: set[str]  # constrained requests whose grammar allowed no token


def _plan_pool(config: EngineConfig, loaded: LoadedModel, kv_dtype: torch.dtype,
               memory_probe: MemoryProbe, unresident: int) -> KVPlan:
    """The KV pool's size: from ``--kv-cache-memory``, else from the free memory."""
    free_bytes = memory_probe(loaded.device) if config.kv_cache_memory_bytes is None else None
    model = loaded.model
    return plan_kv_cache(KVRequest(
        dtype_name(kv_dtype), config.block_size,
        ModelRunner.kv_bytes_per_block(model, config.block_size, kv_dtype),
        _model_len(model.dims), config.max_num_seqs, config.max_model_len,
        config.kv_cache_memory_bytes), free_bytes, unresident)


def _log_plan(plan: KVPlan, backend_name: str) -> None:
    if plan.cap_reason is not None:
        logger.warning("max_model_len %d, below the model's %d: %s", plan.max_model_len,
                       plan.model_len, plan.cap_reason)
    logger.info("%s; attention backend %s", plan.describe(), backend_name)


def _load_timed(config: EngineConfig) -> tuple[LoadedModel, float, int]:
    """Load the model; also how long it took and, on the CPU, how many of its weights' bytes
    are not in anonymous memory (memory-mapped, or never touched): ``MemAvailable`` counts those
    as free, yet they take memory once decode reads them. (A GPU's free memory already excludes
    the weights on it.)"""
    anon_before = proc_status_bytes("RssAnon") or 0
    start = time.perf_counter()
    loaded = load_model(config)
    load_s = time.perf_counter() - start
    if loaded.device.type != "cpu":
        return loaded, load_s, 0
    grown = max((proc_status_bytes("RssAnon") or 0) - anon_before, 0)
    return loaded, load_s, max(tensor_bytes(loaded.model) - grown, 0)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 memory_probe: MemoryProbe = free_memory_bytes) -> None:
        """``memory_probe``: the free memory the auto-sized pool is budgeted from (injectable,
        so a test can size for any machine)."""
        self.config = config
        self.load_s: float | None = None  # how long load_model took here (None: handed one)
        unresident = 0
        if loaded is None:
            loaded, self.load_s, unresident = _load_timed(config)
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.files.name
        self.vocab_size = loaded.model.dims.vocab_size
        kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, loaded.dtype, loaded.weights,
                                    loaded.device)
        # The pool's content is keyed by what produced it, its dtype included.
        self.fingerprint = kv_fingerprint(loaded.fingerprint, loaded.dtype, kv_dtype)
        self.kv_plan = _plan_pool(config, loaded, kv_dtype, memory_probe, unresident)
        self.num_blocks = self.kv_plan.num_blocks
        self.max_model_len = self.kv_plan.max_model_len
        backend = get_attention_backend(config.attention_backend, loaded.device)
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
        self.scheduler = Scheduler(self.kv_cache, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.max_model_len)
        self.runner = ModelRunner(loaded.model, self.num_blocks, config.block_size,
                                  loaded.device, kv_dtype, backend)
        self.sampler = Sampler(loaded.device)
        self.speculator = make_speculator(config.speculative)
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, loaded.eos_token_ids)
        self.structured = StructuredOutputs(self.vocab_size, self.grammars.decoded_vocab,
                                            loaded.eos_token_ids)
        self.processor = OutputProcessor(loaded.eos_token_ids, self.max_model_len,
                                         self.tokenizer, self.structured, config.jump_forward)
        self.pin_results: dict[str, PinResult] = {}  # finished pin prefills, by request id
        self.expired_pins: list[PinKey] = []  # pins whose TTL lapsed, for the registry owner
        self._ids = itertools.count()
        self._totals = {"prompt": 0, "generation": 0, "finished": 0, "steps": 0, "model": 0}
        _log_plan(self.kv_plan, backend.name)

    def add_request(self, request: EngineRequest) -> str:
        """Queue a request; returns its id (``request.request_id``, or one made here).

        Raises ValueError for a prompt ``check_prompt`` refuses or an id in use, GrammarError
        for a constraint that does not compile (nothing changes either way). A request without
        its compiled ``grammar`` gets its constraint compiled here. Its ``retention`` is held
        once its prompt is computed (its deltas report ``num_retained_tokens``); with
        ``keep_tail`` its partial last block is held once it finishes, until
        ``tails.release(request_id)``.
        """
        request_id = request.request_id or f"req-{next(self._ids)}"
        if request_id in self.processor:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_prompt(request.prompt_token_ids, self.max_model_len, self.vocab_size)
        params = request.params
        grammar = request.grammar
        if params.structured_outputs is not None and grammar is None:
            grammar = self.grammars.compile(params.structured_outputs)
        room = self.max_model_len - len(request.prompt_token_ids)
        max_output = room if params.max_tokens is None else min(params.max_tokens, room)
        running = Request(request_id, list(request.prompt_token_ids), params,
                          max(max_output, 1), request.cache_salt, request.owner)
        self.scheduler.add_request(running)
        self.processor.add(running)
        if grammar is not None:
            self.structured.add(request_id, grammar)
        if request.retention is not None:
            self.retention.track(request_id, request.retention)
        self._totals["prompt"] += running.num_prompt_tokens
        if request.keep_tail:
            self.tails.want(request_id)
        return request_id

    def abort_request(self, request_id: str) -> StreamDelta | None:
        """Stop a request now and free its blocks; returns its final delta if it was live."""
        if self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED) is None:
            return None
        return self._last_delta(request_id)
    def add_pin(self, name: str, token_ids: list[int], ttl_s: float | None = None,
                meta: dict | None = None, request_id: str | None = None,
                owner: str | None = None, cache_salt: str | None = None) -> str:
        """Start prefilling a pin in ``owner``'s name space, hashed with ``cache_salt``; its
        PinResult lands in ``pin_results[request_id]`` when done.

        Raises PinError (nothing changes) when the name is taken or the budget would overflow.
        """
        self.pins.check_can_add(PinKey(owner, name), token_ids, cache_salt)
        request_id = request_id or f"pin-{name}-{next(self._ids)}"
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        self.add_request(EngineRequest(token_ids, params, request_id, cache_salt, owner))
        self.pins.pending[request_id] = PendingPin(name, list(token_ids), ttl_s, dict(meta or {}),
                                                   time.monotonic(), owner=owner,
                                                   cache_salt=cache_salt)
        return request_id

    def restore_pin(self, name: str, token_ids: list[int], payload: dict, ttl_s: float | None,
                    meta: dict | None = None, owner: str | None = None,
                    cache_salt: str | None = None) -> PinResult:
        """Pin from a loaded KV snapshot without recomputing. Raises SnapshotMismatch when it
        does not fit (nothing changes), PinError when the pin cannot be added."""
        pending = PendingPin(name, list(token_ids), ttl_s, dict(meta or {}), time.monotonic(),
                             owner=owner, cache_salt=cache_salt)
        return self.pins.restore_snapshot(pending, self.runner.kv_caches, payload,
                                          self.fingerprint)

    def pin_snapshot_shape(self, key: PinKey | str) -> tuple[tuple[int, ...], torch.dtype]:
        return snapshot_shape(self.pins.registry.get(key), self.runner.kv_caches)

    def gather_pin_snapshot(self, key: PinKey | str, out: torch.Tensor | None = None) -> dict:
        """A copy of the pin's KV (into ``out`` when it fits) and what identifies it, for a
        snapshot written elsewhere."""
        return gather_snapshot(self.pins.registry.get(key), self.runner.kv_caches,
                               self.fingerprint, out)

    def unpin(self, key: PinKey | str) -> None:
        """Drop a pin; its blocks become ordinary cached blocks. Raises PinNotFoundError."""
        self.pins.registry.remove(key)

    def retain(self, token_ids: list[int], hold: RetentionRequest, cache_salt: str | None = None,
               owner: str | None = None) -> Retained | None:
        """Hold the cached whole blocks of ``token_ids[:hold.num_tokens]`` now, for ``owner``
        (see ``RetentionManager.retain``); None when nothing could be held."""
        return self.retention.retain(token_ids, hold, cache_salt, owner)

    def expire_pins(self) -> None:
        now = time.monotonic()
        for key in self.pins.registry.expired(now):
            self.pins.registry.remove(key)
            self.expired_pins.append(key)
        self.retention.expire(now)

    def close(self) -> None:
        """Release what outlives a step: the KV-event publisher sends what it has queued."""
        if isinstance(self.kv_events, KVEventPublisher):
            self.kv_events.close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[StreamDelta]:
        """Schedule, run, process: one forward over the batch, then each request's news."""
        out = self.scheduler.schedule()
        self._admitted([self.scheduler.requests[rid] for rid in out.admitted_ids])
        deltas = [self._failed(request_id) for request_id in out.failed_ids]
        self.runner.copy_kv(out.kv_copies)
        if out.empty:
            return deltas
        result = self.runner.execute(out.scheduled)
        self.pins.keep_tails(out.scheduled)
        self._totals["steps"] += 1
        self._totals["model"] += result.num_tokens
        requests = [self.scheduler.requests[rid] for rid in result.request_ids]
        sampled = self._sample(requests, result.logits, out.scheduled)
        self.processor.process(requests, sampled.token_ids, sampled.dead_ends)
        self.scheduler.update_from_output(out, sampled.token_ids)
        items, now = {item.request_id: item for item in out.scheduled}, time.monotonic()
        deltas += [self._news(request, items[request.request_id], now) for request in requests]
        self._propose_drafts()
        return deltas

    def _admitted(self, requests: list[Request]) -> None:
        """First admissions: credit the pins and retained prefixes they hit."""
        for request in requests:
            self.pins.on_admitted(request)
            self.retention.on_admitted(request)

    def _failed(self, request_id: str) -> StreamDelta:
        """The scheduler finished this request: it can never fit in the pool."""
        self.processor.fail(request_id, DOES_NOT_FIT)
        return self._last_delta(request_id)

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
        """A processed request's delta, once what it computed is held (retention) and, if it
        finished, its tail kept."""
        retained = self.retention.after_compute(request)
        if retained is not None:
            self.processor.note_retained(request.request_id, retained.num_tokens)
        if request.first_token_time_s is None:
            request.first_token_time_s = now
        if not request.status.finished:
            return self.processor.delta(request.request_id, finished=False)
        self.tails.on_finished(request, item)
        return self._last_delta(request.request_id)

    def _propose_drafts(self) -> None:
        self.speculator.propose(self.scheduler.running, self.scheduler.num_waiting)
        for request in self.scheduler.running:  # a constrained request drafts what it may write
            if request.spec_token_ids and request.request_id in self.structured:
                room = self.structured.draft_room(
                    request.request_id, request.max_output_tokens - request.num_output_tokens)
                request.spec_token_ids = self.structured.legal_prefix(
                    request.request_id, request.spec_token_ids[:room])

    def _last_delta(self, request_id: str) -> StreamDelta:
        """A finished request's last delta; everything kept about it goes."""
        delta = self.processor.delta(request_id, finished=True)
        if request_id in self.pins.pending:
            result = self.pins.complete(request_id,
                                        failed=delta.error or delta.finish_reason == "abort")
            if result is not None:
                self.pin_results[request_id] = result
        self.retention.forget(request_id)
        self.tails.forget(request_id)
        self.sampler.forget(request_id)
        self.speculator.forget(request_id)
        self.structured.remove(request_id)
        self._totals["finished"] += 1
        self._totals["generation"] += delta.num_output_tokens
        return delta

    def stats(self) -> EngineStats:
        pool = self.kv_cache.pool
        sched = self.scheduler.stats
        return EngineStats(
            num_requests_running=self.scheduler.num_running,
            num_requests_waiting=self.scheduler.num_waiting,
            prefix_cache_queries=sched.prefix_cache_queries,
            prefix_cache_hits=sched.prefix_cache_hits,
            num_preemptions=sched.num_preemptions,
            num_blocks_total=pool.num_blocks,
            num_blocks_free=pool.num_free - pool.num_cached_free,
            num_blocks_cached=pool.num_cached_free,
            num_blocks_used=pool.num_used,
            kv_cache_usage=pool.usage,
            prompt_tokens_total=self._totals["prompt"],
            generation_tokens_total=self._totals["generation"],
            num_requests_finished=self._totals["finished"],
            num_steps=self._totals["steps"],
            num_model_tokens=self._totals["model"],
            num_blocks_pinned=self.pins.registry.num_pinned_blocks,
            num_pins=len(self.pins.registry),
            num_jump_forward_tokens=self.processor.num_jump_forward_tokens,
            num_retained=len(self.pins.registry.retained),
            num_blocks_retained=self.pins.registry.num_retained_blocks,
            num_retained_expired=self.retention.num_expired,
            num_retained_displaced=self.pins.registry.num_retained_displaced,
            spec_num_drafts=self.speculator.stats.num_drafts,
            spec_num_draft_tokens=self.speculator.stats.num_draft_tokens,
            spec_num_accepted_tokens=self.speculator.stats.num_accepted_tokens,
            num_tail_blocks=len(self.tails),
            kv_cache=self.kv_plan,
            load_s=self.load_s,
        )
