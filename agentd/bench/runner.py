"""The benchmark's phases for one workload against one server.

Order (each phase's requests carry distinct user turns after the workload's shared prefix):

1. cold — each request in a namespace the cache cannot know (a new ``cache_salt`` on agentd, a
   new nonce in the prefix elsewhere); the last one warms the namespace of phase 2;
2. warm — sequential requests in that warmed namespace (prefix cached, not pinned);
3. pinned — agentd only: ``POST /v1/pins`` with the system text and tools, then sequential
   requests with no salt, which is the namespace a pin covers;
4. pressure — a few namespaces are warmed, then unique long prompts push more tokens through the
   pool than it holds, then pinned requests and requests in those once-warm namespaces alternate;
   the pinned ones resend phase 3's prompts, so the two compare the same turns;
5. multiturn — the workload's conversations replayed step by step (each step's prompt extends
   the previous one's);
6. throughput — at each concurrency C, max(C, requests) requests by C concurrent clients on the
   warm prefix (the pin when there is one), then the same at C=8 (or the largest C) from an
   empty cache (a new namespace).

Invariants: the pin a run creates is deleted when the run ends, however it ends; the prefix-cache
hit rate is the change of agentd's own counters over the workload's run; a phase that cannot
run on this server is left out with a note saying why, never faked.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agentd.bench.client import BenchClient, RequestResult, ServerInfo
from agentd.bench.results import (
    COLD,
    MULTITURN,
    PINNED,
    PRESSURE_PINNED,
    PRESSURE_UNPINNED,
    WARM,
    Phase,
    WorkloadResult,
)
from agentd.bench.rss import RssSampler
from agentd.bench.workload import Message, Namespace, Prompts, Workload

FILL_LEN_MAX = 4096  # tokens per pressure-fill prompt: long, but cheap to attend over on a CPU


@dataclass(frozen=True)
class BenchSettings:
    requests: int = 16  # sequential requests per warm phase; the floor of throughput counts
    cold_requests: int = 3
    concurrency: tuple[int, ...] = (1, 8, 32)
    max_tokens: int = 32
    pin: bool = True
    pressure: bool = True
    pressure_tokens: int | None = None  # pool size to overflow; None: agentd's /v1/stats
    pressure_misses: int = 4  # once-warm namespaces measured after the pressure
    conversations: int = 5
    empty_cache: bool = True  # a last throughput phase on prompts no cache holds

    def __post_init__(self) -> None:
        if self.requests < 1 or self.cold_requests < 1 or self.max_tokens < 1:
            raise ValueError("requests, cold requests and max tokens must be at least 1")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("concurrency levels must be positive integers, e.g. 1,8,32")

    @property
    def empty_cache_concurrency(self) -> int:
        return 8 if 8 in self.concurrency else max(self.concurrency)


class Progress(Protocol):
    def phase(self, label: str, total: int) -> None: ...
    def advance(self) -> None: ...


class NullProgress:
    def phase(self, label: str, total: int) -> None:
        pass

    def advance(self) -> None:
        pass


@dataclass(frozen=True)
class Spec:
    """One request to send."""

    messages: list[Message]
    tools: list[dict[str, Any]]
    namespace: Namespace
    max_tokens: int


class WorkloadRunner:
    def __init__(self, client: BenchClient, server: ServerInfo, settings: BenchSettings,
                 workload: Workload, prompt_budget: int | None, tokenizer: Any,
                 progress: Progress, rss: RssSampler) -> None:
        self.client, self.server, self.settings = client, server, settings
        self.prompts = Prompts(workload)
        self.tokenizer = tokenizer
        self.progress, self.rss = progress, rss
        self.result = WorkloadResult(workload, prompt_budget, settings.max_tokens)
        self.run_id = uuid.uuid4().hex[:8]
        self._num_namespaces = 0
        self.warm_ns = self.fresh("warm")

    @property
    def is_agentd(self) -> bool:
        return self.server.kind == "agentd"

    def fresh(self, tag: str) -> Namespace:
        """A namespace no earlier request used: a cache salt on agentd, a nonce elsewhere."""
        self._num_namespaces += 1
        key = f"bench-{self.run_id}-{tag}-{self._num_namespaces}"
        return Namespace(salt=key) if self.is_agentd else Namespace(nonce=key)

    def spec(self, namespace: Namespace, max_tokens: int | None = None) -> Spec:
        messages, tools = self.prompts.single_turn(namespace)
        return Spec(messages, tools, namespace, max_tokens or self.settings.max_tokens)

    async def run(self) -> WorkloadResult:
        result = self.result
        stats_before = await self.client.stats() if self.is_agentd else None
        self.rss.reset()
        await self._cold_and_warm()
        pin_name = await self._pin() if self.settings.pin else None
        if not self.settings.pin:
            result.notes.append("pinned phases skipped (--no-pin)")
        try:
            steady = Namespace() if pin_name else self.warm_ns
            pinned = [self.spec(steady) for _ in self._n()] if pin_name else None
            if pinned:
                await self.sequential(PINNED, pinned)
            if self.settings.pressure:
                await self._pressure(pinned)
            else:
                result.notes.append("pressure phase skipped (--no-pressure)")
            await self.sequential("prime", [self.spec(steady)])
            await self._multiturn(steady)
            await self._throughput(steady)
        finally:
            if pin_name:
                await self.client.delete_pin(pin_name)
        self.rss.sample()
        result.peak_rss_bytes, result.hwm_bytes = self.rss.peak_rss_bytes, self.rss.hwm_bytes
        if stats_before is not None:
            result.prefix_cache_hit_rate = _hit_rate(stats_before, await self.client.stats())
        return result

    def _n(self) -> range:
        return range(self.settings.requests)

    async def _cold_and_warm(self) -> None:
        num_cold = self.settings.cold_requests
        cold = [self.spec(self.fresh("cold")) for _ in range(num_cold - 1)]
        await self.sequential(COLD, [*cold, self.spec(self.warm_ns)])
        await self.sequential(WARM, [self.spec(self.warm_ns) for _ in self._n()])

    async def _pin(self) -> str | None:
        if not self.is_agentd:
            self.result.notes.append("pinned phases skipped: pins are agentd's (not an agentd "
                                     "server, or --openai-compatible)")
            return None
        name = f"bench-{self.result.workload.name}-{self.run_id}"
        system, tools = self.prompts.prefix(Namespace())
        self.progress.phase(f"{self.result.workload.name}: pin", 1)
        reply = await self.client.create_pin(name, system, tools)
        self.progress.advance()
        if isinstance(reply, str):
            self.result.notes.append(f"pinned phases skipped: {reply}")
            return None
        self.result.pin = reply
        return name

    async def _pressure(self, pinned: list[Spec] | None) -> None:
        """``pinned``: the pinned phase's requests, sent again once the pool has overflowed."""
        pool_tokens = self.settings.pressure_tokens
        if pool_tokens is None and self.server.num_blocks_total is not None:
            pool_tokens = self.server.num_blocks_total * self.server.block_size
        if pool_tokens is None:
            self.result.notes.append("pressure phase skipped: the pool size of this server is "
                                     "unknown; pass --pressure-tokens")
            return
        victims = [self.fresh("evict") for _ in range(self.settings.pressure_misses)]
        await self.sequential("pressure_warmup", [self.spec(v) for v in victims])
        fill_len, fills = self._fill_specs(pool_tokens)
        self.result.notes.append(f"pressure: {len(fills)} prompts of ~{fill_len} tokens pushed "
                                 f"through a pool of {pool_tokens} tokens")
        await self.sequential("pressure_fill", fills)
        plan: list[tuple[str, Spec]] = []
        for i in range(max(len(pinned or ()), len(victims))):
            if pinned and i < len(pinned):
                plan.append((PRESSURE_PINNED, pinned[i]))
            if i < len(victims):
                plan.append((PRESSURE_UNPINNED, self.spec(victims[i])))
        self.progress.phase(f"{self.result.workload.name}: after pressure", len(plan))
        for name in dict.fromkeys(name for name, _ in plan):
            self.result.add(Phase(name, 1, 0.0, []))
        for name, spec in plan:
            phase = self.result.phases[name]
            result = await self._send(name, spec)
            phase.results.append(result)
            phase.wall_s += result.e2e_s

    def _fill_specs(self, pool_tokens: int) -> tuple[int, list[Spec]]:
        """Prompts of unique prefixes whose tokens together exceed ``pool_tokens``."""
        max_len = self.server.max_model_len or FILL_LEN_MAX
        fill_len = max(64, min(FILL_LEN_MAX, max_len - self.settings.max_tokens - 64))
        cold = self.result.phases[COLD].results
        base_len = max(r.prompt_tokens for r in cold) or fill_len // 2
        workload = self.prompts.workload
        source = "\n\n".join([workload.system, *workload.turns])
        filler_ids: list[int] = []
        while len(filler_ids) < fill_len:
            filler_ids += self.tokenizer(source, add_special_tokens=False).input_ids
        filler = self.tokenizer.decode(filler_ids[: max(0, fill_len - base_len)])
        fill_len = max(base_len, fill_len)
        specs = []
        for _ in range(math.ceil(pool_tokens / fill_len) + 1):
            spec = self.spec(self.fresh("fill"), max_tokens=1)
            spec.messages[-1]["content"] = filler + "\n\n" + spec.messages[-1]["content"]
            specs.append(spec)
        return fill_len, specs

    async def _multiturn(self, namespace: Namespace) -> None:
        conversations = self.prompts.workload.conversations[: self.settings.conversations]
        specs = [Spec(messages, tools, namespace, self.settings.max_tokens)
                 for i in range(len(conversations))
                 for messages, tools in self.prompts.conversation_steps(i, namespace)]
        if specs:
            await self.sequential(MULTITURN, specs)

    async def _throughput(self, steady: Namespace) -> None:
        settings = self.settings
        for c in settings.concurrency:
            specs = [self.spec(steady) for _ in range(max(c, settings.requests))]
            await self.concurrent(f"c{c}", specs, c)
        if not settings.empty_cache:
            self.result.notes.append("empty-cache throughput phase skipped (--no-empty-cache)")
            return
        c = settings.empty_cache_concurrency
        empty = self.fresh("empty")
        specs = [self.spec(empty) for _ in range(max(c, settings.requests))]
        await self.concurrent(f"c{c}_empty", specs, c)

    async def sequential(self, name: str, specs: Sequence[Spec]) -> Phase:
        return await self.concurrent(name, specs, 1)

    async def concurrent(self, name: str, specs: Sequence[Spec], concurrency: int) -> Phase:
        """Send ``specs`` from ``concurrency`` clients; wall time covers first send to last end."""
        self.progress.phase(f"{self.result.workload.name}: {_label(name)}", len(specs))
        pending = list(reversed(specs))
        results: list[RequestResult] = []

        async def client() -> None:
            while pending:
                results.append(await self._send(name, pending.pop()))

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(min(concurrency, len(specs)))))
        results.sort(key=lambda r: r.start_s)
        return self.result.add(Phase(name, concurrency, time.perf_counter() - start, results))

    async def _send(self, phase: str, spec: Spec) -> RequestResult:
        result = await self.client.chat(phase, self.server.model, spec.messages, spec.tools,
                                        spec.namespace, spec.max_tokens)
        self.progress.advance()
        return result


def _label(phase: str) -> str:
    if phase.startswith("c") and phase[1:2].isdigit():
        c, _, empty = phase[1:].partition("_")
        return f"throughput c={c}" + (" from an empty cache" if empty else "")
    return phase.replace("_", " ")


def _hit_rate(before: dict[str, Any], after: dict[str, Any] | None) -> float | None:
    if after is None:
        return None
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    return hits / queries if queries > 0 else None
