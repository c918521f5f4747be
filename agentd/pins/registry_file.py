"""Pins on disk: the registry (``pins.json``, its backup), file permissions and atomic writes in
the state dir (pins' KV is in the block store: :mod:`agentd.pins.stored_kv`).

Invariants:
- ``pins.json`` is always a complete document: written to a temp file, fsynced, renamed over the
  old one and the directory fsynced. ``pins.json.bak`` is a copy of the last registry known good —
  the one a write replaced, or the one a start loaded cleanly — and a start falls back to it
  when ``pins.json`` cannot be parsed. Entries are parsed one by one: a bad entry is skipped
  and reported, the rest are kept, and the file it came from is kept as ``pins.json.rejected``.
- The state dir and every directory here are 0700, every file 0600: they hold the prompts.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from agentd.cache.disk_format import fsync_dir
from agentd.config import parse_duration

logger = logging.getLogger("agentd")
REGISTRY_FILE = "pins.json"
BACKUP_FILE = "pins.json.bak"
REJECTED_FILE = "pins.json.rejected"
PIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # always fullmatch
MAX_TTL_S = 365 * 86400.0  # a pin's TTL: past a year it means "never", which is no TTL at all
_OWNER = re.compile(r"[0-9a-f]{1,64}")  # a tenant id (see agentd.server.state.tenant_of)
_FIELDS = ("name", "system", "tools", "ttl_s", "created", "prefill_s", "owner")


@dataclass
class PinSpec:
    """What the user registered: enough to re-render the pin after a restart."""

    name: str
    system: str
    tools: list[dict] | None = None
    ttl_s: float | None = None
    created: float = field(default_factory=time.time)
    prefill_s: float | None = None  # how long its first prefill took (restore reports compare)
    owner: str | None = None  # the tenant it belongs to; None: server-wide

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "system": self.system, "tools": self.tools,
                "ttl_s": self.ttl_s, "created": self.created, "prefill_s": self.prefill_s,
                "owner": self.owner}


def pin_ttl_s(ttl: float | str) -> float:
    """A pin's TTL in seconds, from seconds or a duration such as ``"90s"`` or ``"1h"``: more
    than 0 and at most ``MAX_TTL_S``; ValueError says what is wrong (NaN, inf and 1e300
    included)."""
    ttl_s = parse_duration(ttl)
    if not ttl_s > 0:  # NaN too
        raise ValueError(f"ttl must be positive, got {ttl!r}")
    if not ttl_s <= MAX_TTL_S:
        raise ValueError(f"ttl must be at most {MAX_TTL_S / 86400:g}d (a year), got {ttl!r}; "
                         "omit it for a pin that lasts until unpinned")
    return ttl_s


# --- permissions and atomic files ------------------------------------------------------------
def private_dir(path: Path, root: Path | None = None) -> Path:
    """Create ``path`` (and its parents) if needed and make it 0700, and with ``root`` every
    directory between them and ``root`` itself too."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    if root is not None:
        for parent in path.parents:
            if not parent.is_relative_to(root):
                break
            os.chmod(parent, 0o700)
    return path


def tighten(state_dir: Path) -> None:
    """Make what older versions wrote world-readable private: the state dir, the registry
    files, the whole ``kv`` tree (older versions' snapshots) and the block store's."""
    if not state_dir.is_dir():
        return
    os.chmod(state_dir, 0o700)
    paths = [state_dir / n for n in (REGISTRY_FILE, BACKUP_FILE, REJECTED_FILE)]
    for tree in (state_dir / "kv", state_dir / "kv-store"):
        if tree.is_dir():
            paths.append(tree)
            paths += tree.rglob("*")
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            os.chmod(path, 0o700)
        elif path.is_file() and not path.is_symlink():
            os.chmod(path, 0o600)


def write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write ``path`` (created 0600) through a temp file: fsync, rename; the directory is the
    caller's to fsync. A failure leaves the old file and no temp file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# --- the registry --------------------------------------------------------------------------
@dataclass
class LoadedRegistry:
    specs: list[PinSpec]
    problems: list[str]  # one line per thing skipped or fallen back from
    source: str | None  # the file the specs came from; None when there was none


def parse_entry(entry: Any) -> PinSpec:
    """One registry entry as a PinSpec; ValueError says what is wrong with it."""
    if not isinstance(entry, dict):
        raise ValueError(f"an entry must be an object, not {type(entry).__name__}")
    name, system, owner = entry.get("name"), entry.get("system"), entry.get("owner")
    if not isinstance(name, str) or not PIN_NAME.fullmatch(name):
        raise ValueError(f"the name {name!r} is not a valid pin name")
    if not isinstance(system, str) or not system.strip():
        raise ValueError(f"pin {name!r} has no system prompt")
    if owner is not None and (not isinstance(owner, str) or not _OWNER.fullmatch(owner)):
        raise ValueError(f"pin {name!r} has an invalid owner {owner!r}")
    tools = entry.get("tools")
    if tools is not None and (not isinstance(tools, list)
                              or not all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"pin {name!r}: tools must be a list of objects")
    numbers = {key: entry.get(key) for key in ("ttl_s", "created", "prefill_s")}
    for key, value in numbers.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or value < 0 or value != value):
            raise ValueError(f"pin {name!r}: {key} must be a non-negative number")
    if numbers["ttl_s"] is not None and numbers["ttl_s"] <= 0:
        raise ValueError(f"pin {name!r}: ttl_s must be positive")
    return PinSpec(name, system, tools, numbers["ttl_s"], numbers["created"] or time.time(),
                   numbers["prefill_s"], owner)


def _read_document(path: Path) -> list[Any]:
    doc = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(doc, dict) or not isinstance(doc.get("pins"), list):
        raise ValueError('not a registry document ({"version": 1, "pins": [...]})')
    return doc["pins"]


def _parse_entries(entries: list[Any], origin: str) -> tuple[list[PinSpec], list[str]]:
    specs: dict[tuple[str | None, str], PinSpec] = {}
    problems = []
    for index, entry in enumerate(entries):
        try:
            spec = parse_entry(entry)
        except ValueError as exc:
            problems.append(f"{origin} entry {index} skipped: {exc}")
            continue
        unknown = sorted(set(entry) - set(_FIELDS))
        if unknown:
            problems.append(f"{origin} entry {index} ({spec.name!r}): ignored unknown "
                            f"field(s) {', '.join(unknown)}")
        if (spec.owner, spec.name) in specs:
            problems.append(f"{origin} entry {index} skipped: a second pin named {spec.name!r}")
            continue
        specs[(spec.owner, spec.name)] = spec
    return list(specs.values()), problems


def load_registry(state_dir: Path) -> LoadedRegistry:
    """The registered pins: ``pins.json``, else (when it cannot be parsed) its backup. A file
    that had problems is kept as ``pins.json.rejected`` for the user to repair."""
    primary = state_dir / REGISTRY_FILE
    if not primary.exists():
        return LoadedRegistry([], [], None)
    problems: list[str] = []
    for path in (primary, state_dir / BACKUP_FILE):
        try:
            entries = _read_document(path)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            problems.append(f"{path.name} is unreadable ({exc})")
            continue
        specs, entry_problems = _parse_entries(entries, path.name)
        problems += entry_problems
        break
    else:
        specs, path = [], None
    if problems:
        try:
            shutil.copyfile(primary, state_dir / REJECTED_FILE)
            os.chmod(state_dir / REJECTED_FILE, 0o600)
        except OSError as exc:
            logger.warning("could not keep a copy of %s: %s", primary, exc)
    return LoadedRegistry(specs, problems, path.name if path is not None else None)


def refresh_backup(state_dir: Path) -> None:
    """Copy the registry to its backup (atomically; a copy, not a link, so damage done to one
    file in place never reaches the other)."""
    content = (state_dir / REGISTRY_FILE).read_bytes()
    write_atomic(state_dir / BACKUP_FILE, lambda f: f.write(content))
    fsync_dir(state_dir)


def save_registry(state_dir: Path, specs: Iterable[PinSpec], keep_backup: bool) -> None:
    """Write ``pins.json`` atomically; with ``keep_backup`` the file it replaces (which must be
    a good registry) becomes ``pins.json.bak`` first. Raises OSError."""
    private_dir(state_dir)
    path = state_dir / REGISTRY_FILE
    if keep_backup and path.exists():
        refresh_backup(state_dir)
    doc = {"version": 1, "pins": [s.to_json() for s in specs]}
    write_atomic(path, lambda f: f.write(json.dumps(doc, indent=1).encode()))
    fsync_dir(state_dir)


def remove_stale_temp_files(state_dir: Path) -> list[Path]:
    """Delete ``.NAME.PID.tmp`` files (registry and snapshots being written) whose writer is
    gone: a crash mid-write leaves them behind, and nothing else ever removes them."""
    removed: list[Path] = []
    for tmp in [*state_dir.glob(".*.tmp"), *state_dir.glob("kv/*/.*.tmp"),
                *state_dir.glob("kv/*/*/.*.tmp")]:
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
