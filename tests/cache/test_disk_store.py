"""The disk store on its own: blocks by chain hash, checked on every read, cut where torn,
within its budget, least recently used out first, its order kept across a reopen."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from agentd.cache import DiskKVStore, hash_block
from cache.disk_store import HEADER_BYTES, KEEP_S

BLOCK_BYTES = 4096
RECORD_BYTES = HEADER_BYTES + BLOCK_BYTES


def key(i: int) -> bytes:
    return hash_block(None, [i])


def payload(i: int) -> bytes:
    return bytes((i + j) % 251 for j in range(BLOCK_BYTES))


def read(store: DiskKVStore, k: bytes) -> bytes | None:
    out = bytearray(BLOCK_BYTES)
    half = BLOCK_BYTES // 2
    view = memoryview(out)
    return bytes(out) if store.read_into(k, [view[:half], view[half:]]) else None


def segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.seg"))


def test_a_block_reads_back_as_written_and_after_a_reopen(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path / "s", BLOCK_BYTES, 100 * RECORD_BYTES)
    assert store.put(key(1), [payload(1)[:100], payload(1)[100:]])
    assert not store.put(key(1), [payload(1)])  # there already: not written twice
    assert read(store, key(1)) == payload(1) and read(store, key(2)) is None
    assert store.count_leading([key(1), key(2), key(1)]) == 1
    store.close()
    again = DiskKVStore(tmp_path / "s", BLOCK_BYTES, 100 * RECORD_BYTES)
    assert len(again) == 1 and read(again, key(1)) == payload(1)
    assert stat.S_IMODE(os.stat(tmp_path / "s").st_mode) == 0o700
    for path in (tmp_path / "s").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_a_flipped_byte_is_never_served(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path / "s", BLOCK_BYTES, 100 * RECORD_BYTES)
    for i in range(3):
        store.put(key(i), [payload(i)])
    (segment,) = segments(tmp_path / "s")
    data = bytearray(segment.read_bytes())
    data[RECORD_BYTES + HEADER_BYTES + 7] ^= 0x40  # in block 1's payload
    segment.write_bytes(data)
    assert read(store, key(1)) is None and key(1) not in store  # dropped: recompute it
    assert read(store, key(0)) == payload(0) and read(store, key(2)) == payload(2)
    assert store.stats().num_rejected == 1


def test_a_torn_segment_is_cut_at_its_last_whole_record(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path / "s", BLOCK_BYTES, 100 * RECORD_BYTES)
    for i in range(3):
        store.put(key(i), [payload(i)])
    store.close()
    (segment,) = segments(tmp_path / "s")
    with segment.open("r+b") as f:  # a writer killed inside the third record
        f.truncate(2 * RECORD_BYTES + HEADER_BYTES + 100)
    again = DiskKVStore(tmp_path / "s", BLOCK_BYTES, 100 * RECORD_BYTES)
    assert len(again) == 2 and key(2) not in again
    assert segment.stat().st_size == 2 * RECORD_BYTES
    assert again.put(key(2), [payload(2)]) and read(again, key(2)) == payload(2)  # a new segment
    again.close()
    # a header whose own checksum fails cuts its segment there too
    data = bytearray(segment.read_bytes())
    data[RECORD_BYTES + 30] ^= 1
    segment.write_bytes(data)
    third = DiskKVStore(tmp_path / "s", BLOCK_BYTES, 100 * RECORD_BYTES)
    assert key(1) not in third and segment.stat().st_size == RECORD_BYTES
    assert read(third, key(0)) == payload(0) and read(third, key(2)) == payload(2)


def test_another_layout_is_emptied_not_read(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path / "s", BLOCK_BYTES, 100 * RECORD_BYTES)
    store.put(key(1), [payload(1)])
    store.close()
    other = DiskKVStore(tmp_path / "s", 2 * BLOCK_BYTES, 100 * RECORD_BYTES)
    assert len(other) == 0 and segments(tmp_path / "s") == []
    assert json.loads((tmp_path / "s" / "store.json").read_text())["block_bytes"] == \
        2 * BLOCK_BYTES


def test_the_budget_holds_and_the_least_recently_used_segment_leaves_first(
        tmp_path: Path) -> None:
    # segments of 4 records, room for 3 segments
    store = DiskKVStore(tmp_path / "s", BLOCK_BYTES, 12 * RECORD_BYTES, 4 * RECORD_BYTES)
    for i in range(12):
        store.put(key(i), [payload(i)])
        assert store.num_bytes <= 12 * RECORD_BYTES
    assert len(segments(tmp_path / "s")) == 3
    assert read(store, key(1)) == payload(1)  # the first segment is now the most recent
    for i in range(12, 16):
        store.put(key(i), [payload(i)])
    assert store.num_bytes <= 12 * RECORD_BYTES
    assert key(1) in store and key(5) not in store  # the second segment left, not the first
    store.close()
    again = DiskKVStore(tmp_path / "s", BLOCK_BYTES, 12 * RECORD_BYTES, 4 * RECORD_BYTES)
    assert read(again, key(12)) == payload(12)
    read(again, key(0))
    for i in range(16, 20):  # the order survived the reopen: the 3rd segment (8-11) goes
        again.put(key(i), [payload(i)])
    assert key(0) in again and key(12) in again and key(9) not in again
    assert again.num_bytes <= 12 * RECORD_BYTES


def test_sessions_blocks_outlast_anonymous_ones_and_the_order_survives_a_reopen(
        tmp_path: Path) -> None:
    # segments of 2 records, room for 3 segments: kept blocks 0-1 (a session's), then anonymous
    # churn, which evicts only anonymous segments however old the kept one is
    def open_store() -> DiskKVStore:
        return DiskKVStore(tmp_path / "s", BLOCK_BYTES, 6 * RECORD_BYTES, 2 * RECORD_BYTES)

    store = open_store()
    assert store.put(key(0), [payload(0)], keep=True) and store.put(key(1), [payload(1)], True)
    for i in range(10, 30):
        assert store.put(key(i), [payload(i)])
        assert store.num_bytes <= 6 * RECORD_BYTES
    assert store.holds(key(0), keep=True) and read(store, key(1)) == payload(1)
    assert store.stats().kept_bytes == 2 * RECORD_BYTES
    assert key(10) not in store and key(29) in store
    # an anonymous copy is promoted by a kept put (written again); a kept one is not rewritten
    assert not store.holds(key(28), keep=True) and store.put(key(28), [payload(28)], keep=True)
    assert not store.put(key(28), [payload(28)], keep=True) and store.holds(key(28), True)
    store.close()
    again = open_store()  # the kept copies are found as kept; the oldest anonymous leave first
    assert again.holds(key(0), True) and again.holds(key(28), True)
    assert [p.name.endswith(".keep.seg") for p in segments(tmp_path / "s")].count(True) == 2
    for i in range(30, 36):
        again.put(key(i), [payload(i)])
    assert all(again.holds(key(i), True) for i in (0, 1, 28))
    assert read(again, key(28)) == payload(28) and again.num_bytes <= 6 * RECORD_BYTES


def test_anonymous_blocks_never_evict_kept_ones_until_those_go_unused(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path / "s", BLOCK_BYTES, 4 * RECORD_BYTES, 2 * RECORD_BYTES)
    for i in range(4):
        assert store.put(key(i), [payload(i)], keep=True)
    assert not store.put(key(9), [payload(9)]) and key(9) not in store  # no room it may take
    assert store.put(key(4), [payload(4)], keep=True)  # sessions make room among themselves
    assert key(0) not in store and store.num_bytes <= 4 * RECORD_BYTES
    for segment in store._segments.values():  # a day unused: kept no more
        segment.last_used -= KEEP_S + 1
    assert store.put(key(9), [payload(9)]) and read(store, key(9)) == payload(9)


def test_a_budget_below_one_block_stores_nothing(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path / "s", BLOCK_BYTES, RECORD_BYTES - 1)
    assert not store.put(key(1), [payload(1)]) and len(store) == 0


def test_clear_removes_every_block(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path / "s", BLOCK_BYTES, 100 * RECORD_BYTES, 2 * RECORD_BYTES)
    for i in range(5):
        store.put(key(i), [payload(i)])
    assert store.clear() == 5 and len(store) == 0 and segments(tmp_path / "s") == []
    assert store.put(key(9), [payload(9)]) and read(store, key(9)) == payload(9)


def test_a_wrong_size_is_refused(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path / "s", BLOCK_BYTES, 100 * RECORD_BYTES)
    with pytest.raises(ValueError, match="4096 bytes"):
        store.put(key(1), [b"x" * 10])


# --- a writer killed at any moment, a disk that refuses ---------------------------------------
_WRITER = """
import sys
from pathlib import Path
from agentd.cache import DiskKVStore, hash_block
size, budget = int(sys.argv[2]), int(sys.argv[3])
store = DiskKVStore(Path(sys.argv[1]), size, budget, 8 * (64 + size))
i = int(sys.argv[4])
print("ready", flush=True)
while True:  # blocks whose bytes say which they are, until killed
    store.put(hash_block(None, [i]), [(i % 251).to_bytes(1, "little") * size])
    i += 1
"""


def test_a_writer_killed_at_random_moments_never_leaves_a_block_that_reads_wrong(
        tmp_path: Path) -> None:
    import random
    import signal
    import subprocess
    import sys
    import time

    rng = random.Random(0)
    directory, budget = tmp_path / "s", 40 * RECORD_BYTES  # eviction runs as well
    start = 0
    for _ in range(8):
        writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(directory),
                                   str(BLOCK_BYTES), str(budget), str(start)],
                                  stdout=subprocess.PIPE, text=True)
        assert writer.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.2))
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        store = DiskKVStore(directory, BLOCK_BYTES, budget, 8 * RECORD_BYTES)
        assert store.num_bytes <= budget
        found = 0
        for i in range(start + 60_000):
            if key(i) not in store:
                continue
            found += 1
            assert read(store, key(i)) == (i % 251).to_bytes(1, "little") * BLOCK_BYTES, i
        assert found == len(store) > 0
        start = max(i for i in range(start + 60_000) if key(i) in store) + 1
        store.close()


_FULL_DISK = """
import resource, signal, sys
from pathlib import Path
from agentd.cache import DiskKVStore, hash_block
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails (EFBIG)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
store = DiskKVStore(Path(sys.argv[1]), 4096, 2**30)
written = 0
try:
    for i in range(100):
        store.put(hash_block(None, [i]), [bytes([i]) * 4096])
        written += 1
except OSError as exc:
    print("refused", written, type(exc).__name__)
"""


def test_a_disk_that_refuses_a_write_leaves_the_written_blocks_readable(tmp_path: Path) -> None:
    import subprocess
    import sys

    limit = 5 * RECORD_BYTES + 100  # the sixth block is cut short
    done = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path / "s"), str(limit)],
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.split()[:2] == ["refused", "5"], done.stdout + done.stderr
    store = DiskKVStore(tmp_path / "s", BLOCK_BYTES, 2**30)
    assert len(store) == 5 and store.num_bytes == 5 * RECORD_BYTES
    assert all(read(store, key(i)) == bytes([i]) * BLOCK_BYTES for i in range(5))


def test_the_keys_that_enter_and_leave_are_reported_once_each(tmp_path: Path) -> None:
    """What the KV events of medium DISK are made of: a promoted copy is no new block, a stale
    copy that leaves with its segment no removed one."""
    store = DiskKVStore(tmp_path / "s", BLOCK_BYTES, 3 * RECORD_BYTES, 2 * RECORD_BYTES)
    stored: list[bytes] = []
    removed: list[bytes] = []
    store.on_stored, store.on_removed = stored.extend, removed.extend
    for i in range(2):
        store.put(key(i), [payload(i)])
    store.put(key(0), [payload(0)], keep=True)  # promoted: written again, not new
    assert stored == [key(0), key(1)] and removed == []
    store.put(key(2), [payload(2)])  # the anonymous segment (0 stale, 1) leaves
    assert removed == [key(1)] and set(store.keys()) == {key(0), key(2)}
    (segment,) = [p for p in segments(tmp_path / "s") if p.name.endswith(".keep.seg")]
    data = bytearray(segment.read_bytes())
    data[HEADER_BYTES + 9] ^= 1
    segment.write_bytes(data)
    assert read(store, key(0)) is None and removed == [key(1), key(0)]
    assert store.clear() == 1 and removed == [key(1), key(0), key(2)]


# --- pinned segments: a pin's records, outside the budget, never evicted ------------------------
def pinned(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.pin.seg"))


def test_pinned_records_outlast_the_budget_clear_and_a_reopen(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path / "s", BLOCK_BYTES, 4 * RECORD_BYTES, 2 * RECORD_BYTES)
    assert store.put_pinned((key(i), [payload(i)]) for i in range(6)) == 6  # over the budget
    assert len(pinned(tmp_path / "s")) == 1 and store.all_pinned(key(i) for i in range(6))
    for i in range(100, 120):  # churn: anonymous blocks evict each other, never the pinned
        store.put(key(i), [payload(i)])
    assert store.num_bytes <= 4 * RECORD_BYTES
    assert store.stats().pinned_bytes == 6 * RECORD_BYTES
    assert all(read(store, key(i)) == payload(i) for i in range(6))
    assert store.clear() == 4 and len(store) == 6  # clear keeps what pins hold
    store.close()
    again = DiskKVStore(tmp_path / "s", BLOCK_BYTES, RECORD_BYTES)  # a smaller budget, even
    assert again.all_pinned(key(i) for i in range(6))
    assert all(read(again, key(i)) == payload(i) for i in range(6))


def test_a_pinned_copy_outranks_and_replaces_older_copies(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path / "s", BLOCK_BYTES, 100 * RECORD_BYTES)
    store.put(key(1), [payload(2)])  # an anonymous copy (here: with other bytes)
    assert not store.all_pinned([key(1)])
    store.put_pinned([(key(1), [payload(1)])])
    assert read(store, key(1)) == payload(1) and store.all_pinned([key(1)])
    assert not store.put(key(1), [payload(3)], keep=True)  # a pinned copy is there already
    store.put_pinned([(key(1), [payload(4)])])  # written again: the newest pinned copy wins
    store.close()
    again = DiskKVStore(tmp_path / "s", BLOCK_BYTES, 100 * RECORD_BYTES)
    assert read(again, key(1)) == payload(4)


def test_released_pins_become_anonymous_or_go(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path / "s", BLOCK_BYTES, 100 * RECORD_BYTES)
    store.put_pinned((key(i), [payload(i)]) for i in range(3))  # pin a
    store.put_pinned((key(i), [payload(i)]) for i in range(10, 13))  # pin b
    a, b = pinned(tmp_path / "s")
    assert store.release_pins({key(0), key(10)}) == 0  # both still needed
    assert store.release_pins({key(11)}) == 1  # a no more: demoted
    assert pinned(tmp_path / "s") == [b] and not a.exists()
    assert a.with_name(a.name.replace(".pin", "")).exists()
    assert read(store, key(1)) == payload(1) and not store.all_pinned([key(1)])
    assert store.num_bytes == 3 * RECORD_BYTES and store.stats().pinned_bytes == 3 * RECORD_BYTES
    assert store.release_pins(set(), demote=False) == 1  # b: deleted
    assert segments(tmp_path / "s") == [a.with_name(a.name.replace(".pin", ""))]
    assert read(store, key(10)) is None


def test_a_torn_pinned_segment_keeps_its_whole_records(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path / "s", BLOCK_BYTES, 100 * RECORD_BYTES)
    store.put_pinned((key(i), [payload(i)]) for i in range(4))
    store.close()
    (segment,) = pinned(tmp_path / "s")
    with segment.open("r+b") as f:
        f.truncate(2 * RECORD_BYTES + 100)  # killed in the middle of the third record
    again = DiskKVStore(tmp_path / "s", BLOCK_BYTES, 100 * RECORD_BYTES)
    assert [read(again, key(i)) == payload(i) for i in range(4)] == [True, True, False, False]
    assert again.all_pinned([key(0), key(1)]) and not again.all_pinned([key(2)])


def test_another_models_pins_are_released_without_opening_its_store(tmp_path: Path) -> None:
    from agentd.cache import release_closed_pins

    store = DiskKVStore(tmp_path / "s", BLOCK_BYTES, 100 * RECORD_BYTES)
    store.put_pinned((key(i), [payload(i)]) for i in range(3))
    store.close()
    assert release_closed_pins(tmp_path / "s") == 1 and pinned(tmp_path / "s") == []
    again = DiskKVStore(tmp_path / "s", BLOCK_BYTES, 2 * RECORD_BYTES)  # now within the budget
    assert len(again) == 0 and again.num_bytes == 0  # one segment of 3 records: over, gone
