"""Pins as the daemon offers them: template-aware token selection, tenant name spaces, the
persisted registry and KV snapshots (their files: :mod:`agentd.pins.registry_file`,
:mod:`agentd.pins.snapshots`).

Invariants: a pin is rendered and tokenised in a worker thread (never on the event loop); a
pin is reported registered only once its blocks are pinned in the engine and ``pins.json``
lists it, and unpinned only once ``pins.json`` no longer does: when the registry cannot be
written (a full or unwritable state dir) the call raises ``PinStorageError`` (507) and nothing
changes, in the engine or on disk; a pin that decays is dropped from ``pins.json`` at the next
write that succeeds (each later sync retries a failed one); a
snapshot is only reused when its checksum, model fingerprint, block size, cache salt and token ids
all match, otherwise the pin is recomputed and the report says why; a pin listed in ``pins.json``
stays listed there until it is unpinned or decays, even when a start could not restore it; a
snapshot's KV is gathered on the engine thread and written from a worker thread, so no step
waits on the disk.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any

from agentd.cache import PinError, PinKey, PinNotFoundError, common_prefix_len, pin_key
from agentd.chat import render_chat
from agentd.engine.async_engine import AsyncEngine
from agentd.pins import registry_file as pin_store
from agentd.pins import snapshots as pin_snapshots
from agentd.pins.manager import tenant_salt
from agentd.pins.pin_request import PinRequest
from agentd.pins.registry_file import REGISTRY_FILE, PinSpec
from agentd.pins.snapshots import SnapshotError, SnapshotMismatch

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
        self._files = threading.Lock()  # snapshot writes vs deletes (worker threads)

    @property
    def block_size(self) -> int:
        return self.engine.block_size

    def _snapshot_path(self, key: PinKey) -> Path | None:
        if self.state_dir is None:
            return None
        return pin_snapshots.snapshot_path(self.state_dir, self.engine.fingerprint,
                                       self.block_size, key.owner, key.name)

    # --- operations ------------------------------------------------------------------------
    async def add(self, spec: PinSpec, persist: bool = True) -> dict[str, Any]:
        """Render, prefill and pin in ``spec.owner``'s name space (hashed with its cache
        salt); returns the pin's description.

        Raises PinError (with an HTTP status) when the name is taken, the budget is short or the
        prefix does not fit the context.
        """
        # rendered in a worker thread, as chat prompts are: /health and streams go on meanwhile
        result = await self.engine.run_pin(await asyncio.to_thread(self._request, spec))
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
            await self._snapshot(spec)
        return {**self.describe(result.pin), "prefill_s": result.elapsed_s, "restored": False}

    def _request(self, spec: PinSpec) -> PinRequest:
        """What the engine pins for ``spec``; PinTooLongError when it does not fit the
        context."""
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
        path = self._snapshot_path(key)
        if path is not None:
            await asyncio.to_thread(self._remove_snapshot, path)

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
        if expired or self.registry_behind:  # a failed write is retried
            self.persist()

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

    async def _snapshot(self, spec: PinSpec) -> None:
        """Gather the pin's KV on the engine thread (a copy, between steps) into a buffer made
        here, and write it from a worker thread."""
        key = PinKey(spec.owner, spec.name)
        path = self._snapshot_path(key)
        if path is None:
            return
        try:
            payload = await self.engine.gather_pin_snapshot(key)
            await asyncio.to_thread(self._write_snapshot, spec, payload, path)
        except PinNotFoundError:
            return  # unpinned (or decayed) before its KV was gathered: nothing to keep
        except OSError as exc:
            self.last_persist_error = f"could not write the KV snapshot {path}: {exc}"
            logger.error("%s", self.last_persist_error)

    def _write_snapshot(self, spec: PinSpec, payload: dict[str, Any], path: Path) -> None:
        assert self.state_dir is not None
        with self._files:
            if self.specs.get(PinKey(spec.owner, spec.name)) is not spec:
                return  # unpinned (or replaced) while its KV was gathered
            pin_snapshots.write_snapshot(payload, path, self.state_dir)

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
        """Re-pin every registered prefix: from its KV snapshot when valid, else by prefill.
        Then drop snapshots no entry names (and those of other models)."""
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
        for spec in loaded.specs:
            report.append(await self._restore_logged(spec))
        if loaded.problems:
            self.persist()  # a good registry again (the bad one is in pins.json.rejected)
        self._remove_orphans()
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
        pin = await asyncio.to_thread(self._request, spec)
        path = self._snapshot_path(key)
        reason = None
        if path is not None and (path.exists() or pin_snapshots.checksum_path(path).exists()):
            try:
                payload = await asyncio.to_thread(pin_snapshots.read_snapshot, path)
                result = await self.engine.restore_pin(pin, payload)
                if result.pin is None:
                    raise result.error or PinError("the pin failed")
            except (SnapshotError, SnapshotMismatch) as exc:
                reason = str(exc)
                logger.warning("the KV snapshot of pin %r is unusable (%s): recomputing it",
                               spec.name, reason)
            else:
                self.specs[key] = spec
                return {"name": spec.name, "source": "snapshot",
                        "num_tokens": len(pin.token_ids)}
        described = await self.add(spec, persist=False)
        await self._snapshot(spec)
        entry = {"name": spec.name, "source": "recompute", "num_tokens": described["num_tokens"]}
        if reason is not None:
            entry["snapshot_error"] = reason
        return entry

    def _remove_orphans(self) -> None:
        assert self.state_dir is not None
        keep = [self._snapshot_path(key) for key in [*self.specs, *self.unrestored]]
        current = pin_snapshots.snapshot_dir(self.state_dir, self.engine.fingerprint,
                                         self.block_size)
        try:
            removed = pin_snapshots.remove_orphans(self.state_dir, current,
                                               [p for p in keep if p is not None])
        except OSError as exc:
            logger.warning("could not remove unused snapshots: %s", exc)
            return
        if removed:
            logger.info("removed %d snapshot file(s) or directories no pin names: %s",
                        len(removed), ", ".join(str(p) for p in removed[:5]))
