"""The synchronous engine: requests in, one scheduled step at a time, deltas out.

Invariant: every request added ends with exactly one delta whose ``finish_reason`` is set, and by
then its blocks are back in the pool. Not thread-safe: :mod:`agentd.async_engine` drives it from
one thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agentd.cache import BlockHash, KVCacheManager, PinKey
from agentd.config import EngineConfig
from agentd.detokenizer import IncrementalDetokenizer
from agentd.kernels import get_attention_backend
from agentd.kv_sizing import (
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
from agentd.model.build import LoadedModel, load_model
from agentd.model.llama import ModelDims
from agentd.outputs import StreamDelta
from agentd.pins import PendingPin, PinManager, PinResult
from agentd.request import Request, RequestStatus
from agentd.retention import HoldRequest, Retained, RetentionManager
from agentd.runner import ModelRunner
from agentd.sampler import Sampler
from agentd.sampling_params import SamplingParams
from agentd.scheduler import Scheduler
from agentd.spec_decode import make_speculator
from agentd.structured.compiler import GrammarCompiler
from agentd.structured.jump_forward import plan_jump
from agentd.structured.matchers import StructuredOutputs
from agentd.tails import TailKeeper

logger = logging.getLogger("agentd")
GRAMMAR_DEAD_END = ("the output constraint allows no further token (a grammar dead end); the "
                    "output so far is kept")


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
    num_tail_blocks: int = 0  # stored conversations' last partial blocks (agentd.tails)
    kv_cache: KVPlan | None = None  # the pool's dtype and size, the context and any cap reason
    load_s: float | None = None  # how long loading the model took (None: it was handed in)


def _model_len(dims: ModelDims) -> int:
    """The longest context the model attends over (full attention equals a sliding window up
    to the window's length, not past it)."""
    if dims.sliding_window is not None:
        return min(dims.max_position_embeddings, dims.sliding_window)
    return dims.max_position_embeddings


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


@dataclass
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer
    num_emitted_tokens: int = 0
    num_retained_tokens: int = 0


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
        self.tokenizer = self.loaded.tokenizer
        self.model_name = self.loaded.files.name
        model = self.loaded.model
        block_size = config.block_size
        kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, loaded.dtype, loaded.weights,
                                    loaded.device)
        # The pool's content is keyed by what produced it, its dtype included.
        self.fingerprint = kv_fingerprint(loaded.fingerprint, loaded.dtype, kv_dtype)
        free_bytes = memory_probe(loaded.device) if config.kv_cache_memory_bytes is None \
            else None
        self.kv_plan = plan_kv_cache(KVRequest(
            dtype_name(kv_dtype), block_size,
            ModelRunner.kv_bytes_per_block(model, block_size, kv_dtype),
            _model_len(model.dims), config.max_num_seqs, config.max_model_len,
            config.kv_cache_memory_bytes), free_bytes, unresident)
        self.num_blocks = self.kv_plan.num_blocks
        self.max_model_len = self.kv_plan.max_model_len
        backend = get_attention_backend(config.attention_backend, self.loaded.device,
                                        native_cpu=model.native_ops)
        self.kv_cache = KVCacheManager(self.num_blocks, block_size, config.enable_prefix_caching,
                                       extra_key=self.fingerprint.encode())
        self.scheduler = Scheduler(self.kv_cache, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.max_model_len,
                                   self.loaded.eos_token_ids)
        self.runner = ModelRunner(model, self.num_blocks, block_size, self.loaded.device,
                                  kv_dtype, backend)
        self.kv_cache.move_block = self.runner.move_block  # tables grow into consecutive blocks
        self.sampler = Sampler(self.loaded.device)
        self.speculator = make_speculator(config.speculative)
        vocab_size = model.dims.vocab_size
        self.grammars = GrammarCompiler(self.tokenizer, vocab_size, self.loaded.eos_token_ids)
        self.structured = StructuredOutputs(vocab_size, self.grammars.decoded_vocab,
                                            self.loaded.eos_token_ids)
        self.pins = PinManager(self.kv_cache, self.tokenizer,
                               int(config.max_pinned_fraction * self.num_blocks))
        # conversations continued by token ids (stored responses) keep their last partial block
        self.tails = TailKeeper(self.kv_cache, max(1, self.num_blocks // 8))
        self.scheduler.prefix_extension = self._prefix_extension
        self.retention = RetentionManager(self.kv_cache, self.pins.registry, self.tokenizer)
        self.pin_results: dict[str, PinResult] = {}  # finished pin prefills, by request id
        self.expired_pins: list[PinKey] = []  # pins whose TTL lapsed, for the registry owner
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self._totals = {"prompt": 0, "generation": 0, "finished": 0, "steps": 0, "model": 0,
                        "jump_forward": 0}
        if self.kv_plan.cap_reason is not None:
            logger.warning("max_model_len %d, below the model's %d: %s", self.max_model_len,
                           self.kv_plan.model_len, self.kv_plan.cap_reason)
        logger.info("%s; attention backend %s", self.kv_plan.describe(), backend.name)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, cache_salt: str | None = None,
                    grammar: Any = None, keep_tail: bool = False,
                    retention: HoldRequest | None = None) -> str:
        """Queue a request. Raises ValueError for an empty or too-long prompt, GrammarError for
        a constraint that does not compile (nothing changes either way). ``keep_tail``: hold its
        partial last block once it finishes, until ``tails.release(request_id)``.

        ``grammar`` is ``params.structured_outputs`` compiled by ``self.grammars`` already (the
        server compiles off this thread); without it, the constraint is compiled here.
        ``retention``: hold the prompt's prefix once computed (its deltas report
        ``num_retained_tokens``).
        """
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._tracked:
            raise ValueError(f"request id {request_id!r} is already in use")
        vocab_size = self.loaded.model.dims.vocab_size
        if any(not 0 <= t < vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be within [0, {vocab_size})")
        if params.structured_outputs is not None and grammar is None:
            grammar = self.grammars.compile(params.structured_outputs)
        room = self.max_model_len - len(prompt_token_ids)
        max_output = room if params.max_tokens is None else min(params.max_tokens, room)
        request = Request(request_id, list(prompt_token_ids), params, max(max_output, 1),
                          cache_salt)
        self.scheduler.add_request(request)
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.stop,
                                       params.include_stop_str_in_output)
        self._tracked[request_id] = _Tracked(request, detok)
        if grammar is not None:
            self.structured.add(request_id, grammar)
        if retention is not None:
            self.retention.track(request_id, retention)
        self._totals["prompt"] += len(prompt_token_ids)
        if keep_tail:
            self.tails.want(request_id)
        return request_id

    def abort_request(self, request_id: str) -> StreamDelta | None:
        """Stop a request now and free its blocks; returns its final delta if it was live."""
        if self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED) is None:
            return None
        return self._delta(self._tracked[request_id], finished=True)

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
        self.add_request(token_ids, params, request_id, cache_salt)
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
        return self.pins.snapshot_shape(self.pins.registry.get(key), self.runner.kv_caches)

    def gather_pin_snapshot(self, key: PinKey | str, out: torch.Tensor | None = None) -> dict:
        """A copy of the pin's KV (into ``out`` when it fits) and what identifies it, for a
        snapshot written elsewhere."""
        return self.pins.gather_snapshot(self.pins.registry.get(key), self.runner.kv_caches,
                                         self.fingerprint, out)

    def unpin(self, key: PinKey | str) -> None:
        """Drop a pin; its blocks become ordinary cached blocks. Raises PinNotFoundError."""
        self.pins.registry.remove(key)

    def retain(self, token_ids: list[int], hold: HoldRequest,
               cache_salt: str | None = None) -> Retained | None:
        """Hold the cached whole blocks of ``token_ids[:hold.num_tokens]`` now (see
        ``RetentionManager.retain``); None when nothing could be held."""
        return self.retention.retain(token_ids, hold, cache_salt)

    def expire_pins(self) -> None:
        now = time.monotonic()
        for key in self.pins.registry.expired(now):
            self.pins.registry.remove(key)
            self.expired_pins.append(key)
        self.retention.expire(now)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[StreamDelta]:
        out = self.scheduler.schedule()
        for request_id in out.admitted_ids:
            self.pins.on_admitted(self.scheduler.requests[request_id])
            self.retention.on_admitted(self.scheduler.requests[request_id])
        deltas = [self._delta(self._tracked[rid], finished=True,
                              error="the request does not fit in the KV cache pool")
                  for rid in out.failed_ids]
        if out.empty:
            return deltas
        self.runner.copy_kv(out.kv_copies)
        result = self.runner.execute(out.scheduled)
        self.pins.keep_tails(out.scheduled)
        self._totals["steps"] += 1
        self._totals["model"] += result.num_tokens
        requests = [self.scheduler.requests[rid] for rid in result.request_ids]
        drafts = {s.request_id: s.token_ids[len(s.token_ids) - s.num_draft_tokens:]
                  for s in out.scheduled if s.num_draft_tokens}
        constrained = [r for r in requests if r.request_id in self.structured]
        outputs = {r.request_id: r.output_token_ids for r in constrained}
        closing = {r.request_id for r in constrained if self.structured.needs_closing(
            r.request_id, r.max_output_tokens - r.num_output_tokens)}
        dead_ends = set(self.structured.apply(result.logits, result.request_ids, drafts,
                                              outputs, closing))
        token_ids = self.speculator.sample(self.sampler, result.logits, requests, drafts)
        now = time.monotonic()
        items = {item.request_id: item for item in out.scheduled}
        for request in self.scheduler.update_from_output(out, token_ids):
            tracked = self._tracked[request.request_id]
            retained = self.retention.after_compute(request)
            if retained is not None:
                tracked.num_retained_tokens = retained.num_tokens
            if request.first_token_time_s is None:
                request.first_token_time_s = now
            if request.request_id in self.structured:
                new_ids = request.all_token_ids[request.num_prompt_tokens
                                                + tracked.num_emitted_tokens:]
                if not self._advance_grammar(request, new_ids, request.request_id in dead_ends):
                    deltas.append(self._delta(tracked, finished=True, error=GRAMMAR_DEAD_END,
                                              error_code="grammar_dead_end"))
                    continue
                if self.config.jump_forward and not request.status.finished:
                    self._jump_forward(request)
            self._detokenize(tracked)
            if request.status.finished:
                self.tails.on_finished(request, items.get(request.request_id))
            deltas.append(self._delta(tracked, finished=request.status.finished))
        self.speculator.propose(self.scheduler.running, self.scheduler.num_waiting)
        for request in self.scheduler.running:  # a constrained request drafts what it may write
            if request.spec_token_ids and request.request_id in self.structured:
                request.spec_token_ids = self.structured.legal_prefix(request.request_id,
                                                                      request.spec_token_ids)
        return deltas

    def _prefix_extension(self, block_hashes: Sequence[BlockHash],
                          next_tokens: list[int]) -> tuple[int, int] | None:
        """The longest tail past a request's cached chain: a pin's or a kept conversation's."""
        found = [self.pins.tail_after(block_hashes, next_tokens),
                 self.tails.tail_after(block_hashes, next_tokens)]
        return max((f for f in found if f is not None), key=lambda f: f[1], default=None)

    def _detokenize(self, tracked: _Tracked) -> None:
        """Feed the request's new tokens to its detokenizer one by one; at a stop string, the
        tokens after it are dropped (a step may have accepted several) and the request stops."""
        request = tracked.request
        detokenizer = tracked.detokenizer
        num_tokens = request.num_prompt_tokens + tracked.num_emitted_tokens
        for token_id in request.all_token_ids[num_tokens:]:
            detokenizer.add_token(token_id)
            num_tokens += 1
            if detokenizer.stop_reason is not None:
                break
        if detokenizer.stop_reason is None:
            return
        if num_tokens < request.num_tokens:  # tokens past the stop string came in this step
            request.truncate(num_tokens)
            if request.status.finished:  # by one of the dropped tokens: the string came first
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = detokenizer.stop_reason
                return
        if not request.status.finished:
            request.stop_reason = detokenizer.stop_reason
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)

    def _advance_grammar(self, request: Request, new_ids: list[int], dead_end: bool) -> bool:
        """Feed this step's tokens (accepted drafts, then the sampled one) to the request's
        matcher; False (request finished) when the grammar had no legal token or rejects one.
        A complete grammar finishes the request."""
        rid = request.request_id
        if dead_end or not all(self.structured.accept(rid, t) for t in new_ids):
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            return False
        if self.structured.is_terminated(rid) and not request.status.finished:
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
        return True

    def _jump_forward(self, request: Request) -> None:
        """Append the tokens the grammar forces next (see ``agentd.structured.jump_forward``);
        their KV is computed in the next step, with the request's next token, as one chunk."""
        rid = request.request_id
        jump = plan_jump(self.tokenizer, request.output_token_ids,
                         self.structured.forced_text(rid))
        if jump is None:
            return
        self.structured.rollback(rid, jump.num_replaced)
        del request.all_token_ids[len(request.all_token_ids) - jump.num_replaced:]
        room = request.max_output_tokens - request.num_output_tokens
        for token_id in jump.token_ids[:room]:
            if not self.structured.accept(rid, token_id):
                break  # cannot happen: the grammar forced this text
            request.append_token(token_id)
        self._totals["jump_forward"] += min(len(jump.token_ids), room) - jump.num_replaced
        if request.num_output_tokens >= request.max_output_tokens:
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_LENGTH)

    def _delta(self, tracked: _Tracked, finished: bool, error: str | None = None,
               error_code: str | None = None) -> StreamDelta:
        request = tracked.request
        new_ids = request.output_token_ids[tracked.num_emitted_tokens:]
        tracked.num_emitted_tokens = request.num_output_tokens
        text = tracked.detokenizer.flush(finished)
        if finished:
            if request.request_id in self.pins.pending:
                result = self.pins.complete(request.request_id,
                                            failed=error or request.status.value == "abort")
                if result is not None:
                    self.pin_results[request.request_id] = result
            del self._tracked[request.request_id]
            self.retention.forget(request.request_id)
            self.tails.forget(request.request_id)
            self.sampler.forget(request.request_id)
            self.speculator.forget(request.request_id)
            self.structured.remove(request.request_id)
            self._totals["finished"] += 1
            self._totals["generation"] += request.num_output_tokens
        return StreamDelta(
            request_id=request.request_id,
            text=text,
            token_ids=new_ids,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
            num_output_tokens=request.num_output_tokens,
            num_retained_tokens=tracked.num_retained_tokens,
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason,
            error=error,
            error_code=error_code or ("context_length_exceeded" if error else None),
            first_token_time_s=request.first_token_time_s,
            arrival_time_s=request.arrival_time_s,
        )

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
            num_jump_forward_tokens=self._totals["jump_forward"],
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
