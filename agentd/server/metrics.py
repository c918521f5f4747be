"""Prometheus metrics with vLLM's names, plus ``agentd:`` series with a ``pin`` label, in one
``CollectorRegistry`` per app.

Invariant: engine counters and gauges — pins' hits, tokens served, blocks and near misses
included — are read from the engine thread's snapshots at scrape time (never double-counted by
handlers, never waiting on the engine); only what the engine does not know — time to first token
(overall and by cache outcome) and end-to-end latency as the client sees them, and finished
requests by reason — is recorded by the handlers. Two apps in one process never share a registry.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest

from agentd.server.stats_report import RecentRequests

if TYPE_CHECKING:
    from agentd.engine.llm_engine import EngineStats
    from agentd.engine.outputs import StreamDelta
    from agentd.pins.manager import PinSummary

CONTENT_TYPE = "text/plain; version=0.0.4"  # the text format; the server adds the charset
_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                      40.0, 80.0, 160.0)

# (name, help, EngineStats.flat() key) for counters read from the engine.
_COUNTERS = (
    ("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", "prefix_cache_hits"),
    ("vllm:prompt_tokens", "Prompt tokens admitted.", "prompt_tokens_total"),
    ("vllm:generation_tokens", "Generated tokens.", "generation_tokens_total"),
    ("vllm:num_preemptions", "Preemptions (requests whose blocks were freed to make room).",
     "num_preemptions"),
    ("vllm:spec_decode_num_drafts", "Request steps that verified draft tokens.",
     "spec_num_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", "spec_num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
     "spec_num_accepted_tokens"),
)
_GAUGES = (
    ("vllm:num_requests_running", "Requests in the running batch.", "num_requests_running"),
    ("vllm:num_requests_waiting", "Requests waiting to be admitted.", "num_requests_waiting"),
    ("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", "kv_cache_usage"),
)


class EngineSnapshot(NamedTuple):
    model_name: str
    stats: EngineStats
    pins: PinSummary


_BLOCK_STATES = (("free", "num_blocks_free"), ("cached", "num_blocks_cached"),
                 ("used", "num_blocks_used"))


class _EngineCollector:
    """Yields the engine's counters and gauges from the latest stats snapshot."""

    def __init__(self, source: Callable[[], EngineSnapshot | None]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        snapshot = self._source()
        if snapshot is None:  # the model is still loading
            return
        model_name, stats, _ = snapshot
        flat = stats.flat()
        for name, doc, field in _COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model_name], flat[field])
            yield family
        for name, doc, field in _GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model_name], flat[field])
            yield family
        yield from _router_families(model_name, stats)
        blocks = GaugeMetricFamily("agentd:kv_cache_blocks", "KV blocks by state.",
                                   labels=["model_name", "state"])
        for state, field in _BLOCK_STATES:
            blocks.add_metric([model_name, state], flat[field])
        blocks.add_metric([model_name, "pinned"], stats.pins.num_blocks_pinned)
        blocks.add_metric([model_name, "retained"], stats.pins.num_blocks_retained)
        yield blocks
        yield from _pin_families(model_name, snapshot.pins)
        yield from _retained_families(model_name, stats, snapshot.pins)
        yield from _disk_families(model_name, stats)


def _disk_families(model_name: str, stats: EngineStats) -> Iterator[Metric]:
    """The disk tier under the pool, where it is on."""
    disk = stats.kv_disk
    if disk is None:
        return
    labels = ["model_name"]
    for name, doc, value in (
            ("agentd:kv_disk_hit_tokens", "Prompt tokens read back from the KV disk tier instead "
             "of recomputed.", stats.scheduler.prefix_cache_disk_hits),
            ("agentd:kv_disk_blocks_written", "KV blocks written to the disk tier.",
             disk.num_blocks_written),
            ("agentd:kv_disk_blocks_read", "KV blocks read back from the disk tier.",
             disk.num_blocks_read),
            ("agentd:kv_disk_blocks_rejected", "Stored KV blocks that failed their checks "
             "(recomputed).", disk.num_blocks_rejected),
            ("agentd:kv_disk_writes_dropped", "KV block writes dropped on a full queue.",
             disk.num_writes_dropped),
            ("agentd:kv_disk_writes_retried", "Of those, blocks staged again when the pool "
             "evicted them.", disk.num_writes_retried)):
        family = CounterMetricFamily(name, doc, labels=labels)
        family.add_metric([model_name], value)
        yield family
    for name, doc, value in (
            ("agentd:kv_disk_blocks", "KV blocks in the disk tier.", disk.num_blocks),
            ("agentd:kv_disk_bytes", "Bytes of the disk tier's segments.", disk.num_bytes),
            ("agentd:kv_disk_kept_bytes", "Of those, bytes of named sessions' blocks (kept over "
             "anonymous prefixes).", disk.kept_bytes),
            ("agentd:kv_disk_pinned_bytes", "Bytes of pins' blocks in the store (outside the "
             "budget).", disk.pinned_bytes),
            ("agentd:kv_disk_budget_bytes", "The disk tier's budget.", disk.budget_bytes),
            ("agentd:kv_disk_write_queue_blocks", "KV blocks waiting to be written.",
             disk.write_queue_blocks)):
        family = GaugeMetricFamily(name, doc, labels=labels)
        family.add_metric([model_name], value)
        yield family


def _router_families(model_name: str, stats: EngineStats) -> Iterator[Metric]:
    """What routers read besides the load gauges (SMG, llm-d): the share of prompt tokens served
    from the cache since start, and the pool's shape as vLLM's ``cache_config_info``."""
    rate = GaugeMetricFamily("vllm:gpu_prefix_cache_hit_rate",
                             "Prompt tokens served from the prefix cache / prompt tokens looked "
                             "up, since start (0-1).", labels=["model_name"])
    queries = stats.scheduler.prefix_cache_queries
    rate.add_metric([model_name], stats.scheduler.prefix_cache_hits / queries if queries else 0.0)
    yield rate
    plan = stats.kv_cache
    if plan is not None:
        info = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's configuration.",
                                 labels=["block_size", "num_gpu_blocks", "cache_dtype"])
        info.add_metric([str(plan.block_size), str(plan.num_blocks), plan.dtype], 1.0)
        yield info


def _pin_families(model_name: str, summary: PinSummary) -> Iterator[Metric]:
    labels = ["model_name", "pin", "owner"]  # owner: the pin's tenant id, "" server-wide
    hits = CounterMetricFamily("agentd:pin_hits", "Requests whose prompt matched a whole pin.",
                               labels=labels)
    served = CounterMetricFamily("agentd:pin_tokens_served",
                                 "Prompt tokens served from a pin's KV instead of a prefill.",
                                 labels=labels)
    blocks = GaugeMetricFamily("agentd:pin_blocks", "KV blocks held by a pin.", labels=labels)
    for pin in summary.pins:
        values = [model_name, pin.name, pin.owner or ""]
        hits.add_metric(values, pin.num_hits)
        served.add_metric(values, pin.num_tokens_served)
        blocks.add_metric(values, pin.num_blocks)
    near = CounterMetricFamily(
        "agentd:near_misses", "Requests that diverged from a pin before its end, by guessed cause.",
        labels=[*labels, "cause"])
    for c in summary.near_miss_counts:
        near.add_metric([model_name, c.pin, c.owner or "", c.cause], c.count)
    yield from (hits, served, blocks, near)


def _retained_families(model_name: str, stats: EngineStats,
                       summary: PinSummary) -> Iterator[Metric]:
    """Prefixes retained by cache control, summed per tenant (they have no names, and come and
    go too often to be labels); the blocks they hold (shared ones once); expiries and budget
    displacements since the start."""
    labels = ["model_name", "owner"]
    families = {
        "num": GaugeMetricFamily("agentd:retained_prefixes",
                                 "Prefixes held by cache control (retention) now.", labels=labels),
        "hits": GaugeMetricFamily("agentd:retained_hits",
                                  "Requests that hit a retained prefix now held, whole.",
                                  labels=labels),
        "ttl": GaugeMetricFamily("agentd:retained_min_ttl_left_seconds",
                                 "Seconds until the next retained prefix expires.", labels=labels),
    }
    now_s = time.monotonic()
    by_owner: dict[str, list[float]] = {}
    for r in summary.retained:
        row = by_owner.setdefault(r.owner or "", [0, 0, float("inf")])
        row[0] += 1
        row[1] += r.num_hits
        row[2] = min(row[2], max(r.expires_s - now_s, 0.0))
    for owner, row in by_owner.items():
        for family, value in zip(families.values(), row, strict=True):
            family.add_metric([model_name, owner], value)
    yield from families.values()
    blocks = GaugeMetricFamily("agentd:retained_blocks",
                               "KV blocks held by retained prefixes and by no pin, now.",
                               labels=["model_name"])
    blocks.add_metric([model_name], stats.pins.num_blocks_retained)
    yield blocks
    for name, doc, value in (
            ("agentd:retained_expired", "Retained prefixes that decayed at their TTL.",
             stats.num_retained_expired),
            ("agentd:retained_displaced",
             "Retained prefixes decayed early to make room in the pin budget.",
             stats.pins.num_retained_displaced)):
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([model_name], value)
        yield family


class ServerMetrics:
    """The app's registry: latency histograms fed by handlers, engine stats read at scrape."""

    def __init__(self, source: Callable[[], EngineSnapshot | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds", "Time from arrival to the first token.",
            labels, registry=self.registry, buckets=_LATENCY_BUCKETS_S)
        self.e2e_request_latency = Histogram(
            "vllm:e2e_request_latency_seconds", "Time from arrival to the last token.",
            labels, registry=self.registry, buckets=_LATENCY_BUCKETS_S)
        self.ttft_by_cache = Histogram(
            "agentd:time_to_first_token_seconds",
            "Time from arrival to the first token, by whether the prompt hit the prefix cache.",
            [*labels, "cache"], registry=self.registry, buckets=_LATENCY_BUCKETS_S)
        self.recent = RecentRequests()
        self.request_success = Counter(
            "vllm:request_success", "Finished requests by finish reason.",
            ["model_name", "finished_reason"], registry=self.registry)
        self.registry.register(_EngineCollector(source))

    def observe_finished(self, model_name: str, last: StreamDelta, finish_reason: str) -> None:
        """Record one finished request from its last delta (engine monotonic timestamps)."""
        if last.first_token_time_s is not None:
            ttft_s = max(last.first_token_time_s - last.arrival_time_s, 0.0)
            self.time_to_first_token.labels(model_name).observe(ttft_s)
            cache = "hit" if last.num_cached_tokens > 0 else "miss"
            self.ttft_by_cache.labels(model_name, cache).observe(ttft_s)
        self.recent.record(last)
        self.e2e_request_latency.labels(model_name).observe(
            max(time.monotonic() - last.arrival_time_s, 0.0))
        self.request_success.labels(model_name, finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
