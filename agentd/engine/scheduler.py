"""Continuous-batching scheduler: decides which tokens run each step. Pure Python, no tensors.

Policy: running requests before waiting ones, decoding tokens before prompt chunks. Each step
every decoding request gets its next token; prompt chunks (of running prefills and of the
waiting requests that could take a seat) then share the token budget (``max_num_batched_tokens``)
shortest remaining prompt first: the shortest runs as much as it can, the others only a chunk
that ends their prompt, so a step that gives a short prompt its first token never carries a
piece of a long one. No request runs more than ``long_prefill_chunk`` prompt tokens in a step
(vLLM's ``long_prefill_token_threshold``), so a prompt of tens of thousands of tokens runs in
short steps, and a short request that arrives meanwhile (a title, a sub-agent's probe) waits
for the step in flight, not the whole prefill. Deep in a long prompt a row costs more than its
linear layers, its attention reading every token before it: with ``attention_context`` (the
context length at which a row's attention costs what its linear layers do, from the model's
shape) a row at position ``p`` counts as ``1 + p / attention_context`` tokens of those limits,
so a step lasts about as long at 16k tokens as at the start. Shortest first holds while the pool
has room: after a step that preempted a request or could not admit one, chunks go in admission
order for ``PRESSURE_STEPS`` steps (the requests that hold the pool finish and free it; a newer,
shorter one that cannot grow would otherwise take the budget step after step). Waiting
requests are admitted in order within ``max_num_seqs`` and the block pool. Admission first asks the
cache manager for the longest cached prefix, so only the uncached tail is prefilled; a kept
partial last block (a pin's, a stored conversation's) extends that prefix: its slots are copied
into the request's first new block before the step's forward (a ``SchedulerOutput.kv_copies``
entry, like every KV copy the step needs: the cache manager queues them). A waiting request
whose next ``WAIT_FOR_TOKENS`` uncached tokens a running request is still computing
(agents that start together with the same new prompt) waits for them to be cached rather than
compute them again; the requests behind it are admitted meanwhile.

Under the pool, a disk tier (:mod:`agentd.engine.kv_tier`) may hold the blocks that follow a
waiting request's cached prefix: the request then takes its seat and blocks for them and waits,
out of the queue, while the loader reads them (``loading``; the step's ``loads``, started once
its ``kv_copies`` have run, since a copy may read or write a block just handed to the load); the
step goes on without it. When the load lands, the blocks that verified are registered and the
request runs from there, computing only what neither tier had (a block that failed its checks,
and what follows it).

Draft tokens (``Request.spec_token_ids``, from :mod:`agentd.engine.spec_decode`) ride along with a
decoding request's next token when the budget and spare free blocks allow; they never cause a
preemption. After the step, the KV of the drafts the sampler rejected is void: the request's
``num_computed_tokens`` counts only accepted tokens and the blocks beyond them are freed, so no
block that holds a rejected token is ever hashed into the prefix cache.

Preemption rule: when a running request cannot get the blocks it needs, the most recently admitted
running request is preempted: its blocks are freed (full ones stay cached) and it returns to the
front of the waiting queue to be recomputed later, mostly from cache. Lack of blocks never raises;
a request that cannot fit even alone in the pool is finished with reason "length".

The scheduler never decides that a request is done generating: :mod:`agentd.engine.output_processor`
appends each step's tokens and decides that; ``update_from_output`` then advances what is
computed, caches full blocks and frees the blocks of the requests it finished.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from agentd.cache import BlockHash, CachedPrefix, KVCacheManager, KVCopy, LoadJob
from agentd.engine.request import Request, RequestStatus, check_prompt

# A waiting request waits for a running prefill that is computing at least this many of its next
# tokens, instead of computing them too (8 agents started with one new 2,100-token prompt, where
# the first's prefill left room in the step for a second: TTFTs 1.9 s and 2.4 s instead of 2.6 s
# and 4.2 s). Below it, recomputing is cheaper than waiting a step: the shared prompt's last
# partial chunk, say.
WAIT_FOR_TOKENS = 256

# Steps the scheduler hands prompt chunks out in admission order after a step that preempted a
# request or found no room to admit one (see Scheduler._pressure_steps).
PRESSURE_STEPS = 8


@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens to run this step
    start_position: int  # position of token_ids[0] == tokens already computed
    block_table: list[int]
    sample: bool  # this step reaches the end of the sequence, so a token is sampled
    num_draft_tokens: int = 0  # the last this many of token_ids are drafts to verify


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    failed_ids: list[str] = field(default_factory=list)  # finished: they can never fit
    admitted_ids: list[str] = field(default_factory=list)  # first admissions this step
    kv_copies: list[KVCopy] = field(default_factory=list)  # run in order, before the forward
    # reads from the tier into new blocks, started once kv_copies have run: a copy may read or
    # write a block the pool just handed a loading request (a cached block moved out of a
    # growing table's way, agentd.cache's allocate), and the loader must not race it
    loads: list[LoadJob] = field(default_factory=list)
    # a named session's pool hits (block ids in its table, hashes), for the tier to keep; read
    # once kv_copies have run, for the same reason
    keeps: list[tuple[list[int], list[BlockHash]]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled  # a step may still start loads


@dataclass
class SchedulerStats:
    prefix_cache_queries: int = 0  # prompt tokens looked up at first admission
    prefix_cache_hits: int = 0  # of those, tokens found cached (in the pool or on disk)
    prefix_cache_disk_hits: int = 0  # of the hits, tokens read back from the disk tier
    num_preemptions: int = 0


class BlockTier(Protocol):
    """What the scheduler asks of a tier under the pool (agentd.engine.kv_tier)."""

    enabled: bool

    def count_leading(self, block_hashes: Sequence[BlockHash]) -> int: ...

    def take_landed(self) -> list[LoadJob]: ...


class _NoTier:
    enabled = False

    def count_leading(self, block_hashes: Sequence[BlockHash]) -> int:
        return 0

    def take_landed(self) -> list[LoadJob]:
        return []


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, long_prefill_chunk: int | None = None,
                 attention_context: float | None = None, tier: BlockTier | None = None) -> None:
        """``max_model_len``: the context every request fits in (its prompt is checked when it
        is added, and the output processor ends it there); no draft runs past it.
        ``attention_context``: see the module's docstring (None: a row costs one token of the
        budget wherever it is). ``tier``: where blocks the pool lacks may be read back from."""
        self.kv_cache = kv_cache
        self.tier: BlockTier = tier or _NoTier()
        self.loading: dict[str, Request] = {}  # admitted, waiting for their blocks from the tier
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # the most prompt tokens one request runs in a step (None: the whole budget)
        self.long_prefill_chunk = long_prefill_chunk or max_num_batched_tokens
        self.max_model_len = max_model_len
        self.attention_context = attention_context
        self.waiting: deque[Request] = deque()
        # waiting requests whose admission found no room last step: no share of the next one
        # (else a long prefill would yield, step after step, to a request that cannot start)
        self._stalled: set[str] = set()
        # steps left in admission order: after a preemption or an admission without room, the
        # requests that hold the pool go first, so they finish and free it (shortest first
        # would hand the budget to a newer, shorter one that cannot grow, step after step)
        self._pressure_steps = 0
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError (nothing queued) for a prompt that is empty or leaves
        no room in ``max_model_len`` (``agentd.engine.request.check_prompt``)."""
        check_prompt(request.prompt_token_ids, self.max_model_len)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._land_loads(out)
        budget = self.max_num_batched_tokens
        computing = self._blocks_being_computed()
        shares = self._prefill_shares(computing)
        stalled, self._stalled = self._stalled, set()
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = min(remaining, budget, shares.get(request.request_id, remaining))
            if num_new == 0:  # a prefill that yields this step to shorter ones
                index += 1
                continue
            # the requests after this one get their next token before its drafts
            drafts = self._fit_drafts(request, num_new,
                                      budget - num_new - (len(self.running) - index - 1))
            if not self._make_room(request, request.num_computed_tokens + num_new, out):
                break  # request preempted itself: it was the newest
            out.scheduled.append(self._scheduled(request, num_new, drafts))
            budget -= num_new + len(drafts)
            index += 1
        index = 0
        while (index < len(self.waiting) and budget > 0
               and len(self.running) + len(self.loading) < self.max_num_seqs
               and not out.preempted_ids):
            request = self.waiting[index]
            cached = self._cached_prefix(request)
            if self._start_load(request, cached, out):
                continue  # out of the queue: the next one is at ``index`` now
            if self._would_recompute(cached, computing):
                index += 1  # running prefills are computing its next blocks: wait for the hits
                continue
            share = shares.get(request.request_id, 0)
            if share == 0 and request.request_id not in stalled:
                index += 1  # shorter prompts have this step's budget
                continue
            num_new = self._admit(request, cached, min(budget, share or budget), out)
            if num_new is None:  # no room: the ones behind it may fit (they may hold the shares)
                if request.status.finished:
                    continue  # it never can: finished, out of the queue
                self._stalled.add(request.request_id)
                index += 1
                continue
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            computing.update(self._uncomputed_blocks(request))
        if out.preempted_ids or self._stalled:
            self._pressure_steps = PRESSURE_STEPS
        elif self._pressure_steps:
            self._pressure_steps -= 1
        out.kv_copies = self.kv_cache.take_copies()
        return out

    def _start_load(self, request: Request, cached: CachedPrefix, out: SchedulerOutput) -> bool:
        """Whether ``request`` is to load the blocks after ``cached`` from the tier (it holds its
        seat and those blocks, out of the queue, until the load lands; the caller starts the
        job in ``out.loads`` once the step's KV copies have run)."""
        if not self.tier.enabled:
            return False
        block_size = self.kv_cache.block_size
        first = len(cached.block_ids)
        wanted = cached.block_hashes[first:(request.num_tokens - 1) // block_size]
        num_stored = self.tier.count_leading(wanted)
        if num_stored == 0 or self.kv_cache.allocate(
                request.request_id, cached.num_tokens + num_stored * block_size, cached) is None:
            return False
        self.waiting.remove(request)
        self.loading[request.request_id] = request
        self._keep_hits(request, cached, out)
        table = self.kv_cache.block_table(request.request_id)
        out.loads.append(LoadJob(request.request_id, wanted[:num_stored],
                                 table[first:first + num_stored], cached.num_tokens))
        return True

    def _land_loads(self, out: SchedulerOutput) -> None:
        """Requests whose blocks the tier read: register the ones that verified, drop the rest,
        and run them from there (an aborted one only frees its blocks now)."""
        for job in self.tier.take_landed():
            request = self.loading.pop(job.request_id)
            if request.status.finished:  # aborted while its blocks were being written
                self.kv_cache.free(request.request_id)
                continue
            num_tokens = job.num_pool_tokens + job.num_loaded * self.kv_cache.block_size
            self.kv_cache.cache_blocks(request.request_id, request.all_token_ids, num_tokens,
                                       request.cache_salt, request.block_hashes,
                                       request.session is not None)
            self.kv_cache.trim(request.request_id, num_tokens)
            request.num_computed_tokens = num_tokens
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_tokens
                out.admitted_ids.append(request.request_id)
                self.stats.prefix_cache_queries += request.num_tokens
                self.stats.prefix_cache_hits += num_tokens
                self.stats.prefix_cache_disk_hits += num_tokens - job.num_pool_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def _keep_hits(self, request: Request, cached: CachedPrefix, out: SchedulerOutput) -> None:
        """A named session's pool hits (it is allocated) are its prefix too: the tier keeps them."""
        if self.tier.enabled and request.session is not None and (n := len(cached.block_ids)):
            out.keeps.append((self.kv_cache.block_table(request.request_id)[:n],
                              cached.block_hashes[:n]))

    def _cached_prefix(self, request: Request) -> CachedPrefix:
        return self.kv_cache.find_cached_prefix(
            request.all_token_ids, request.cache_salt, max_num_tokens=request.num_tokens - 1,
            block_hashes=request.block_hashes)  # hashed once, not every step it waits

    def _prefill_shares(self, computing: set[BlockHash]) -> dict[str, int]:
        """The prompt tokens each prefilling request may run this step: the step's token budget
        (after the decoding requests' tokens) handed out in ``_row_cost`` units, shortest
        remaining prompt first, ties in order (running, then waiting), at most
        ``long_prefill_chunk`` units each; the shortest takes what it can, the others only what
        finishes their prompt (many short prompts share a step; a long one never lengthens the
        step that gives a short one its first token). Running prefills and the waiting requests
        that could take a seat this step are counted; a running request absent from the result
        is decoding (its next token always runs), a waiting one has no share this step. A
        request that gets a share but cannot start (no room in the pool) has its share unused
        for one step, and none the next (``_stalled``)."""
        candidates: list[tuple[int, int, Request, int]] = []  # remaining, order, request, start
        num_decoding = 0  # their next tokens come out of the token budget first
        for order, request in enumerate(self.running):
            remaining = request.num_tokens - request.num_computed_tokens
            if remaining > 1:
                candidates.append((remaining, order, request, request.num_computed_tokens))
            else:
                num_decoding += 1
        shares: dict[str, int] = {}
        computing = set(computing)  # and what the waiting ones ahead will compute if admitted
        seats = self.max_num_seqs - len(self.running)
        for order, request in enumerate(self.waiting, start=len(self.running)):
            if seats <= 0 or order >= len(self.running) + 4 * self.max_num_seqs:
                break  # a long queue's tail is not looked up every step
            if request.request_id in self._stalled:
                continue
            cached = self._cached_prefix(request)
            if self._would_recompute(cached, computing):
                continue
            seats -= 1
            computing.update(request.prompt_block_hashes(self.kv_cache.block_size)[
                cached.num_tokens // self.kv_cache.block_size:])
            remaining = request.num_tokens - cached.num_tokens
            if remaining <= 1:
                shares[request.request_id] = remaining  # its last token only: as a decode
            else:
                candidates.append((remaining, order, request, cached.num_tokens))
        units = float(self.max_num_batched_tokens - num_decoding)
        pressed = self._pressure_steps > 0  # admission order, each as much as fits
        for rank, (remaining, _, request, start) in enumerate(
                sorted(candidates, key=lambda c: (c[1],) if pressed else (c[0], c[1]))):
            fits = int(min(units, self.long_prefill_chunk) / self._row_cost(start))
            if rank == 0 or pressed:  # as much as the budget holds, the first a row at least
                rows = min(remaining, max(fits, rank == 0))
            else:  # the others: only to finish (a step that ends a short prompt stays short)
                rows = remaining if remaining <= fits else 0
            shares[request.request_id] = rows
            units -= rows * self._row_cost(start)
        return shares

    def prefill_chunks(self, start: int, end: int) -> list[tuple[int, int]]:
        """(start, tokens) of each step of a prompt that runs alone from ``start`` to ``end``."""
        chunks = []
        budget = min(self.long_prefill_chunk, self.max_num_batched_tokens)
        while start < end:
            size = min(end - start, max(int(budget / self._row_cost(start)), 1))
            chunks.append((start, size))
            start += size
        return chunks

    def _row_cost(self, start: int) -> float:
        """What one prompt row at position ``start`` costs of the step's prefill budget."""
        return 1.0 + start / self.attention_context if self.attention_context else 1.0

    def _would_recompute(self, cached: CachedPrefix, computing: set[BlockHash]) -> bool:
        """Whether the blocks right after ``cached`` that running prefills are computing hold at
        least ``WAIT_FOR_TOKENS`` (fewer are cheaper to compute again than a step's wait)."""
        needed = -(-WAIT_FOR_TOKENS // self.kv_cache.block_size)
        upcoming = cached.block_hashes[len(cached.block_ids):len(cached.block_ids) + needed]
        return len(upcoming) == needed and all(h in computing for h in upcoming)

    def _blocks_being_computed(self) -> set[BlockHash]:
        """Hashes of the prompt blocks that running requests have yet to compute."""
        return {block_hash for request in self.running
                for block_hash in self._uncomputed_blocks(request)}

    def _uncomputed_blocks(self, request: Request) -> list[BlockHash]:
        block_size = self.kv_cache.block_size
        hashes = request.prompt_block_hashes(block_size)
        return hashes[request.num_computed_tokens // block_size:]

    def _fit_drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        """Takes ``request``'s drafts (a guess runs once) and returns those that run this step,
        their blocks allocated: only beside a decode token, within the budget, and only while
        the pool keeps a free block for every running request, so drafts never push anyone out.
        """
        budget = min(budget, self.max_model_len - request.num_tokens)
        drafts, request.spec_token_ids = request.spec_token_ids[:budget], []
        decoding = num_new == 1 == request.num_tokens - request.num_computed_tokens
        if not drafts or not decoding:
            return []
        spare = self.kv_cache.num_free_blocks - len(self.running)
        if spare < -(-len(drafts) // self.kv_cache.block_size) or self.kv_cache.allocate(
                request.request_id, request.num_tokens + len(drafts)) is None:
            return []
        return drafts

    def _make_room(self, request: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Grow ``request``'s blocks to ``num_tokens``, preempting the newest runners if needed."""
        while self.kv_cache.allocate(request.request_id, num_tokens) is None:
            victim = self.running.pop()
            if victim is request and not self.running:
                self._finish(request, RequestStatus.FINISHED_LENGTH)
                out.failed_ids.append(request.request_id)
                return False
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _admit(self, request: Request, cached: CachedPrefix, budget: int,
               out: SchedulerOutput) -> int | None:
        """Move a waiting request to running; returns its token count (at most ``budget``) or
        None if no room."""
        extension = None
        if cached.block_ids:  # a kept partial block may extend the chain (cache/tails.py)
            # at least the last token is always computed, for its logits
            extension = self.kv_cache.tails.best(
                cached.block_hashes[:len(cached.block_ids)],
                request.all_token_ids[cached.num_tokens:request.num_tokens - 1])
        num_cached = cached.num_tokens + (extension.num_tokens if extension else 0)
        num_new = min(request.num_tokens - num_cached, budget, self.long_prefill_chunk)
        if self.kv_cache.allocate(request.request_id, num_cached + num_new, cached) is None:
            if not self.running:  # an empty engine cannot hold it: it never will
                self._finish(request, RequestStatus.FINISHED_LENGTH)
                out.failed_ids.append(request.request_id)
            return None
        self.waiting.remove(request)
        self._keep_hits(request, cached, out)
        if extension is not None:
            first_new = self.kv_cache.block_table(request.request_id)[len(cached.block_ids)]
            self.kv_cache.copy_slots(extension.block_id, first_new, extension.num_tokens)
        request.num_computed_tokens = num_cached
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_cached
            out.admitted_ids.append(request.request_id)
            self.stats.prefix_cache_queries += request.num_tokens
            self.stats.prefix_cache_hits += num_cached
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return num_new

    def _scheduled(self, request: Request, num_new: int,
                   drafts: Sequence[int] = ()) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start: start + num_new] + list(drafts),
            start_position=start,
            block_table=self.kv_cache.block_table(request.request_id),
            sample=start + num_new == request.num_tokens,
            num_draft_tokens=len(drafts),
        )

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(self, out: SchedulerOutput,
                           sampled_token_ids: Mapping[str, Sequence[int]]) -> None:
        """After the output processor took the step's tokens: advance what is computed, cache
        the full blocks, and free the blocks of the requests it finished (or those of rejected
        drafts).

        ``sampled_token_ids`` holds, per sampling request, its accepted drafts (a prefix of its
        ``num_draft_tokens`` drafts) followed by one sampled token; the processor appended them,
        up to the first that finished the request.
        """
        for item in out.scheduled:
            request = self.requests.get(item.request_id)
            if request is None:
                continue  # aborted while the step ran
            num_sampled = len(sampled_token_ids[item.request_id]) if item.sample else 0
            num_rejected = item.num_draft_tokens - max(num_sampled - 1, 0)
            request.num_computed_tokens = min(
                request.num_computed_tokens + len(item.token_ids) - num_rejected,
                request.num_tokens)
            self.kv_cache.cache_blocks(request.request_id, request.all_token_ids,
                                       request.num_computed_tokens, request.cache_salt,
                                       request.block_hashes, request.session is not None)
            if request.status.finished:  # the output processor's decision
                self._finish(request, request.status)
            elif num_rejected:
                self.kv_cache.trim(request.request_id, request.num_computed_tokens)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish a request from outside (abort, stop string); frees its blocks at once."""
        request = self.requests.get(request_id)
        if request is None or request.status.finished:
            return None
        self._finish(request, status)
        return request

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if request.request_id not in self.loading:  # else the loader writes into its blocks:
            self.kv_cache.free(request.request_id)  # they are freed when the load lands
        del self.requests[request.request_id]
