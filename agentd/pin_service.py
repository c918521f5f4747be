"""Pins as the daemon offers them: template-aware token selection, the persisted registry
(``pins.json``, written atomically) and KV snapshots keyed by the model fingerprint.

Invariants: ``pins.json`` on disk is always a complete document (old or new, never partial);
a pin is reported registered only once its blocks are pinned in the engine; a snapshot is only
reused for the exact model fingerprint, block size and token ids it was taken from.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentd.async_engine import AsyncEngine
from agentd.cache import PinError
from agentd.chat import common_prefix_len, render_chat

logger = logging.getLogger("agentd")
_PROBE_MESSAGES = ("Hello", "1", "{", " x", "Wie geht's?")  # varied first characters
REGISTRY_FILE = "pins.json"


class PinTooLongError(PinError):
    """The prefix does not fit the context (a 400, like an over-long chat prompt)."""

    status = 400


@dataclass
class PinSpec:
    """What the user registered: enough to re-render the pin after a restart."""

    name: str
    system: str
    tools: list[dict] | None = None
    ttl_s: float | None = None
    created: float = field(default_factory=time.time)
    prefill_s: float | None = None  # how long its first prefill took (restore reports compare)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "system": self.system, "tools": self.tools,
                "ttl_s": self.ttl_s, "created": self.created, "prefill_s": self.prefill_s}


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
        self.specs: dict[str, PinSpec] = {}
        self.last_persist_error: str | None = None
        self.restore_report: list[dict[str, Any]] = []

    @property
    def block_size(self) -> int:
        return self.engine.engine.config.block_size

    def _snapshot_path(self, name: str) -> Path | None:
        if self.state_dir is None:
            return None
        fingerprint = self.engine.engine.loaded.fingerprint
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        return self.state_dir / "kv" / f"{fingerprint}-b{self.block_size}" / f"{safe}.pt"

    # --- operations ------------------------------------------------------------------------
    async def add(self, spec: PinSpec, persist: bool = True) -> dict[str, Any]:
        """Render, prefill (or restore) and pin; returns the pin's description.

        Raises PinError (with an HTTP status) when the name is taken, the budget is short or the
        prefix does not fit the context.
        """
        token_ids = pin_token_ids(self.engine.tokenizer, spec.system, spec.tools)
        if len(token_ids) >= self.engine.max_model_len:
            raise PinTooLongError(
                f"pin {spec.name!r} is {len(token_ids)} tokens but the context (max_model_len) "
                f"is {self.engine.max_model_len}; shorten the prompt or raise --kv-cache-memory")
        meta = {"system_chars": len(spec.system), "num_tools": len(spec.tools or [])}
        result = await self.engine.run_pin(spec.name, token_ids, spec.ttl_s, meta)
        if result.pin is None:
            raise result.error or PinError("the pin failed")
        if spec.prefill_s is None:
            spec.prefill_s = result.elapsed_s
        self.specs[spec.name] = spec
        if persist:
            self.persist()
            await self._snapshot(spec.name)
        return {**self.describe(result.pin), "prefill_s": result.elapsed_s, "restored": False}

    async def remove(self, name: str) -> None:
        await self.engine.call(lambda e: e.unpin(name))
        self.specs.pop(name, None)
        self.persist()
        path = self._snapshot_path(name)
        if path is not None and path.exists():
            path.unlink(missing_ok=True)

    async def list(self) -> list[dict[str, Any]]:
        await self.sync_expired()
        pins = await self.engine.call(lambda e: list(e.pins.registry))
        return [self.describe(p) for p in pins]

    async def get(self, name: str) -> dict[str, Any]:
        await self.sync_expired()
        pin = await self.engine.call(lambda e: e.pins.registry.get(name))
        return self.describe(pin)

    async def sync_expired(self) -> None:
        """Forget specs whose TTL lapsed in the engine (they decayed to ordinary LRU blocks)."""
        expired = await self.engine.call(lambda e: [e.expired_pins.pop()
                                                    for _ in range(len(e.expired_pins))])
        if expired:
            for name in expired:
                self.specs.pop(name, None)
            self.persist()

    def describe(self, pin) -> dict[str, Any]:
        spec = self.specs.get(pin.name)
        return {
            "name": pin.name,
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
        """Write pins.json atomically; a failure is logged and reported, pins keep serving."""
        if self.state_dir is None:
            return
        doc = {"version": 1, "pins": [s.to_json() for s in self.specs.values()]}
        path = self.state_dir / REGISTRY_FILE
        tmp = path.with_name(f".{REGISTRY_FILE}.{os.getpid()}.tmp")
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            self.last_persist_error = None
        except OSError as exc:
            self.last_persist_error = f"could not write {path}: {exc}"
            logger.error("pins are serving from memory only: %s", self.last_persist_error)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass

    async def _snapshot(self, name: str) -> None:
        path = self._snapshot_path(name)
        if path is None:
            return
        try:
            await self.engine.call(lambda e: e.save_pin_snapshot(name, path))
        except OSError as exc:
            self.last_persist_error = f"could not write the KV snapshot {path}: {exc}"
            logger.error("%s", self.last_persist_error)

    def load_specs(self) -> list[PinSpec]:
        if self.state_dir is None or not (self.state_dir / REGISTRY_FILE).exists():
            return []
        path = self.state_dir / REGISTRY_FILE
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            return [PinSpec(**entry) for entry in doc.get("pins", [])]
        except (OSError, ValueError, TypeError) as exc:
            logger.error("ignoring unreadable pin registry %s: %s", path, exc)
            return []

    def remove_stale_temp_files(self) -> list[Path]:
        """Delete ``.NAME.PID.tmp`` files (pins.json and KV snapshots being written) whose writer
        is gone: a crash mid-write leaves them behind, and nothing else ever removes them."""
        removed: list[Path] = []
        if self.state_dir is None:  # nothing is persisted, so nothing was left half-written
            return removed
        for tmp in [*self.state_dir.glob(".*.tmp"), *self.state_dir.glob("kv/*/.*.tmp")]:
            pid = tmp.name.rsplit(".", 2)[-2]
            if not pid.isdigit() or _alive(int(pid)):
                continue
            try:
                tmp.unlink()
                removed.append(tmp)
            except OSError as exc:
                logger.warning("could not remove stale %s: %s", tmp, exc)
        if removed:
            logger.info("removed %d stale temporary file(s) left by a crash", len(removed))
        return removed

    async def restore_all(self) -> list[dict[str, Any]]:
        """Re-pin every registered prefix: from its KV snapshot when valid, else by prefill."""
        self.remove_stale_temp_files()
        report = []
        for spec in self.load_specs():
            start = time.monotonic()
            try:
                entry = await self._restore_one(spec)
            except Exception as exc:  # one broken pin must not keep the daemon from starting
                logger.error("could not restore pin %r: %s", spec.name, exc)
                entry = {"name": spec.name, "error": str(exc)}
            entry["elapsed_s"] = time.monotonic() - start
            entry["prefill_s"] = spec.prefill_s  # the first prefill, to compare with
            report.append(entry)
            logger.debug("restored pin %s", entry)
        self.restore_report = report
        return report

    async def _restore_one(self, spec: PinSpec) -> dict[str, Any]:
        token_ids = pin_token_ids(self.engine.tokenizer, spec.system, spec.tools)
        path = self._snapshot_path(spec.name)
        if path is not None and path.exists():
            meta = {"system_chars": len(spec.system), "num_tools": len(spec.tools or [])}
            result = await self.engine.call(
                lambda e: e.restore_pin(spec.name, token_ids, path, spec.ttl_s, meta))
            if result is not None and result.pin is not None:
                self.specs[spec.name] = spec
                return {"name": spec.name, "source": "snapshot", "num_tokens": len(token_ids)}
        described = await self.add(spec, persist=False)
        await self._snapshot(spec.name)
        return {"name": spec.name, "source": "recompute", "num_tokens": described["num_tokens"]}


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True
