"""The disk tier's engine side: computed blocks written behind the pool, stored blocks read back
into it (:class:`cache.disk_store.DiskKVStore` holds the bytes).

Invariants:
- The engine thread never waits on the disk. When the pool registers a full block, ``stage``
  copies its KV into a staging buffer (a few hundred KiB a block) and queues it for the writer
  thread; a queue past ``max_queue_bytes`` drops the write (counted) rather than wait. A block
  the store or the queue holds already is not staged again. A dropped block is staged again when
  the pool evicts it (``restage``, the last moment its KV exists), if the queue has room then; the
  tier remembers the last ``MAX_DROPPED`` dropped hashes for that.
- ``load`` hands a job to the loader thread: it reads stored blocks straight into pool blocks
  that one loading request holds and nothing else references (not hashed, not shared), in chain
  order, and stops at the first that fails its checks. The scheduler registers only the blocks
  that verified (``take_landed``), so a block read wrong is never served: it is recomputed.
- A disk that refuses a write (full, read-only) stops the writes with one warning; serving and
  reads go on.
- A session's blocks are staged ``keep``: the store keeps them over anonymous prefixes
  (:mod:`cache.disk_store`). The blocks a session found in the pool are staged kept as well, once,
  so that its whole prefix (a system prompt that an anonymous request computed first, say)
  outlives other prefixes' churn, not only the blocks it computed itself.

The pool's layers are ``[2, num_blocks, block_size, Hkv, D]`` underneath (keys, then values:
:mod:`agentd.engine.model_runner`); a stored block is each layer's keys then values, layer by
layer, in the pool's dtype.
"""

from __future__ import annotations

import logging
import queue
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from agentd.cache import BlockHash, DiskKVStore, LoadJob
from agentd.engine.kv_publisher import KVEventPublisher

logger = logging.getLogger("agentd")
DEFAULT_QUEUE_BYTES = 256 * 2**20
MAX_DROPPED = 1 << 16  # dropped writes remembered for a retry at eviction (hashes only)
MAX_DEFAULT_BUDGET_BYTES = 100 * 2**30
MEDIUM = "DISK"  # the tier's KV events' medium
_STOP = object()


@dataclass(frozen=True)
class DiskTierStats:
    """What ``/v1/stats`` reports under ``kv_disk``."""

    directory: str
    num_blocks: int
    num_bytes: int
    budget_bytes: int
    kept_bytes: int  # of num_bytes, sessions' blocks (kept over anonymous prefixes)
    pinned_bytes: int  # pins' blocks, beside num_bytes (outside the budget)
    oldest_use_s: float | None
    num_blocks_written: int
    num_blocks_read: int
    num_blocks_rejected: int  # read back and failed their checks: recomputed
    num_writes_dropped: int  # the queue was full
    num_writes_retried: int  # of those, staged again when the pool evicted the block
    write_queue_blocks: int
    num_loads: int
    load_s: float  # total time the loader spent reading
    writes_stopped: str | None  # why writes stopped (a full disk), else None


class NullDiskTier:
    """No disk tier: nothing is stored, nothing is found."""

    enabled = False

    def count_leading(self, block_hashes: Sequence[BlockHash]) -> int:
        return 0

    def stage(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash],
              keep: bool = False) -> None:
        pass

    def restage(self, block_id: int, block_hash: BlockHash) -> None:
        pass

    def load(self, job: LoadJob) -> None:
        raise RuntimeError("no disk tier to load from")

    def take_landed(self) -> list[LoadJob]:
        return []

    def wait_for_landing(self, timeout_s: float) -> None:
        pass

    def stats(self) -> DiskTierStats | None:
        return None

    def clear(self) -> int:
        return 0

    def close(self) -> None:
        pass


NULL_DISK_TIER = NullDiskTier()


def _pool_bytes(layer: torch.Tensor) -> np.ndarray:
    """A layer's pool as uint8 [2, num_blocks, bytes of one block's keys] (shares its memory)."""
    base = layer.transpose(0, 1)  # the storage's own order: keys of every block, then values
    if not base.is_contiguous() or base.device.type != "cpu":
        raise ValueError("the disk tier reads and writes a contiguous CPU pool")
    return base.view(torch.uint8).reshape(2, base.shape[1], -1).numpy()


class DiskTier:
    """Write-behind and read-ahead between the pool's layers and a :class:`DiskKVStore`."""

    enabled = True

    def __init__(self, store: DiskKVStore, kv_caches: list[torch.Tensor],
                 max_queue_bytes: int = DEFAULT_QUEUE_BYTES) -> None:
        self.store = store
        self._layers = [_pool_bytes(layer) for layer in kv_caches]
        self._piece_bytes = self._layers[0].shape[2]
        if 2 * len(self._layers) * self._piece_bytes != store.block_bytes:
            raise ValueError(f"the store's blocks are {store.block_bytes} bytes, the pool's "
                             f"{2 * len(self._layers) * self._piece_bytes}")
        self.max_queue_bytes = max_queue_bytes
        self._lock = threading.Lock()
        self._queued: dict[BlockHash, bool] = {}  # staged, not yet written: kept or not
        self._dropped: OrderedDict[BlockHash, bool] = OrderedDict()  # kept or not; oldest first
        self.num_writes_retried = 0
        self._writes: queue.Queue = queue.Queue()
        self._loads: queue.Queue = queue.Queue()
        self._landed: list[LoadJob] = []
        self._landing = threading.Event()
        self.num_writes_dropped = self.num_loads = 0
        self.load_s = 0.0
        self.writes_stopped: str | None = None
        self._threads = [threading.Thread(target=self._write_loop, name="agentd-kv-writer",
                                          daemon=True),
                         threading.Thread(target=self._load_loop, name="agentd-kv-loader",
                                          daemon=True)]
        for thread in self._threads:
            thread.start()

    # --- the engine thread -------------------------------------------------------------------
    def count_leading(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many of ``block_hashes``, from the first, the store holds without a gap."""
        return self.store.count_leading(block_hashes)

    def stage(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash],
              keep: bool = False) -> None:
        """Queue newly registered full blocks for the disk (a copy of their KV; no I/O), kept
        over anonymous prefixes where ``keep`` (a session's)."""
        if self.writes_stopped is not None:
            return
        with self._lock:
            new = [(b, h) for b, h in zip(block_ids, block_hashes, strict=True)
                   if self._queued.get(h, -1) < keep and not self.store.holds(h, keep)]
            if not new:
                return
            if (len(self._queued) + len(new)) * self.store.block_bytes > self.max_queue_bytes:
                self.num_writes_dropped += len(new)
                for _, h in new:  # for restage, when the pool evicts the block
                    self._dropped[h] = keep or self._dropped.pop(h, False)
                while len(self._dropped) > MAX_DROPPED:
                    self._dropped.popitem(last=False)
                return
            self._queued.update((h, keep) for _, h in new)
            for _, h in new:
                self._dropped.pop(h, None)
        ids = np.fromiter((b for b, _ in new), dtype=np.int64, count=len(new))
        staged = np.empty((len(new), 2 * len(self._layers), self._piece_bytes), np.uint8)
        for index, layer in enumerate(self._layers):
            np.take(layer[0], ids, axis=0, out=staged[:, 2 * index], mode="clip")
            np.take(layer[1], ids, axis=0, out=staged[:, 2 * index + 1], mode="clip")
        self._writes.put(([h for _, h in new], staged, keep))

    def restage(self, block_id: int, block_hash: BlockHash) -> None:
        """The pool is about to give ``block_id`` (holding ``block_hash``) to another use: stage it
        now if its write was dropped (a full queue then), since its KV is gone after this."""
        if block_hash not in self._dropped:  # the common case, one lookup
            return
        with self._lock:
            keep = self._dropped.pop(block_hash, None)
        if keep is None:
            return
        dropped = self.num_writes_dropped
        self.stage([block_id], [block_hash], keep)
        if self.num_writes_dropped == dropped:
            self.num_writes_retried += 1

    def load(self, job: LoadJob) -> None:
        """Read ``job``'s blocks into its pool blocks on the loader thread."""
        self._loads.put(job)

    def take_landed(self) -> list[LoadJob]:
        """The jobs the loader finished since the last call."""
        with self._lock:
            landed, self._landed = self._landed, []
            self._landing.clear()
        return landed

    def wait_for_landing(self, timeout_s: float) -> None:
        """Block until a job lands or ``timeout_s`` passes (an engine with nothing else to do)."""
        self._landing.wait(timeout_s)

    # --- the writer and the loader -----------------------------------------------------------
    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not _STOP:
            block_hashes, staged, keep = item
            for block_hash, payload in zip(block_hashes, staged, strict=True):
                try:
                    if self.writes_stopped is None:
                        self.store.put(block_hash, [payload.reshape(-1)], keep)
                except OSError as exc:
                    self.writes_stopped = f"{type(exc).__name__}: {exc}"
                    logger.warning("the KV disk tier stopped writing (%s); blocks already on "
                                   "disk are still read, serving goes on", self.writes_stopped)
                finally:
                    with self._lock:
                        if self._queued.get(block_hash) == keep:
                            del self._queued[block_hash]

    def _load_loop(self) -> None:
        while (job := self._loads.get()) is not _STOP:
            started = time.monotonic()
            for block_hash, block_id in zip(job.block_hashes, job.block_ids, strict=True):
                pieces = [memoryview(layer[half, block_id]) for layer in self._layers
                          for half in (0, 1)]
                if not self.store.read_into(block_hash, pieces):
                    break
                job.num_loaded += 1
            job.elapsed_s = time.monotonic() - started
            with self._lock:
                self.num_loads += 1
                self.load_s += job.elapsed_s
                self._landed.append(job)
                self._landing.set()

    # --- the rest ----------------------------------------------------------------------------
    def publish(self, publisher: KVEventPublisher) -> None:
        """Report the store's blocks as KV events of medium ``DISK``: those it holds now, then
        each that enters or leaves it."""
        self.store.on_stored = partial(publisher.tier_stored, MEDIUM)
        self.store.on_removed = partial(publisher.tier_removed, MEDIUM)
        keys = self.store.keys()
        for start in range(0, len(keys), 1024):
            publisher.tier_stored(MEDIUM, keys[start:start + 1024])

    def stats(self) -> DiskTierStats:
        store = self.store.stats()
        return DiskTierStats(
            str(self.store.directory), store.num_blocks, store.num_bytes, store.budget_bytes,
            store.kept_bytes, store.pinned_bytes, store.oldest_use_s, store.num_written,
            store.num_read, store.num_rejected, self.num_writes_dropped,
            self.num_writes_retried, len(self._queued), self.num_loads,
            self.load_s, self.writes_stopped)

    def clear(self) -> int:
        """Remove every stored block (the pool keeps its own); returns how many there were."""
        return self.store.clear()

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish the queued writes (for at most ``timeout_s``), stop the threads, keep the
        store's LRU order for the next start."""
        self._writes.put(_STOP)
        self._loads.put(_STOP)
        for thread in self._threads:
            thread.join(timeout_s)
        self.store.close()


def default_budget(directory: Path) -> int:
    """A quarter of the space free where the store lives, at most 100 GiB."""
    probe = directory
    while not probe.exists():
        probe = probe.parent
    return min(shutil.disk_usage(probe).free // 4, MAX_DEFAULT_BUDGET_BYTES)


def open_disk_tier(directory: str | None, budget_bytes: int | None, fingerprint: str,
                   block_size: int, kv_caches: list[torch.Tensor],
                   enabled: bool) -> DiskTier | NullDiskTier:
    """The tier for this pool, or the null one (no directory, no prefix caching, a GPU pool)."""
    if directory is None or not enabled:
        return NULL_DISK_TIER
    if kv_caches[0].device.type != "cpu":
        logger.info("the KV disk tier serves CPU pools only: off on %s", kv_caches[0].device)
        return NULL_DISK_TIER
    root = Path(directory).expanduser()
    budget = default_budget(root) if budget_bytes is None else budget_bytes
    store = open_store(root, fingerprint, block_size, kv_caches, budget)
    tier = DiskTier(store, kv_caches)
    stats = store.stats()
    logger.info("KV disk tier: %s, %d blocks (%.1f MiB) stored, budget %.1f GiB%s",
                store.directory, stats.num_blocks, stats.num_bytes / 2**20, budget / 2**30,
                "" if budget_bytes is not None else
                " (a quarter of the free disk, at most 100 GiB)")
    return tier


def open_store(root: Path, fingerprint: str, block_size: int, kv_caches: list[torch.Tensor],
               budget_bytes: int | None = None) -> DiskKVStore:
    """The block store of this model's pool under ``root`` (one directory per fingerprint and
    block size); its budget a quarter of the free disk unless given."""
    budget = default_budget(root) if budget_bytes is None else budget_bytes
    block_bytes = sum(layer[0].numel() * layer.element_size() for layer in kv_caches)
    return DiskKVStore(root / f"{fingerprint}-b{block_size}", block_bytes, budget)
