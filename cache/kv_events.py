"""What a block pool tells routers about its content: hashed blocks stored, removed, cleared.

The pool reports each change of its hash -> block map to a ``KVEventSink`` as it happens: a run
of blocks registered under new hashes (``stored``, with the parent hash and the blocks' token
ids, as vLLM's ``BlockStored`` carries them) and a hash dropped by eviction (``removed``). A hash
that moves to another block (``BlockPool.allocate`` with ``move``) stays stored and is not
reported. The default sink does nothing; a publisher (:mod:`agentd.engine.kv_publisher`) queues the
events for a thread that sends them.

Invariant: replaying a sink's events from an empty set (``stored`` adds, ``removed`` discards,
``cleared`` empties) gives exactly the pool's hashed blocks at every moment. A block held by a
pin, a retained prefix or a request is never in the free queue, so its hash is never reported
removed while it is held.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol

from .hashing import BlockHash


class BlockStored(NamedTuple):
    """Consecutive blocks of one chain now held under these hashes."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None  # the hash of the block before the first; None: first
    token_ids: tuple[int, ...]  # every token of the blocks, in order


class BlockRemoved(NamedTuple):
    block_hashes: tuple[BlockHash, ...]


class AllBlocksCleared(NamedTuple):
    """No block is hashed any more (a new, empty pool)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventSink(Protocol):
    """Where the pool reports changes; called on the thread that changes the pool."""

    def stored(self, block_hashes: Sequence[BlockHash], parent_block_hash: BlockHash | None,
               token_ids: Sequence[int]) -> None: ...

    def removed(self, block_hash: BlockHash) -> None: ...


class NullKVEventSink:
    """The default: nobody listens."""

    def stored(self, block_hashes: Sequence[BlockHash], parent_block_hash: BlockHash | None,
               token_ids: Sequence[int]) -> None:
        return None

    def removed(self, block_hash: BlockHash) -> None:
        return None


NULL_KV_EVENTS = NullKVEventSink()


class KVEventLog:
    """A sink that keeps the events in a list, in order (tests, and a publisher's tap)."""

    def __init__(self) -> None:
        self.events: list[KVEvent] = []

    def stored(self, block_hashes: Sequence[BlockHash], parent_block_hash: BlockHash | None,
               token_ids: Sequence[int]) -> None:
        self.events.append(BlockStored(tuple(block_hashes), parent_block_hash, tuple(token_ids)))

    def removed(self, block_hash: BlockHash) -> None:
        self.events.append(BlockRemoved((block_hash,)))

    def take(self) -> list[KVEvent]:
        """The events since the last call."""
        events, self.events = self.events, []
        return events


def replay(events: Sequence[KVEvent], into: set[BlockHash] | None = None) -> set[BlockHash]:
    """The hashed blocks a subscriber knows after ``events`` (added to ``into`` when given)."""
    blocks = set() if into is None else into
    for event in events:
        if isinstance(event, BlockStored):
            blocks.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            blocks.difference_update(event.block_hashes)
        else:
            blocks.clear()
    return blocks


def blocks_digest(block_hashes: Iterable[BlockHash]) -> str:
    """One short name for a set of hashed blocks (sha256 of them sorted), so a subscriber's set
    and a pool's can be compared without shipping either."""
    digest = hashlib.sha256()
    for block_hash in sorted(block_hashes):
        digest.update(block_hash)
    return digest.hexdigest()[:32]
