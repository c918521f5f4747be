"""A pin's KV in the block store (:class:`agentd.cache.DiskKVStore`), the one persistence for
every block: each full block is a record under its chain hash (the pool's own key, so pins and the
disk tier share one store and one format), the tail a record under its partial-block key
(``hash_partial_block``). Pins' records go into pinned segments: outside the store's budget and
never evicted while the pin exists (``DiskKVStore.release_pins``).

Invariants: a record's payload is one pool block, each layer's keys then values in the pool's
dtype (the disk tier's layout); the tail's record is its whole block with the slots past the tail
zeroed. The keys name the model fingerprint, KV dtype, block size (the store's directory), the
tenant's salt and every token, so a record found is this pin's; its bytes are served only once
they match their checksum. A pin is restored only when every record of it is there and verifies,
else ``StoredKVError`` says which and the pin is recomputed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from agentd.cache import BlockHash, DiskKVStore


class StoredKVError(Exception):
    """A pin's KV that is not (all) in the store, or that failed its checks there."""


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's bytes (shares its memory; writable)."""
    return tensor.view(-1).view(torch.uint8).numpy()


def _records(keys: Sequence[BlockHash], payload: dict[str, Any]
             ) -> Iterator[tuple[BlockHash, list[np.ndarray]]]:
    kv = payload["kv"]  # [layers, blocks, 2, block size, Hkv, D]
    num_blocks = kv.shape[1]
    tail_kv = payload.get("tail_kv")  # [layers, 2, tail tokens, Hkv, D]
    if len(keys) != num_blocks + (tail_kv is not None):
        raise ValueError(f"{len(keys)} keys for {num_blocks} blocks"
                         f"{' and a tail' if tail_kv is not None else ''}")
    pause_after = num_blocks // 2 if os.environ.get("AGENTD_TEST_PAUSE_PIN_KV_S") else -1
    for index in range(num_blocks):
        if index == pause_after:
            _test_pause()
        yield keys[index], [_bytes(layer[index]) for layer in kv]
    if tail_kv is not None:
        block = torch.zeros((kv.shape[0], *kv.shape[2:]), dtype=kv.dtype)
        block[:, :, :tail_kv.shape[2]] = tail_kv
        yield keys[num_blocks], [_bytes(layer) for layer in block]


def write_pin_kv(store: DiskKVStore, keys: Sequence[BlockHash], payload: dict[str, Any]) -> int:
    """Write a gathered pin (``gather_snapshot``'s payload) as pinned records under ``keys``
    (``pin_record_keys``: its blocks', then its tail's), flushed to the disk; returns how many
    were written. Raises OSError."""
    return store.put_pinned(_records(keys, payload))


def read_pin_kv(store: DiskKVStore, keys: Sequence[BlockHash], token_ids: Sequence[int],
                block_size: int, layout: tuple[int, tuple[int, ...], torch.dtype],
                fingerprint: str, cache_salt: str | None) -> dict[str, Any]:
    """The pin's KV read back from the store, as the payload ``PinManager.restore_snapshot``
    takes; StoredKVError when a record is missing or fails its checks."""
    num_layers, block_shape, dtype = layout
    num_full = len(token_ids) // block_size * block_size
    num_blocks = num_full // block_size
    tail = list(token_ids[num_full:])
    if len(keys) != num_blocks + bool(tail):
        raise ValueError(f"{len(keys)} keys for {num_blocks} blocks and {len(tail)} tail tokens")
    missing = sum(key not in store for key in keys)
    if missing:
        raise StoredKVError(f"{missing} of its {len(keys)} blocks are not in the store")
    kv = torch.empty((num_layers, num_blocks, *block_shape), dtype=dtype)
    tail_block = torch.empty((num_layers, *block_shape), dtype=dtype)
    for index, key in enumerate(keys):
        layers = kv[:, index] if index < num_blocks else tail_block
        if not store.read_into(key, [_bytes(layer) for layer in layers]):
            raise StoredKVError(f"its block {index + 1} of {len(keys)} failed its checks in "
                                "the store (dropped)")
    payload: dict[str, Any] = {"fingerprint": fingerprint, "cache_salt": cache_salt,
                               "token_ids": list(token_ids[:num_full]), "kv": kv}
    if tail:
        payload["tail_token_ids"] = tail
        payload["tail_kv"] = tail_block[:, :, :len(tail)]
    return payload


def _test_pause() -> None:
    """Tests only: hold for ``$AGENTD_TEST_PAUSE_PIN_KV_S`` seconds halfway through writing a
    pin's records, so a test can ``kill -9`` the daemon with the pin half stored."""
    time.sleep(float(os.environ.get("AGENTD_TEST_PAUSE_PIN_KV_S") or 0))
