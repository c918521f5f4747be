"""Pins as the daemon offers them: template-aware token selection, tenant name spaces, the
persisted registry (:mod:`agentd.pins.registry_file`) and the pins' KV in the block store
(:mod:`agentd.pins.stored_kv`), migrated from the KV snapshot files of older versions
(:mod:`agentd.pins.snapshots`).

Invariants: a pin is rendered and tokenised in a worker thread (never on the event loop); a
pin is reported registered only once its blocks are pinned in the engine and ``pins.json``
lists it, and unpinned only once ``pins.json`` no longer does: when the registry cannot be
written (a full or unwritable state dir) the call raises ``PinStorageError`` (507) and nothing
changes, in the engine or on disk; a pin that decays is dropped from ``pins.json`` at the next
write that succeeds (each later sync retries a failed one); a pin's stored KV is only reused when
every record of it is in the store (keyed by model fingerprint, KV dtype, block size, cache salt
and tokens) and matches its checksum, otherwise the pin is recomputed and the report says why; a
pin listed in ``pins.json`` stays listed there until it is unpinned or decays, even when a start
could not restore it, and its records stay pinned in the store meanwhile; a pin's KV is gathered
on the engine thread and written from a worker thread, so no step waits on the disk; an older
version's snapshot is read once (the same checks as ever), written into the store, then removed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any

from agentd.cache import (
    BlockHash,
    DiskKVStore,
    PinError,
    PinKey,
    PinNotFoundError,
    common_prefix_len,
    pin_key,
    release_closed_pins,
)
from agentd.chat import render_chat
from agentd.engine.async_engine import AsyncEngine
from agentd.pins import registry_file as pin_store
from agentd.pins import snapshots as pin_snapshots
from agentd.pins.manager import tenant_salt
from agentd.pins.pin_request import PinRequest
from agentd.pins.registry_file import REGISTRY_FILE, PinSpec
from agentd.pins.snapshots import SnapshotError, SnapshotMismatch
from agentd.pins.stored_kv import StoredKVError, read_pin_kv, write_pin_kv

logger = logging.getLogger("agentd")
_PROBE_MESSAGES = ("Hello", "1", "{", " x", "Wie geht's?")  # varied first characters
__all__ = ["REGISTRY_FILE", "PinService", "PinSpec", "PinStorageError", "PinTooLongError",
           "pin_token_ids"]


class PinTooLongError(PinError):
    """The prefix does not fit the context (a 400, like an over-long chat prompt)."""

    status = 400


class PinStorageError(PinError):
    """The registry could not be written, so the change was undone (507 Insufficient
    Storage)."""

    status = 507


def pin_token_ids(tokenizer, system: str, tools: list[dict] | None) -> list[int]:
    """The tokens every chat request with this system prompt and tools shares: whole blocks
    (cached and shared like any prefix), then the rest (the pin's tail, fewer than a block)."""
    renders = [
        render_chat(tokenizer, [{"role": "system", "content": system},
                                {"role": "user", "content": text}], tools, None).prompt_token_ids
        for text in _PROBE_MESSAGES
    ]
    shared = min(common_prefix_len(renders[0], other) for other in renders[1:])
    return renders[0][:shared]


class PinService:
    def __init__(self, engine: AsyncEngine, state_dir: Path | None) -> None:
        self.engine = engine
        self.state_dir = state_dir
        self.specs: dict[PinKey, PinSpec] = {}
        # Listed in pins.json but not restored at start (no room, too long...): kept listed.
        self.unrestored: dict[PinKey, PinSpec] = {}
        self.last_persist_error: str | None = None
        self.registry_behind = False  # the last write of pins.json failed: retry it
        self.restore_report: list[dict[str, Any]] = []
        self._registry_ok = False  # pins.json on disk is a good registry, worth a backup
        self._files = threading.Lock()  # store writes vs releases (worker threads)
        # each registered pin's records in the store (restored or not): what stays pinned there
        self._stored: dict[PinKey, list[BlockHash]] = {}
        self._store: DiskKVStore | None = None
        self._restoring = False  # restore_all is running
        self._unmigrated: set[PinKey] = set()  # restored from a snapshot the store did not take

    @property
    def block_size(self) -> int:
        return self.engine.block_size

    def _snapshot_path(self, key: PinKey) -> Path | None:
        """Where an older version kept the pin's KV snapshot (read once, to migrate it)."""
        if self.state_dir is None:
            return None
        return pin_snapshots.snapshot_path(self.state_dir, self.engine.fingerprint,
                                       self.block_size, key.owner, key.name)

    # --- operations ------------------------------------------------------------------------
    async def add(self, spec: PinSpec, persist: bool = True,
                  token_ids: list[int] | None = None) -> dict[str, Any]:
        """Render (unless its ``token_ids`` are known: a restart rendered them already), prefill
        and pin in ``spec.owner``'s name space (hashed with its cache salt); returns the pin's
        description.

        Raises PinError (with an HTTP status) when the name is taken, the budget is short or the
        prefix does not fit the context.
        """
        # rendered in a worker thread, as chat prompts are: /health and streams go on meanwhile
        result = await self.engine.run_pin(await asyncio.to_thread(self._request, spec,
                                                                   token_ids))
        if result.pin is None:
            raise result.error or PinError("the pin failed")
        if spec.prefill_s is None:
            spec.prefill_s = result.elapsed_s
        key = PinKey(spec.owner, spec.name)
        self.specs[key] = spec
        listed = self.unrestored.pop(key, None)
        if persist:
            try:
                self._save(f"pin {spec.name!r} was not registered")
            except PinStorageError:
                del self.specs[key]
                if listed is not None:
                    self.unrestored[key] = listed
                await self.engine.unpin(key)
                raise
            await self._store_kv(spec)
        return {**self.describe(result.pin), "prefill_s": result.elapsed_s, "restored": False}

    def _request(self, spec: PinSpec, token_ids: list[int] | None = None) -> PinRequest:
        """What the engine pins for ``spec`` (its ``token_ids`` when known); PinTooLongError
        when it does not fit the context."""
        if token_ids is None:
            token_ids = pin_token_ids(self.engine.tokenizer, spec.system, spec.tools)
        if len(token_ids) >= self.engine.max_model_len:
            raise PinTooLongError(
                f"pin {spec.name!r} is {len(token_ids)} tokens but the context (max_model_len) "
                f"is {self.engine.max_model_len}; shorten the prompt or raise --kv-cache-memory")
        meta = {"system_chars": len(spec.system), "num_tools": len(spec.tools or [])}
        return PinRequest(spec.name, tuple(token_ids), spec.ttl_s, meta, spec.owner,
                          tenant_salt(spec.owner))

    async def remove(self, key: PinKey | str) -> None:
        """Unpin: ``pins.json`` first (PinStorageError, and the pin stays, when it cannot be
        written), then the engine (PinNotFoundError)."""
        key = pin_key(key)
        await self.engine.get_pin(key)  # PinNotFoundError before anything changes
        spec = self.specs.pop(key, None)
        try:
            self._save(f"pin {key.name!r} was not unpinned")
        except PinStorageError:
            if spec is not None:
                self.specs[key] = spec
            raise
        await self.engine.unpin(key)
        self._stored.pop(key, None)
        path = self._snapshot_path(key)
        if path is not None:
            await asyncio.to_thread(self._remove_snapshot, path)
        await self._release_stored()

    async def list(self, owner: str | None = None, everyone: bool = False
                   ) -> list[dict[str, Any]]:
        """``owner``'s pins, or with ``everyone`` every tenant's. Listed first, then synced: a
        pin whose TTL lapses on the engine between the two is missing from the list only once
        the registry (and ``last_persist_error``) has caught up with it."""
        pins = await self.engine.list_pins()
        await self.sync_expired()
        return [self.describe(p) for p in pins if everyone or p.owner == owner]

    async def get(self, key: PinKey | str) -> dict[str, Any]:
        await self.sync_expired()
        pin = await self.engine.get_pin(key)
        return self.describe(pin)

    async def sync_expired(self) -> None:
        """Forget specs whose TTL lapsed in the engine (they decayed to ordinary LRU blocks)."""
        expired = await self.engine.take_expired_pins()
        for key in expired:
            self.specs.pop(key, None)
            self._stored.pop(key, None)
        if expired or self.registry_behind:  # a failed write is retried
            self.persist()
        if expired:
            await self._release_stored()

    def describe(self, pin) -> dict[str, Any]:
        spec = self.specs.get(pin.key)
        return {
            "name": pin.name,
            "owner": pin.owner,
            "num_tokens": pin.num_tokens,
            "num_blocks": pin.num_blocks_held,
            "tail_tokens": len(pin.tail_token_ids),
            "created": int(spec.created if spec else pin.created_s),
            "ttl": pin.ttl_s,
            "hits": pin.num_hits,
            "tokens_served": pin.num_tokens_served,
            "idle_s": round(time.monotonic() - pin.last_hit_s, 3),
            "prefill_s": pin.meta.get("prefill_s"),
            "restore_s": pin.meta.get("restore_s"),
            "num_tools": pin.meta.get("num_tools", 0),
        }

    # --- persistence -----------------------------------------------------------------------
    def persist(self) -> None:
        """Write pins.json atomically (the one it replaces becomes pins.json.bak); a failure is
        logged and reported (``last_persist_error``), and retried by the next sync."""
        try:
            self._write_registry()
        except OSError:
            logger.error("pins.json is behind the pins served: %s", self.last_persist_error)

    def _save(self, undone: str) -> None:
        """Write pins.json, or raise PinStorageError saying what ``undone`` and what to do."""
        try:
            self._write_registry()
        except OSError as exc:
            assert self.state_dir is not None
            raise PinStorageError(
                f"{undone}: could not write the pin registry {self.state_dir / REGISTRY_FILE} "
                f"({exc.strerror or exc}), so nothing changed; free space in the state dir "
                f"{self.state_dir} (or make it writable) and retry") from exc

    def _write_registry(self) -> None:
        """Write pins.json (raises OSError, noted in ``last_persist_error``)."""
        if self.state_dir is None:
            return
        try:
            pin_store.save_registry(self.state_dir,
                                    [*self.specs.values(), *self.unrestored.values()],
                                    keep_backup=self._registry_ok)
        except OSError as exc:
            self.last_persist_error = f"could not write {self.state_dir / REGISTRY_FILE}: {exc}"
            self.registry_behind = True
            raise
        self._registry_ok = True
        self.registry_behind = False
        self.last_persist_error = None

    async def _pin_store(self) -> DiskKVStore | None:
        """The store pins keep their KV in (opened once, off the event loop); None without a
        state dir."""
        if self.state_dir is None:
            return None
        if self._store is None:
            self._store = await asyncio.to_thread(self.engine.pin_store, self.state_dir)
        return self._store

    async def _store_kv(self, spec: PinSpec) -> bool:
        """Gather the pin's KV on the engine thread (a copy, between steps) into a buffer made
        here, and write it into the store's pinned segments from a worker thread. Whether it
        is stored (a failure is logged and kept in ``last_persist_error``)."""
        key = PinKey(spec.owner, spec.name)
        store = await self._pin_store()
        if store is None:
            return False
        try:
            pin = await self.engine.get_pin(key)
            payload = await self.engine.gather_pin_snapshot(key)
            keys = self.engine.pin_record_keys(pin.all_token_ids, pin.cache_salt)
            return await asyncio.to_thread(self._write_kv, spec, store, keys, payload)
        except PinNotFoundError:
            return False  # unpinned (or decayed) before its KV was gathered: nothing to keep
        except OSError as exc:
            self.last_persist_error = f"could not store the KV of pin {spec.name!r}: {exc}"
            logger.error("%s", self.last_persist_error)
            return False

    def _write_kv(self, spec: PinSpec, store: DiskKVStore, keys: list[BlockHash],
                  payload: dict[str, Any]) -> bool:
        key = PinKey(spec.owner, spec.name)
        with self._files:
            if self.specs.get(key) is not spec:
                return False  # unpinned (or replaced) while its KV was gathered
            self._stored[key] = keys
            write_pin_kv(store, keys, payload)
            if not self._restoring:  # (while restoring, the later pins' keys are not known yet)
                store.release_pins(self._needed(), self._demote)  # a replaced pin's, say
        return True

    @property
    def _demote(self) -> bool:
        """Unpinned records stay as ordinary blocks where the disk tier serves them."""
        return self.engine.engine.disk.enabled

    def _needed(self) -> set[BlockHash]:
        return {k for keys in self._stored.values() for k in keys}

    async def _release_stored(self, others: bool = False) -> None:
        """Let the store's pinned segments no registered pin needs become ordinary blocks (or
        go, without the disk tier); with ``others``, every pinned segment of other models'
        stores beside it too (pins live in the store of the model served)."""
        store = self._store
        if store is None:
            return

        def release() -> None:
            with self._files:
                store.release_pins(self._needed(), self._demote)
            if not others:
                return
            for directory in store.directory.parent.iterdir():  # other models' stores
                if directory != store.directory and (directory / "store.json").is_file():
                    release_closed_pins(directory)

        try:
            await asyncio.to_thread(release)
        except OSError as exc:
            logger.warning("could not release unpinned blocks in the KV store: %s", exc)

    def _remove_snapshot(self, path: Path) -> None:
        with self._files:
            pin_snapshots.remove_snapshot(path)

    def load_specs(self) -> list[PinSpec]:
        if self.state_dir is None:
            return []
        return pin_store.load_registry(self.state_dir).specs

    def remove_stale_temp_files(self) -> list[Path]:
        """See :func:`agentd.pins.registry_file.remove_stale_temp_files` (nothing without a
        state dir)."""
        if self.state_dir is None:
            return []
        return pin_store.remove_stale_temp_files(self.state_dir)

    # --- restart ---------------------------------------------------------------------------
    async def restore_all(self) -> list[dict[str, Any]]:
        """Re-pin every registered prefix: from its KV in the store (or an older version's
        snapshot, migrated) when valid, else by prefill. Then drop snapshots no entry names
        (and those of other models), and let go of the stored records no pin needs."""
        if self.state_dir is None:
            return []
        try:
            pin_store.tighten(self.state_dir)
        except OSError as exc:  # not ours to change (another owner, read-only): say so, go on
            logger.warning("could not make %s private: %s", self.state_dir, exc)
        self.remove_stale_temp_files()
        loaded = await asyncio.to_thread(pin_store.load_registry, self.state_dir)
        report: list[dict[str, Any]] = []
        for problem in loaded.problems:
            logger.error("pin registry: %s (the file is kept as %s)", problem,
                         pin_store.REJECTED_FILE)
            report.append({"name": REGISTRY_FILE, "error": problem})
        self._registry_ok = not loaded.problems and loaded.source == REGISTRY_FILE
        if self._registry_ok:
            try:
                pin_store.refresh_backup(self.state_dir)
            except OSError as exc:
                logger.warning("could not back up %s: %s", REGISTRY_FILE, exc)
        self._restoring = True
        try:
            for spec in loaded.specs:
                report.append(await self._restore_logged(spec))
        finally:
            self._restoring = False
        if loaded.problems:
            self.persist()  # a good registry again (the bad one is in pins.json.rejected)
        self._remove_orphans()
        await self._pin_store()
        await self._release_stored(others=True)
        self.restore_report = report
        return report

    async def _restore_logged(self, spec: PinSpec) -> dict[str, Any]:
        start = time.monotonic()
        try:
            entry = await self._restore_one(spec)
        except Exception as exc:  # one broken pin must not keep the daemon from starting
            logger.error("could not restore pin %r: %s", spec.name, exc)
            entry = {"name": spec.name, "error": str(exc)}
            self.unrestored[PinKey(spec.owner, spec.name)] = spec
        entry["elapsed_s"] = time.monotonic() - start
        entry["prefill_s"] = spec.prefill_s  # the first prefill, to compare with
        if spec.owner is not None:
            entry["owner"] = spec.owner
        logger.debug("restored pin %s", entry)
        return entry

    async def _restore_one(self, spec: PinSpec) -> dict[str, Any]:
        key = PinKey(spec.owner, spec.name)
        token_ids = await asyncio.to_thread(pin_token_ids, self.engine.tokenizer, spec.system,
                                            spec.tools)
        keys = self.engine.pin_record_keys(token_ids, tenant_salt(spec.owner))
        self._stored[key] = keys  # pinned in the store from here on, restored or not
        pin = self._request(spec, token_ids)
        path = self._snapshot_path(key)
        reason = None
        if path is not None and (path.exists() or pin_snapshots.checksum_path(path).exists()):
            try:  # an older version's snapshot: restored once, then stored and removed
                payload = await asyncio.to_thread(pin_snapshots.read_snapshot, path)
                result = await self.engine.restore_pin(pin, payload)
                if result.pin is None:
                    raise result.error or PinError("the pin failed")
            except (SnapshotError, SnapshotMismatch) as exc:
                reason = f"its KV snapshot is unusable: {exc}"
            else:
                self.specs[key] = spec
                if await self._store_kv(spec):
                    await asyncio.to_thread(self._remove_snapshot, path)
                else:  # kept until a start stores it
                    self._unmigrated.add(key)
                return {"name": spec.name, "source": "snapshot", "num_tokens": len(pin.token_ids)}
        store = await self._pin_store()
        if reason is None and store is not None:
            try:
                payload = await asyncio.to_thread(
                    read_pin_kv, store, keys, pin.token_ids, self.block_size,
                    self.engine.kv_block_layout(), self.engine.fingerprint, pin.cache_salt)
                result = await self.engine.restore_pin(pin, payload)
                if result.pin is None:
                    raise result.error or PinError("the pin failed")
            except (StoredKVError, SnapshotMismatch) as exc:
                reason = str(exc)
            else:
                self.specs[key] = spec
                if not store.all_pinned(keys):  # found in part as the tier's blocks
                    await self._store_kv(spec)
                return {"name": spec.name, "source": "store", "num_tokens": len(pin.token_ids)}
        if reason is not None:
            logger.warning("the stored KV of pin %r is unusable (%s): recomputing it",
                           spec.name, reason)
        described = await self.add(spec, persist=False, token_ids=token_ids)  # rendered once
        await self._store_kv(spec)
        entry = {"name": spec.name, "source": "recompute", "num_tokens": described["num_tokens"]}
        if reason is not None:
            entry["kv_error"] = reason
        return entry

    def _remove_orphans(self) -> None:
        """Remove the older version's snapshots no unrestored pin still needs (the restored
        ones were migrated), and the ``kv/`` directory once it is empty."""
        assert self.state_dir is not None
        keep = [self._snapshot_path(key) for key in [*self.unrestored, *self._unmigrated]]
        current = pin_snapshots.snapshot_dir(self.state_dir, self.engine.fingerprint,
                                             self.block_size)
        try:
            removed = pin_snapshots.remove_orphans(self.state_dir, current,
                                                   [p for p in keep if p is not None])
            for directory in (current, current.parent):
                if directory.is_dir() and not any(directory.iterdir()):
                    directory.rmdir()
        except OSError as exc:
            logger.warning("could not remove unused snapshots: %s", exc)
            return
        if removed:
            logger.info("removed %d snapshot file(s) or directories no pin names: %s",
                        len(removed), ", ".join(str(p) for p in removed[:5]))
