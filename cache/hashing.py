"""Content hashes of full KV blocks, chained so a block's hash names its whole prefix.

Invariant: a block hash is a pure function of (parent hash, the block's token ids, extra bytes),
computed over canonical bytes (little-endian int32 token ids), so equal prefixes give equal hashes
on every host and in every run, and hashes may be persisted.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

BlockHash = bytes
"""A 16-byte xxh3_128 digest."""

_ROOT_PARENT = bytes(16)


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash one block of token ids, chained on its parent block's hash.

    Args:
        parent: hash of the previous block, or None for the first block of a sequence.
        token_ids: the block's token ids; each must fit in an int32.
        extra: bytes mixed in after the token ids (model fingerprint, cache salt).

    Returns:
        The 16-byte xxh3_128 digest of parent ‖ token ids (int32 LE) ‖ extra.
    """
    hasher = xxhash.xxh3_128()
    hasher.update(_ROOT_PARENT if parent is None else parent)
    hasher.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    hasher.update(extra)
    return hasher.digest()


def _block_extra(extra_key: bytes, cache_salt: str | None, block_index: int) -> bytes:
    # Length-prefix the extra key and tag the salt so (key, salt) pairs never alias each other.
    extra = struct.pack("<I", len(extra_key)) + extra_key
    if block_index == 0 and cache_salt is not None:
        extra += b"\x01" + cache_salt.encode("utf-8")
    return extra


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_key: bytes = b"",
    cache_salt: str | None = None,
    parent: BlockHash | None = None,
    start_block: int = 0,
) -> list[BlockHash]:
    """Hash the full blocks of a token sequence as one chain; a partial tail block is skipped.

    Args:
        token_ids: the whole sequence (not just the blocks being hashed).
        block_size: tokens per block.
        extra_key: the model fingerprint, mixed into every block.
        cache_salt: mixed into block 0 only, so every later block inherits it through the chain.
        parent: hash of block ``start_block - 1``; required when ``start_block > 0``.
        start_block: index of the first block to hash, to extend an existing chain.

    Returns:
        Hashes of full blocks ``start_block ..`` in order (empty if there are none).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if start_block < 0:
        raise ValueError(f"start_block must be >= 0, got {start_block}")
    if start_block > 0 and parent is None:
        raise ValueError("extending a chain (start_block > 0) needs the parent block hash")
    num_full_blocks = len(token_ids) // block_size
    block_hashes: list[BlockHash] = []
    for block_index in range(start_block, num_full_blocks):
        start = block_index * block_size
        extra = _block_extra(extra_key, cache_salt, block_index)
        parent = hash_block(parent, token_ids[start : start + block_size], extra)
        block_hashes.append(parent)
    return block_hashes


def hash_partial_block(
    token_ids: Sequence[int],
    block_size: int,
    extra_key: bytes = b"",
    cache_salt: str | None = None,
    parent: BlockHash | None = None,
) -> BlockHash | None:
    """The key of a sequence's last, partial block (a pin's tail), or None when it has none.

    Never a prefix-cache key: those name full blocks only. It hashes like the next block of the
    chain (``parent`` = the hash of the last full block) with a tag after the token ids, which no
    full block's bytes can spell: a token id's high byte is zero below 2**24, the tag's fourth
    byte is not.
    """
    num_full = len(token_ids) // block_size * block_size
    if num_full == len(token_ids):
        return None
    block_index = num_full // block_size
    extra = b"\x02partial" + _block_extra(extra_key, cache_salt, block_index)
    return hash_block(parent, token_ids[num_full:], extra)
