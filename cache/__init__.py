"""Paged KV-cache bookkeeping: block ids, ref counts, content hashes. No tensors, no torch.

Invariant: this package imports only the standard library and xxhash.
"""

from __future__ import annotations

from .block_pool import BlockPool, FreeBlockQueue, KVBlock, NoFreeBlocksError, PoolStats
from .disk_store import DiskKVStore, DiskStoreStats, LoadJob, release_closed_pins
from .hashing import BlockHash, hash_block, hash_blocks, hash_partial_block
from .holders import (
    CONVERSATION,
    PIN,
    REQUEST,
    RETAINED,
    BlockHolders,
    Owner,
)
from .kv_cache_manager import CachedPrefix, KVCacheManager, KVCopy
from .kv_events import (
    NULL_KV_EVENTS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventLog,
    KVEventSink,
    blocks_digest,
    replay,
)
from .pin_registry import (
    Pin,
    PinBudgetError,
    PinCounts,
    PinError,
    PinExistsError,
    PinKey,
    PinNotFoundError,
    PinRegistry,
    pin_key,
)
from .retained import RetainedPrefix, RetainedPrefixes
from .tails import KeptTail, TailHit, TailIndex, common_prefix_len

__all__ = [
    "NULL_KV_EVENTS",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventLog",
    "KVEventSink",
    "blocks_digest",
    "replay",
    "CONVERSATION",
    "PIN",
    "REQUEST",
    "RETAINED",
    "BlockHash",
    "BlockHolders",
    "BlockPool",
    "CachedPrefix",
    "DiskKVStore",
    "DiskStoreStats",
    "FreeBlockQueue",
    "KVBlock",
    "KVCacheManager",
    "KVCopy",
    "LoadJob",
    "KeptTail",
    "NoFreeBlocksError",
    "PoolStats",
    "Owner",
    "Pin",
    "PinBudgetError",
    "PinCounts",
    "PinError",
    "PinExistsError",
    "PinKey",
    "PinNotFoundError",
    "PinRegistry",
    "RetainedPrefix",
    "RetainedPrefixes",
    "TailHit",
    "TailIndex",
    "common_prefix_len",
    "hash_block",
    "hash_blocks",
    "hash_partial_block",
    "release_closed_pins",
    "pin_key",
]
