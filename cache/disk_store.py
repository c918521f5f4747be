"""A content-addressed store of KV blocks on disk: the tier under the pool, and pins' KV.

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
- A third class holds pins (``NNNNNNNN.pin.seg``, one segment or more a pin write,
  ``put_pinned``): no budget applies to it and nothing evicts it (``clear`` neither); it leaves
  only through ``release_pins``, once no pin the caller names needs a record in it (demoted to an
  anonymous segment then, or deleted). A key's index entry names its copy of the highest class
  (pinned, kept, anonymous), the newest among equals.
- Every directory is 0700, every file 0600. ``store.json`` names the layout (its version, the
  block's byte size); a directory that disagrees is emptied at open, never read.

Thread-safety: ``put`` (a writer thread), ``read_into`` (a loader thread) and ``__contains__``
(the engine thread) may run at once; the index and the segment table change under one lock, and
file I/O runs outside it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import xxhash

from .disk_format import (
    ANONYMOUS,
    HEADER_BYTES,
    KEEP_S,
    KEPT,
    PINNED,
    SEGMENT_SUFFIX,
    TAGS,
    VERSION,
    DiskStoreStats,
    LoadJob,
    Location,
    Segment,
    fsync_dir,
    make_header,
    parse_header,
    release_closed_pins,
    write_private,
)
from .hashing import BlockHash

__all__ = ["HEADER_BYTES", "KEEP_S", "DiskKVStore", "DiskStoreStats", "LoadJob",
           "release_closed_pins"]


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
        self._index: dict[BlockHash, Location] = {}
        self._segments: dict[int, Segment] = {}
        self._active: dict[int, Segment] = {}  # the segment each class appends to
        self.num_written = self.num_read = self.num_rejected = 0
        # told the keys that enter and leave the store (KV events, medium DISK); set after open
        self.on_stored: Callable[[list[BlockHash]], None] | None = None
        self.on_removed: Callable[[list[BlockHash]], None] | None = None
        self._open()

    # --- open --------------------------------------------------------------------------------
    def _open(self) -> None:
        missing = [d for d in (self.directory, *self.directory.parents) if not d.exists()]
        for directory in reversed(missing):  # the ones it makes, private (a parent's too)
            directory.mkdir(mode=0o700, exist_ok=True)
            os.chmod(directory, 0o700)
        os.chmod(self.directory, 0o700)
        layout = {"version": VERSION, "block_bytes": self.block_bytes}
        meta = self.directory / "store.json"
        try:
            same = json.loads(meta.read_text()) == layout
        except (OSError, ValueError):
            same = False
        if not same:
            self._clear_files()
            write_private(meta, json.dumps(layout).encode())
        uses = self._read_lru()
        found = []
        for path in self.directory.glob(f"*{SEGMENT_SUFFIX}"):
            stem = path.name[:-len(SEGMENT_SUFFIX)]
            rank = next((r for r, tag in TAGS.items() if tag and stem.endswith(tag)), ANONYMOUS)
            try:
                found.append((int(stem.removesuffix(TAGS[rank])), rank, path))
            except ValueError:
                continue
        for seg_id, rank, path in sorted(found):
            self._scan(seg_id, path, uses.get(path.name), rank)
        self._evict_to(self.budget_bytes, keep=True)

    def _scan(self, seg_id: int, path: Path, last_used: float | None, rank: int) -> None:
        """Index a segment's records, cutting it at the first that does not verify."""
        fd = os.open(path, os.O_RDWR)
        size = os.fstat(fd).st_size
        offset = 0
        keys: list[BlockHash] = []
        while offset + HEADER_BYTES <= size:
            parsed = parse_header(os.pread(fd, HEADER_BYTES, offset))
            if parsed is None or parsed[1] != self.block_bytes:
                break
            key, payload_bytes, checksum = parsed
            if offset + HEADER_BYTES + payload_bytes > size:
                break  # torn: its writer died mid-record
            known = self._index.get(key)
            if known is None or rank >= known.rank:  # the highest class wins, else the newest
                self._index[key] = Location(seg_id, offset + HEADER_BYTES, payload_bytes,
                                             checksum, rank)
            keys.append(key)
            offset += HEADER_BYTES + payload_bytes
        if offset < size:
            os.ftruncate(fd, offset)
        if last_used is None:
            last_used = os.fstat(fd).st_mtime
        self._segments[seg_id] = Segment(seg_id, path, fd, offset, last_used, keys=keys,
                                          rank=rank)

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
        return location is not None and location.rank >= (KEPT if keep else ANONYMOUS)

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
        """Bytes within the budget: every segment but the pinned ones."""
        return sum(seg.num_bytes for seg in self._segments.values() if seg.rank != PINNED)

    def all_pinned(self, keys: Iterable[BlockHash]) -> bool:
        """Whether every key of ``keys`` has a pinned copy."""
        with self._lock:
            return all((loc := self._index.get(key)) is not None and loc.rank == PINNED
                       for key in keys)

    def stats(self) -> DiskStoreStats:
        with self._lock:
            pinned = [seg for seg in self._segments.values() if seg.rank == PINNED]
            segments = [seg for seg in self._segments.values() if seg.rank != PINNED]
            oldest = min((seg.last_used for seg in segments), default=None)
            return DiskStoreStats(
                len(self._index), sum(seg.num_bytes for seg in segments), self.budget_bytes,
                sum(seg.num_bytes for seg in segments if seg.keep),
                sum(seg.num_bytes for seg in pinned), len(segments),
                None if oldest is None else max(0.0, time.time() - oldest),
                self.num_written, self.num_read, self.num_rejected)

    # --- write -------------------------------------------------------------------------------
    def put(self, key: BlockHash, payload: Iterable[memoryview | bytes],
            keep: bool = False) -> bool:
        """Append one block (its payload in pieces, ``block_bytes`` in all), into a kept segment
        where ``keep``; False when it is there already (kept, where ``keep``) or cannot fit the
        budget. Raises OSError when the disk refuses (full)."""
        pieces = self._pieces(payload)
        if self.holds(key, keep) or self.record_bytes > self.budget_bytes:
            return False
        checksum = _checksum(pieces)
        with self._lock:
            if not self._evict_to(self.budget_bytes - self.record_bytes, keep):
                return False  # only kept segments could make room, and this one is not kept
            rank = KEPT if keep else ANONYMOUS
            segment = self._writable(rank)
            offset = segment.num_bytes
            segment.users += 1
        self._write_record(segment, offset, key, pieces, checksum)
        return self._commit(segment, offset, key, checksum, rank)  # False: cleared meanwhile

    def put_pinned(self, records: Iterable[tuple[BlockHash, Iterable[memoryview | bytes]]]
                   ) -> int:
        """Append a pin's records (key, payload in pieces) to a pinned segment of their own,
        outside the budget, then flush it to the disk (fsync); each is in the index once its
        bytes are written, in place of any older copy (so a copy that went bad is replaced, not
        trusted). Returns how many were written; raises OSError when the disk refuses (the
        records written before stay)."""
        segment = None
        num_written = 0
        try:
            for key, payload in records:
                pieces = self._pieces(payload)
                checksum = _checksum(pieces)
                with self._lock:
                    if segment is None:
                        segment = self._new_segment(PINNED)
                    offset = segment.num_bytes
                    segment.users += 1
                self._write_record(segment, offset, key, pieces, checksum)
                if not self._commit(segment, offset, key, checksum, PINNED):
                    raise OSError("the pinned segment was removed while it was written")
                num_written += 1
            if segment is not None:
                os.fsync(segment.fd)
                fsync_dir(self.directory)
        finally:
            if segment is not None and segment.num_bytes == 0:
                with self._lock:
                    if not segment.dead:
                        self._remove(segment)
        return num_written

    def _pieces(self, payload: Iterable[memoryview | bytes]) -> list[memoryview]:
        pieces = [memoryview(p).cast("B") for p in payload]
        if sum(len(p) for p in pieces) != self.block_bytes:
            raise ValueError(f"a block is {self.block_bytes} bytes, got "
                             f"{sum(len(p) for p in pieces)}")
        return pieces

    def _write_record(self, segment: Segment, offset: int, key: BlockHash,
                      pieces: list[memoryview], checksum: int) -> None:
        """Write a record at ``offset`` of ``segment`` (outside the lock; the caller counted
        itself among its users); a short write (a full disk) is cut off and raises OSError."""
        try:
            written = os.pwritev(segment.fd, [make_header(key, self.block_bytes, checksum),
                                              *pieces], offset)
            if written != self.record_bytes:
                os.ftruncate(segment.fd, offset)
                raise OSError(f"wrote {written} of {self.record_bytes} bytes of a KV block")
        finally:
            self._release(segment)

    def _commit(self, segment: Segment, offset: int, key: BlockHash, checksum: int,
                rank: int) -> bool:
        """Count a written record in its segment and index it unless a copy of a higher class
        is there; False when the segment was removed while it was written."""
        with self._lock:
            if segment.dead:
                return False
            segment.num_bytes = offset + self.record_bytes
            segment.last_used = time.time()
            segment.keys.append(key)
            known = self._index.get(key)  # else a copy of a stored block, kept or pinned
            if known is None or known.rank <= rank:
                self._index[key] = Location(segment.seg_id, offset + HEADER_BYTES,
                                            self.block_bytes, checksum, rank)
            self.num_written += 1
            if known is None and self.on_stored is not None:
                self.on_stored([key])
        return True

    def release_pins(self, needed: Iterable[BlockHash], demote: bool = True) -> int:
        """Let go of the pinned segments in which no key of ``needed`` has its indexed copy:
        each becomes an anonymous segment (``demote``: its blocks then leave by LRU, as an
        unpinned prefix's do in the pool) or is deleted. Returns how many segments went."""
        needed = set(needed)
        released = 0
        with self._lock:
            for segment in [s for s in self._segments.values() if s.rank == PINNED]:
                if any(key in needed and (loc := self._index.get(key)) is not None
                       and loc.seg_id == segment.seg_id for key in segment.keys):
                    continue
                released += 1
                if not demote:
                    self._remove(segment)
                    continue
                path = self.directory / f"{segment.seg_id:08d}{SEGMENT_SUFFIX}"
                os.replace(segment.path, path)
                segment.path, segment.rank, segment.last_used = path, ANONYMOUS, time.time()
                for key in segment.keys:
                    location = self._index.get(key)
                    if location is not None and location.seg_id == segment.seg_id:
                        self._index[key] = dataclasses.replace(location, rank=ANONYMOUS)
            if released and demote:
                self._evict_to(self.budget_bytes, keep=True)
        return released

    def _writable(self, rank: int) -> Segment:
        """The segment the next record of its class goes to (under the lock; only the writer
        appends)."""
        active = self._active.get(rank)
        if active is None or active.dead or active.num_bytes + self.record_bytes > \
                self.segment_bytes:
            active = self._active[rank] = self._new_segment(rank)
        return active

    def _new_segment(self, rank: int) -> Segment:
        """A new empty segment file of class ``rank`` (under the lock)."""
        seg_id = max(self._segments, default=0) + 1
        path = self.directory / f"{seg_id:08d}{TAGS[rank]}{SEGMENT_SUFFIX}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        segment = self._segments[seg_id] = Segment(seg_id, path, fd, 0, time.time(), rank=rank)
        return segment

    def _evict_to(self, limit_bytes: int, keep: bool) -> bool:
        """Remove segments, anonymous ones first, each class least recently used first, until
        the store holds at most ``limit_bytes`` (under the lock); kept segments only where
        ``keep``. Whether it holds that little now."""
        unpinned = [seg for seg in self._segments.values() if seg.rank != PINNED]
        total = sum(seg.num_bytes for seg in unpinned)
        now = time.time()
        order = sorted(unpinned, key=lambda s: (s.kept(now), s.last_used))
        for segment in order:
            if total <= limit_bytes:
                break
            if segment.kept(now) and not keep:
                return False
            total -= segment.num_bytes
            self._remove(segment)
        return total <= limit_bytes

    def _remove(self, segment: Segment) -> None:
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
        if self._active.get(segment.rank) is segment:
            del self._active[segment.rank]
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
        if (parse_header(head) != (key, self.block_bytes, location.checksum)
                or num_read != self.block_bytes or _checksum(pieces) != location.checksum):
            self._reject(key, location)
            return False
        with self._lock:
            segment.last_used = time.time()
            self.num_read += 1
        return True

    def _release(self, segment: Segment) -> None:
        with self._lock:
            segment.users -= 1
            if segment.dead and segment.users == 0:
                os.close(segment.fd)

    def _reject(self, key: BlockHash, location: Location) -> None:
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
        write_private(self.directory / "lru.json", json.dumps(uses).encode())

    def clear(self) -> int:
        """Remove every block but the pinned ones; returns how many there were."""
        with self._lock:
            num_blocks = len(self._index)
            for segment in list(self._segments.values()):
                if segment.rank != PINNED:
                    self._remove(segment)
            return num_blocks - len(self._index)

    def close(self) -> None:
        self.save_lru()
        with self._lock:
            for segment in self._segments.values():
                if segment.users == 0 and not segment.dead:
                    os.close(segment.fd)
                    segment.dead = True


def _checksum(pieces: list[memoryview]) -> int:
    digest = xxhash.xxh3_64()
    for piece in pieces:
        digest.update(piece)
    return digest.intdigest()
