"""The disk store's format: a record's header, the segment classes and their file names, the
in-memory index entries, and the small file helpers (:mod:`.disk_store` is the store itself).

A record is a 64-byte header (magic, version, the key, the payload's length and xxh3-64, the
header's own xxh3-64) then the payload. A segment's class is in its file name:
``NNNNNNNN.seg`` (anonymous), ``NNNNNNNN.keep.seg`` (kept: a session's blocks) and
``NNNNNNNN.pin.seg`` (pinned: a pin's blocks).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from .hashing import BlockHash

MAGIC = b"AKVB"
VERSION = 1
HEADER_BYTES = 64
HEADER = struct.Struct("<4sH2x16sQQ")  # magic, version, key, payload bytes, payload xxh3-64
SEGMENT_SUFFIX = ".seg"
KEEP_TAG = ".keep"
PIN_TAG = ".pin"
ANONYMOUS, KEPT, PINNED = 0, 1, 2  # segment classes, in the order they outrank each other
TAGS = {ANONYMOUS: "", KEPT: KEEP_TAG, PINNED: PIN_TAG}
KEEP_S = 24 * 3600.0  # a kept segment unused this long is kept no more


@dataclass
class Segment:
    seg_id: int
    path: Path
    fd: int
    num_bytes: int
    last_used: float  # wall clock, so that it means the same after a restart
    users: int = 0  # reads and writes in flight outside the lock
    dead: bool = False  # removed: its fd closes when the last user is done
    keys: list[BlockHash] = field(default_factory=list)  # its records' (a key may be stale)
    rank: int = ANONYMOUS  # its class: KEPT (a session's blocks) or PINNED outrank anonymous

    @property
    def keep(self) -> bool:
        return self.rank == KEPT

    def kept(self, now: float) -> bool:
        """Whether it is still ahead of the anonymous segments in the eviction order."""
        return self.rank == KEPT and now - self.last_used < KEEP_S


@dataclass(frozen=True)
class Location:
    seg_id: int
    offset: int  # of the payload
    num_bytes: int
    checksum: int
    rank: int = ANONYMOUS  # its segment's class


@dataclass
class LoadJob:
    """Blocks of one waiting request to read from the store into its own new pool blocks."""

    request_id: str
    block_hashes: list[BlockHash]  # the chain's next blocks after the pool's hits
    block_ids: list[int]  # where each goes (the request's, nothing else's)
    num_pool_tokens: int  # tokens before them that the pool had
    num_loaded: int = 0  # of block_hashes, from the first, verified and in the pool
    elapsed_s: float = 0.0


@dataclass(frozen=True)
class DiskStoreStats:
    num_blocks: int
    num_bytes: int
    budget_bytes: int
    kept_bytes: int  # of num_bytes, in kept segments (sessions' blocks)
    pinned_bytes: int  # in pinned segments, beside num_bytes (outside the budget)
    num_segments: int
    oldest_use_s: float | None  # seconds since the least recently used segment's last use
    num_written: int
    num_read: int
    num_rejected: int  # records that failed their checks and were dropped


def make_header(key: BlockHash, payload_bytes: int, checksum: int) -> bytes:
    head = HEADER.pack(MAGIC, VERSION, key, payload_bytes, checksum)
    head += struct.pack("<Q", xxhash.xxh3_64_intdigest(head))
    return head + bytes(HEADER_BYTES - len(head))


def parse_header(data: bytes) -> tuple[BlockHash, int, int] | None:
    """(key, payload bytes, payload checksum) of a header that verifies, else None."""
    if len(data) != HEADER_BYTES:
        return None
    size = HEADER.size
    magic, version, key, payload_bytes, checksum = HEADER.unpack_from(data)
    (own,) = struct.unpack_from("<Q", data, size)
    if magic != MAGIC or version != VERSION or own != xxhash.xxh3_64_intdigest(data[:size]):
        return None
    return key, payload_bytes, checksum


def release_closed_pins(directory: Path) -> int:
    """Make every pinned segment of a store no one has open (another model's: its pins now
    live in this model's store) an anonymous one, so that its blocks leave by LRU within that
    store's budget when it is next opened. Returns how many were released."""
    released = 0
    for path in directory.glob(f"*{PIN_TAG}{SEGMENT_SUFFIX}"):
        os.replace(path, path.with_name(path.name.replace(PIN_TAG, "", 1)))
        released += 1
    return released


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_private(path: Path, data: bytes) -> None:
    """Write ``path`` (0600) through a temp file and a rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
