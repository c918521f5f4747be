"""A pin's KV out of the pool and back into it (the payload :mod:`agentd.pins.stored_kv` writes
and reads as records of the block store), and the KV snapshot files pins were kept in before
the store: where such a file lives, checking and loading it (a start migrates each once), and
writing one (what older versions did; tests and benchmarks make such state dirs with it).

Invariants: a snapshot is used only when its bytes hash to the xxh3-128 checksum stored beside it
(``NAME.pt.xxh3``, written after the snapshot); anything else is a ``SnapshotError`` and the caller
recomputes the pin. A loaded snapshot is restored only when the model fingerprint, the cache
salt, the token ids and every tensor shape match (else ``SnapshotMismatch``, and the caller
recomputes). File names are an injective function of (owner, name): two pins never share a
file. Files are 0600 and directories 0700 (see :mod:`agentd.pins.registry_file`). Taking and putting
KV run on the engine thread (no step writes under them); files are read and written elsewhere.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

import torch
import xxhash

from agentd.cache import Pin
from agentd.kernels.kv_quant import dtype_name
from agentd.pins.registry_file import fsync_dir, private_dir, write_atomic

CHECKSUM_SUFFIX = ".xxh3"
MAGIC = b"agentd-kv-snapshot 1\n"
_ALIGN = 64
_CHUNK_BYTES = 4 * 2**20
# int8: a q8_0 pool's bytes (agentd.kernels.kv_quant)
_DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "int8")}
_KEPT_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789.-")


class SnapshotError(Exception):
    """A snapshot that cannot be used: missing checksum, wrong bytes, or not loadable."""


class SnapshotMismatch(ValueError):
    """A snapshot that loaded but does not fit this pin, model or pool; the pin is recomputed."""


def file_stem(text: str) -> str:
    """An injective, case-safe file name for ``text``: lowercase letters, digits, '-' and (but
    first) '.' stay; every other byte of its UTF-8 becomes ``_xx`` (so ``abc_`` is ``abc_5f`` and
    ``abc\\n`` is ``abc_0a``, and ``A`` never meets ``a`` on a case-insensitive disk)."""
    return "".join(c if c in _KEPT_CHARS and (i or c != ".") else
                   "".join(f"_{b:02x}" for b in c.encode()) for i, c in enumerate(text))


def snapshot_dir(state_dir: Path, fingerprint: str, block_size: int) -> Path:
    return state_dir / "kv" / f"{fingerprint}-b{block_size}"


def snapshot_path(state_dir: Path, fingerprint: str, block_size: int, owner: str | None,
                  name: str) -> Path:
    """``kv/<fingerprint>-b<block size>/[tenant-<owner>/]<name>.pt``."""
    base = snapshot_dir(state_dir, fingerprint, block_size)
    if owner is not None:
        base = base / f"tenant-{file_stem(owner)}"
    return base / f"{file_stem(name)}.pt"


def checksum_path(path: Path) -> Path:
    return path.with_name(path.name + CHECKSUM_SUFFIX)


class _HashingWriter:
    """A file that hashes what passes through, in chunks: hashing or writing 100 MB in one call
    would hold the GIL (hashing) or the engine thread's CPU share for the whole of it."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.digest = xxhash.xxh3_128()
        self.num_bytes = 0

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), _CHUNK_BYTES):
            chunk = view[start:start + _CHUNK_BYTES]
            self.digest.update(chunk)
            self.f.write(chunk)
        self.num_bytes += len(view)

    def pad_to(self, alignment: int) -> None:
        self.write(bytes(-self.num_bytes % alignment))


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())


def write_snapshot(payload: dict[str, Any], path: Path, state_dir: Path) -> None:
    """Write a gathered snapshot, then its checksum beside it (each atomically, 0600).

    The format is ours, not a pickle: ``MAGIC``, an 8-byte little-endian header length, a JSON
    header (the payload's plain values, and each tensor's name, dtype and shape), then each
    tensor's raw bytes at a 64-byte aligned offset. Written from a worker thread in chunks, it
    never holds the GIL for long (``torch.save`` did: steps stalled while it wrote).
    """
    private_dir(path.parent, state_dir)
    tensors = {k: v for k, v in payload.items() if isinstance(v, torch.Tensor)}
    header = json.dumps({
        "meta": {k: v for k, v in payload.items() if k not in tensors},
        "tensors": [{"name": k, "dtype": str(v.dtype).removeprefix("torch."),
                     "shape": list(v.shape)} for k, v in tensors.items()]}).encode()
    writer: list[_HashingWriter] = []

    def save(f: IO[bytes]) -> None:
        writer.append(_HashingWriter(f))
        writer[0].write(MAGIC + len(header).to_bytes(8, "little") + header)
        for tensor in tensors.values():
            writer[0].pad_to(_ALIGN)
            writer[0].write(_tensor_bytes(tensor))
        f.flush()
        _test_pause()  # tests kill -9 the daemon here, with the snapshot half-committed

    write_atomic(path, save)
    checksum = {"xxh3_128": writer[0].digest.hexdigest(), "num_bytes": writer[0].num_bytes}
    write_atomic(checksum_path(path), lambda f: f.write(json.dumps(checksum).encode()))
    fsync_dir(path.parent)


def read_snapshot(path: Path) -> dict[str, Any]:
    """Load a snapshot whose bytes match its checksum; SnapshotError says why not."""
    try:
        checksum = json.loads(checksum_path(path).read_bytes())
        expected, num_bytes = checksum["xxh3_128"], checksum["num_bytes"]
    except FileNotFoundError:
        raise SnapshotError("it has no checksum beside it") from None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise SnapshotError(f"its checksum file is unreadable ({exc})") from None
    try:
        with path.open("rb") as f:
            data = bytearray(f.read())
    except OSError as exc:
        raise SnapshotError(f"it cannot be read ({exc})") from None
    if len(data) != num_bytes:
        raise SnapshotError(f"it is {len(data)} bytes, its checksum says {num_bytes}")
    digest = xxhash.xxh3_128()
    view = memoryview(data)
    for start in range(0, len(view), _CHUNK_BYTES):
        digest.update(view[start:start + _CHUNK_BYTES])
    if digest.hexdigest() != expected:
        raise SnapshotError("its bytes do not match its xxh3 checksum")
    try:
        return _parse(data)
    except Exception as exc:  # whatever is wrong inside, the answer is: recompute
        raise SnapshotError(f"it cannot be loaded ({type(exc).__name__}: {exc})") from None


def _parse(data: bytearray) -> dict[str, Any]:
    if not data.startswith(MAGIC):
        raise ValueError("not an agentd KV snapshot")
    start = len(MAGIC) + 8
    end = start + int.from_bytes(data[len(MAGIC):start], "little")
    header = json.loads(data[start:end])
    payload = dict(header["meta"])
    offset = end
    for spec in header["tensors"]:
        dtype = _DTYPES[spec["dtype"]]
        offset += -offset % _ALIGN
        num_bytes = math.prod(spec["shape"]) * dtype.itemsize
        if offset + num_bytes > len(data):
            raise ValueError(f"tensor {spec['name']} runs past the end")
        raw = torch.frombuffer(data, dtype=torch.uint8, count=num_bytes, offset=offset)
        payload[spec["name"]] = raw.view(dtype).reshape(spec["shape"])
        offset += num_bytes
    return payload


def remove_snapshot(path: Path) -> None:
    for item in (path, checksum_path(path)):
        item.unlink(missing_ok=True)


def remove_orphans(state_dir: Path, current: Path, keep: Iterable[Path]) -> list[Path]:
    """Delete snapshots in ``current`` that no registry entry names, and every other
    ``kv/<fingerprint>-b<size>`` directory (models or block sizes no longer in use). Temp files
    are left to ``remove_stale_temp_files``."""
    kv = state_dir / "kv"
    if not kv.is_dir():
        return []
    kept = {p for path in keep for p in (path, checksum_path(path))}
    removed: list[Path] = []
    for item in kv.iterdir():
        if item != current and item.is_dir():
            shutil.rmtree(item, ignore_errors=True)
            removed.append(item)
    if current.is_dir():
        for item in sorted(current.rglob("*"), reverse=True):  # files before their dirs
            if item.name.endswith(".tmp") or item in kept:
                continue
            if item.is_dir():
                if not any(item.iterdir()):
                    item.rmdir()
            else:
                item.unlink(missing_ok=True)
                removed.append(item)
    return removed


def _test_pause() -> None:
    """Tests only: hold for ``$AGENTD_TEST_PAUSE_SNAPSHOT_S`` seconds in the middle of writing a
    KV snapshot, so a test can ``kill -9`` the daemon with the snapshot half written."""
    pause_s = os.environ.get("AGENTD_TEST_PAUSE_SNAPSHOT_S")
    if pause_s:
        time.sleep(float(pause_s))


def snapshot_shape(pin: Pin, kv_caches: list[torch.Tensor]
                   ) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of the buffer ``gather_snapshot`` fills with the pin's full blocks."""
    first = kv_caches[0]
    return (len(kv_caches), pin.num_blocks, *first.shape[1:]), first.dtype

def gather_snapshot(pin: Pin, kv_caches: list[torch.Tensor], fingerprint: str,
                    out: torch.Tensor | None = None) -> dict[str, Any]:
    """Copy the pin's KV out of the pool (on the engine thread, so no step writes under it);
    :func:`agentd.pins.snapshots.write_snapshot` writes the result from another thread.

    ``out``: a buffer of ``snapshot_shape`` whose pages another thread has touched already,
    so the engine thread only copies (a fresh 100 MB buffer cost it 4x as long, page faults
    included).
    """
    first = kv_caches[0]
    index = torch.tensor(pin.block_ids, dtype=torch.long, device=first.device)
    shape, dtype = snapshot_shape(pin, kv_caches)
    if out is None or tuple(out.shape) != shape or out.dtype != dtype or out.is_cuda:
        out = torch.empty(shape, dtype=dtype)
    # One layer at a time into one buffer: stacking per-layer copies held the pin's KV twice
    # (+95 MB of RSS for a 2,064-token pin of the default model).
    for saved, layer in zip(out, kv_caches, strict=True):
        if layer.device == out.device:
            torch.index_select(layer, 0, index, out=saved)
        else:
            saved.copy_(layer.index_select(0, index))
    kv = out
    payload = {"fingerprint": fingerprint, "cache_salt": pin.cache_salt,
               "token_ids": pin.token_ids, "kv": kv}
    if pin.tail_block is not None:  # [layers, 2, tail tokens, Hkv, D]
        num_tail = len(pin.tail_token_ids)
        payload["tail_token_ids"] = pin.tail_token_ids
        payload["tail_kv"] = torch.stack([layer[pin.tail_block, :, :num_tail].cpu()
                                          for layer in kv_caches])
    return payload


def check_snapshot(payload: dict[str, Any], token_ids: list[int], cache_salt: str | None,
                   kv_caches: list[torch.Tensor], fingerprint: str,
                   num_full_tokens: int) -> torch.Tensor:
    """The snapshot's full-block KV, once it is known to fit; else SnapshotMismatch."""
    kv = payload.get("kv")
    num_blocks = num_full_tokens // kv_caches[0].shape[2]
    if payload.get("fingerprint") != fingerprint:
        raise SnapshotMismatch("it was taken with another model, dtype or tokenizer")
    if payload.get("cache_salt") != cache_salt:
        raise SnapshotMismatch("it was taken under another cache salt (tenant)")
    if payload.get("token_ids") != token_ids[:num_full_tokens]:
        raise SnapshotMismatch("its tokens differ from the pin's (the template changed?)")
    if isinstance(kv, torch.Tensor) and kv.dtype != kv_caches[0].dtype:
        # the fingerprint says so too; never convert silently (a q8_0 pool is int8)
        raise SnapshotMismatch(f"its KV is {dtype_name(kv.dtype)}, the pool's "
                               f"{dtype_name(kv_caches[0].dtype)} (another --kv-cache-dtype)")
    if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != (
            len(kv_caches), num_blocks, *kv_caches[0].shape[1:]):
        raise SnapshotMismatch("its KV tensor has the wrong shape for this model and pool")
    return kv

def snapshot_tail(payload: dict[str, Any], tail: list[int],
                  kv_caches: list[torch.Tensor]) -> torch.Tensor | None:
    """The KV of the pin's tail tokens, when the snapshot has it ([layers, 2, tail tokens, Hkv,
    D]); None for an older snapshot or a tail that changed (the pin goes without it)."""
    tail_kv = payload.get("tail_kv")
    if not tail or payload.get("tail_token_ids") != tail or not isinstance(
            tail_kv, torch.Tensor) or tuple(tail_kv.shape) != (
            len(kv_caches), 2, len(tail), *kv_caches[0].shape[3:]):
        return None
    return tail_kv


def put_snapshot(kv_caches: list[torch.Tensor], block_ids: list[int], kv: torch.Tensor,
                 tail: tuple[int, torch.Tensor] | None = None) -> None:
    """Copy a snapshot's full blocks into ``block_ids`` of the pool, and its tail's slots into
    ``tail`` (its block, its KV)."""
    new_ids = torch.tensor(block_ids, dtype=torch.long)
    for layer, saved in zip(kv_caches, kv, strict=True):
        layer.index_copy_(0, new_ids.to(layer.device),
                          saved.to(device=layer.device, dtype=layer.dtype))
    if tail is not None:
        block_id, tail_kv = tail
        for layer, saved in zip(kv_caches, tail_kv, strict=True):
            layer[block_id, :, :saved.shape[1]] = saved.to(device=layer.device, dtype=layer.dtype)
