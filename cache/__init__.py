"""Paged KV-cache bookkeeping: block ids, ref counts, content hashes. No tensors, no torch.

Invariant: this package imports only the standard library and xxhash.
"""

from __future__ import annotations

from .block_pool import BlockPool, FreeBlockQueue, KVBlock, NoFreeBlocksError
from .hashing import BlockHash, hash_block, hash_blocks
from .kv_cache_manager import CachedPrefix, KVCacheManager, KVCopy
from .pins import (
    Pin,
    PinBudgetError,
    PinError,
    PinExistsError,
    PinKey,
    PinNotFoundError,
    PinRegistry,
    pin_key,
)
from .retention import RetainedPrefix, RetainedPrefixes

__all__ = [
    "BlockHash",
    "BlockPool",
    "CachedPrefix",
    "FreeBlockQueue",
    "KVBlock",
    "KVCacheManager",
    "KVCopy",
    "NoFreeBlocksError",
    "Pin",
    "PinBudgetError",
    "PinError",
    "PinExistsError",
    "PinKey",
    "PinNotFoundError",
    "PinRegistry",
    "RetainedPrefix",
    "RetainedPrefixes",
    "hash_block",
    "hash_blocks",
    "pin_key",
]
