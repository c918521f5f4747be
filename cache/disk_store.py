"""A content-addressed store of KV blocks on disk: the tier under the pool.

A block is stored under its chain hash (which already names the model fingerprint and the
tenant's salt, :mod:`.hashing`) as one record appended to a segment file: a 64-byte header (magic,
the key, the payload's length and xxh3-64, the header's own xxh3-64) then the payload, the
block's KV bytes as the caller laid them out. The index (key -> segment, offset, length) lives in
memory and is rebuilt at open by reading the headers of every segment.

Invariants:
- A record is in the index only once all of its bytes were written; a read returns bytes only
  when the header, the key and the payload's checksum all match (else the record leaves the
  index and the caller recomputes). So a ``kill -9`` at any moment loses at most the records being
  written, and nothing torn or flipped is ever served: at open, a segment is cut at its first
  record that does not verify.
- The segments' bytes on disk never exceed ``budget_bytes``: before a record is appended, whole
  segments leave, least recently used first (a segment's last use is its newest record's write
  or read; kept across restarts in ``lru.json``).
- Two classes of segments: a record is written ``keep``-ed (the blocks of a session a client
  named) or not (anonymous prefixes), each class into its own segments (a kept one's file is
  ``NNNNNNNN.keep.seg``). Anonymous segments leave first; a kept one leaves before them only once
  unused for ``KEEP_S`` (it counts as anonymous then), and an anonymous record never makes a kept
  segment leave (it is not written when only they could make room). A block stored anonymously
  and then asked for by a session is written again, kept; the index holds the kept copy.
- Every directory is 0700, every file 0600. ``store.json`` names the layout (its version, the
  block's byte size); a directory that disagrees is emptied at open, never read.

Thread-safety: ``put`` (a writer thread), ``read_into`` (a loader thread) and ``__contains__``
(the engine thread) may run at once; the index and the segment table change under one lock, and
file I/O runs outside it.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from .hashing import BlockHash

MAGIC = b"AKVB"
VERSION = 1
HEADER_BYTES = 64
_HEADER = struct.Struct("<4sH2x16sQQ")  # magic, version, key, payload bytes, payload xxh3-64
_SEGMENT_SUFFIX = ".seg"
_KEEP_TAG = ".keep"
KEEP_S = 24 * 3600.0  # a kept segment unused this long is kept no more


@dataclass
class _Segment:
    seg_id: int
    path: Path
    fd: int
    num_bytes: int
    last_used: float  # wall clock, so that it means the same after a restart
    users: int = 0  # reads and writes in flight outside the lock
    dead: bool = False  # removed: its fd closes when the last user is done
    keys: list[BlockHash] = field(default_factory=list)  # its records' (a key may be stale)
    keep: bool = False  # a session's blocks: anonymous segments leave before it

    def kept(self, now: float) -> bool:
        """Whether it is still ahead of the anonymous segments in the eviction order."""
        return self.keep and now - self.last_used < KEEP_S


@dataclass(frozen=True)
class _Location:
    seg_id: int
    offset: int  # of the payload
    num_bytes: int
    checksum: int
    keep: bool = False  # in a kept segment


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
    num_segments: int
    oldest_use_s: float | None  # seconds since the least recently used segment's last use
    num_written: int
    num_read: int
    num_rejected: int  # records that failed their checks and were dropped


def _header(key: BlockHash, payload_bytes: int, checksum: int) -> bytes:
    head = _HEADER.pack(MAGIC, VERSION, key, payload_bytes, checksum)
    head += struct.pack("<Q", xxhash.xxh3_64_intdigest(head))
    return head + bytes(HEADER_BYTES - len(head))


def _parse_header(data: bytes) -> tuple[BlockHash, int, int] | None:
    """(key, payload bytes, payload checksum) of a header that verifies, else None."""
    if len(data) != HEADER_BYTES:
        return None
    size = _HEADER.size
    magic, version, key, payload_bytes, checksum = _HEADER.unpack_from(data)
    (own,) = struct.unpack_from("<Q", data, size)
    if magic != MAGIC or version != VERSION or own != xxhash.xxh3_64_intdigest(data[:size]):
        return None
    return key, payload_bytes, checksum


class DiskKVStore:
    """KV blocks on disk by chain hash, within a byte budget, least recently used out first."""

    def __init__(self, directory: Path, block_bytes: int, budget_bytes: int,
                 segment_bytes: int | None = None) -> None:
        """Open (or create) the store in ``directory`` for blocks of ``block_bytes`` bytes.

        Args:
            directory: this model's store (one per fingerprint, KV dtype and block size).
            block_bytes: every payload's size; a store of another size is emptied.
            budget_bytes: the most its segments may hold on disk.
            segment_bytes: the size at which a segment is sealed, the unit of eviction
                (default: a sixteenth of the budget, at most 256 MiB, at least 4 records).
        """
        if block_bytes <= 0 or budget_bytes < 0:
            raise ValueError(f"block_bytes {block_bytes} and budget_bytes {budget_bytes}")
        self.directory = directory
        self.block_bytes = block_bytes
        self.record_bytes = HEADER_BYTES + block_bytes
        self.budget_bytes = budget_bytes
        default = max(budget_bytes // 16, 4 * self.record_bytes)
        self.segment_bytes = max(segment_bytes or min(default, 256 * 2**20), self.record_bytes)
        self._lock = threading.Lock()
        self._index: dict[BlockHash, _Location] = {}
        self._segments: dict[int, _Segment] = {}
        self._active: dict[bool, _Segment] = {}  # the segment each class appends to
        self.num_written = self.num_read = self.num_rejected = 0
        # told the keys that enter and leave the store (KV events, medium DISK); set after open
        self.on_stored: Callable[[list[BlockHash]], None] | None = None
        self.on_removed: Callable[[list[BlockHash]], None] | None = None
        self._open()

    # --- open --------------------------------------------------------------------------------
    def _open(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.directory, 0o700)
        layout = {"version": VERSION, "block_bytes": self.block_bytes}
        meta = self.directory / "store.json"
        try:
            same = json.loads(meta.read_text()) == layout
        except (OSError, ValueError):
            same = False
        if not same:
            self._clear_files()
            _write_private(meta, json.dumps(layout).encode())
        uses = self._read_lru()
        found = []
        for path in self.directory.glob(f"*{_SEGMENT_SUFFIX}"):
            stem = path.name[:-len(_SEGMENT_SUFFIX)]
            keep = stem.endswith(_KEEP_TAG)
            try:
                found.append((int(stem.removesuffix(_KEEP_TAG)), keep, path))
            except ValueError:
                continue
        for seg_id, keep, path in sorted(found):
            self._scan(seg_id, path, uses.get(path.name), keep)
        self._evict_to(self.budget_bytes, keep=True)

    def _scan(self, seg_id: int, path: Path, last_used: float | None, keep: bool) -> None:
        """Index a segment's records, cutting it at the first that does not verify."""
        fd = os.open(path, os.O_RDWR)
        size = os.fstat(fd).st_size
        offset = 0
        keys: list[BlockHash] = []
        while offset + HEADER_BYTES <= size:
            parsed = _parse_header(os.pread(fd, HEADER_BYTES, offset))
            if parsed is None or parsed[1] != self.block_bytes:
                break
            key, payload_bytes, checksum = parsed
            if offset + HEADER_BYTES + payload_bytes > size:
                break  # torn: its writer died mid-record
            known = self._index.get(key)
            if known is None or keep or not known.keep:  # a kept copy wins, else the newest
                self._index[key] = _Location(seg_id, offset + HEADER_BYTES, payload_bytes,
                                             checksum, keep)
            keys.append(key)
            offset += HEADER_BYTES + payload_bytes
        if offset < size:
            os.ftruncate(fd, offset)
        if last_used is None:
            last_used = os.fstat(fd).st_mtime
        self._segments[seg_id] = _Segment(seg_id, path, fd, offset, last_used, keys=keys,
                                          keep=keep)

    def _read_lru(self) -> dict[str, float]:
        try:
            uses = json.loads((self.directory / "lru.json").read_text())
            return {str(k): float(v) for k, v in uses.items()}
        except (OSError, ValueError, AttributeError, TypeError):
            return {}

    def _clear_files(self) -> None:
        for path in self.directory.iterdir():
            if path.is_file():
                path.unlink(missing_ok=True)

    # --- queries -----------------------------------------------------------------------------
    def __contains__(self, key: BlockHash) -> bool:
        return key in self._index

    def keys(self) -> list[BlockHash]:
        with self._lock:
            return list(self._index)

    def holds(self, key: BlockHash, keep: bool = False) -> bool:
        """Whether the store has ``key`` (kept, where ``keep``: an anonymous copy does not
        count then)."""
        location = self._index.get(key)
        return location is not None and (location.keep or not keep)

    def __len__(self) -> int:
        return len(self._index)

    def count_leading(self, keys: Iterable[BlockHash]) -> int:
        """How many of ``keys``, from the first, the store holds without a gap."""
        count = 0
        for key in keys:
            if key not in self._index:
                break
            count += 1
        return count

    @property
    def num_bytes(self) -> int:
        return sum(seg.num_bytes for seg in self._segments.values())

    def stats(self) -> DiskStoreStats:
        with self._lock:
            segments = list(self._segments.values())
            oldest = min((seg.last_used for seg in segments), default=None)
            return DiskStoreStats(
                len(self._index), sum(seg.num_bytes for seg in segments), self.budget_bytes,
                sum(seg.num_bytes for seg in segments if seg.keep), len(segments),
                None if oldest is None else max(0.0, time.time() - oldest),
                self.num_written, self.num_read, self.num_rejected)

    # --- write -------------------------------------------------------------------------------
    def put(self, key: BlockHash, payload: Iterable[memoryview | bytes],
            keep: bool = False) -> bool:
        """Append one block (its payload in pieces, ``block_bytes`` in all), into a kept segment
        where ``keep``; False when it is there already (kept, where ``keep``) or cannot fit the
        budget. Raises OSError when the disk refuses (full)."""
        pieces = [memoryview(p).cast("B") for p in payload]
        if sum(len(p) for p in pieces) != self.block_bytes:
            raise ValueError(f"a block is {self.block_bytes} bytes, got "
                             f"{sum(len(p) for p in pieces)}")
        if self.holds(key, keep) or self.record_bytes > self.budget_bytes:
            return False
        digest = xxhash.xxh3_64()
        for piece in pieces:
            digest.update(piece)
        checksum = digest.intdigest()
        with self._lock:
            if not self._evict_to(self.budget_bytes - self.record_bytes, keep):
                return False  # only kept segments could make room, and this one is not kept
            segment = self._writable(keep)
            offset = segment.num_bytes
            segment.users += 1
        try:
            buffers = [_header(key, self.block_bytes, checksum), *pieces]
            written = os.pwritev(segment.fd, buffers, offset)
            if written != self.record_bytes:  # a short write: the disk is full
                os.ftruncate(segment.fd, offset)
                raise OSError(f"wrote {written} of {self.record_bytes} bytes of a KV block")
        finally:
            self._release(segment)
        with self._lock:
            if segment.dead:  # cleared while it was written
                return False
            segment.num_bytes = offset + self.record_bytes
            segment.last_used = time.time()
            segment.keys.append(key)
            new = key not in self._index  # else a kept copy of a stored block
            self._index[key] = _Location(segment.seg_id, offset + HEADER_BYTES,
                                         self.block_bytes, checksum, keep)
            self.num_written += 1
            if new and self.on_stored is not None:
                self.on_stored([key])
        return True

    def _writable(self, keep: bool) -> _Segment:
        """The segment the next record of its class goes to (under the lock; only the writer
        appends)."""
        active = self._active.get(keep)
        if active is None or active.dead or active.num_bytes + self.record_bytes > \
                self.segment_bytes:
            seg_id = max(self._segments, default=0) + 1
            tag = _KEEP_TAG if keep else ""
            path = self.directory / f"{seg_id:08d}{tag}{_SEGMENT_SUFFIX}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            active = self._active[keep] = _Segment(seg_id, path, fd, 0, time.time(), keep=keep)
            self._segments[seg_id] = active
        return active

    def _evict_to(self, limit_bytes: int, keep: bool) -> bool:
        """Remove segments, anonymous ones first, each class least recently used first, until
        the store holds at most ``limit_bytes`` (under the lock); kept segments only where
        ``keep``. Whether it holds that little now."""
        total = sum(seg.num_bytes for seg in self._segments.values())
        now = time.time()
        order = sorted(self._segments.values(), key=lambda s: (s.kept(now), s.last_used))
        for segment in order:
            if total <= limit_bytes:
                break
            if segment.kept(now) and not keep:
                return False
            total -= segment.num_bytes
            self._remove(segment)
        return total <= limit_bytes

    def _remove(self, segment: _Segment) -> None:
        del self._segments[segment.seg_id]
        removed = []
        for key in segment.keys:
            location = self._index.get(key)
            if location is not None and location.seg_id == segment.seg_id:
                del self._index[key]
                removed.append(key)
        if removed and self.on_removed is not None:
            self.on_removed(removed)
        segment.path.unlink(missing_ok=True)
        segment.dead = True
        if self._active.get(segment.keep) is segment:
            del self._active[segment.keep]
        if segment.users == 0:
            os.close(segment.fd)

    # --- read --------------------------------------------------------------------------------
    def read_into(self, key: BlockHash, out: Sequence[memoryview]) -> bool:
        """Read the block ``key`` into ``out`` (writable pieces, ``block_bytes`` in all, filled
        in order); False when the store does not hold it or its bytes fail their checks (it is
        dropped then, and what ``out`` holds must not be used)."""
        pieces = [memoryview(piece).cast("B") for piece in out]
        if sum(len(piece) for piece in pieces) != self.block_bytes:
            raise ValueError(f"a block is {self.block_bytes} bytes, got room for "
                             f"{sum(len(piece) for piece in pieces)}")
        with self._lock:
            location = self._index.get(key)
            segment = None if location is None else self._segments.get(location.seg_id)
            if location is None or segment is None:
                return False
            segment.users += 1
        try:
            head = os.pread(segment.fd, HEADER_BYTES, location.offset - HEADER_BYTES)
            num_read = os.preadv(segment.fd, pieces, location.offset)
        except OSError:
            head, num_read = b"", 0
        finally:
            self._release(segment)
        digest = xxhash.xxh3_64()
        for piece in pieces:
            digest.update(piece)
        if (_parse_header(head) != (key, self.block_bytes, location.checksum)
                or num_read != self.block_bytes or digest.intdigest() != location.checksum):
            self._reject(key, location)
            return False
        with self._lock:
            segment.last_used = time.time()
            self.num_read += 1
        return True

    def _release(self, segment: _Segment) -> None:
        with self._lock:
            segment.users -= 1
            if segment.dead and segment.users == 0:
                os.close(segment.fd)

    def _reject(self, key: BlockHash, location: _Location) -> None:
        with self._lock:
            if self._index.get(key) == location:
                del self._index[key]
                self.num_rejected += 1
                if self.on_removed is not None:
                    self.on_removed([key])

    # --- housekeeping ------------------------------------------------------------------------
    def save_lru(self) -> None:
        """Write each segment's last use to ``lru.json`` (atomically), for the next start."""
        with self._lock:
            uses = {seg.path.name: seg.last_used for seg in self._segments.values()}
        _write_private(self.directory / "lru.json", json.dumps(uses).encode())

    def clear(self) -> int:
        """Remove every block; returns how many there were."""
        with self._lock:
            num_blocks = len(self._index)
            for segment in list(self._segments.values()):
                self._remove(segment)
        return num_blocks

    def close(self) -> None:
        self.save_lru()
        with self._lock:
            for segment in self._segments.values():
                if segment.users == 0 and not segment.dead:
                    os.close(segment.fd)
                    segment.dead = True


def _write_private(path: Path, data: bytes) -> None:
    """Write ``path`` (0600) through a temp file and a rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
