"""What a client sent that agentd accepts and does not act on: said once, never a 400.

Agent harnesses send fields that mean nothing for a local model (a reasoning summary for a model
that does not reason, a hosted web-search tool, beta headers, their own model's name) and fields
agentd does not know at all. Each is accepted; a reply says which in its ``x-agentd-ignored``
header, and the log says it once, at ``info``, per client, route and field.

Invariants: only a field whose meaning is a no-op here or has a local equivalent is ignored
(a malformed value is still a 400, raised by the wire); an unknown top-level field is always
reported; the set of logged names is bounded (``MAX_LOGGED``), so a client cannot grow it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import NamedTuple

import msgspec
from litestar import Request

logger = logging.getLogger("agentd.server")
HEADER = "x-agentd-ignored"
MAX_LOGGED = 4096  # (client, route, field) triples remembered as logged
_SCOPE_KEY = "agentd_ignored"


class Ignored(NamedTuple):
    field: str  # its path, as the wire spells it: ``reasoning.summary``, ``tools[7]``
    why: str  # what it would have meant, and why it means nothing here


UNKNOWN = "not a field of this API agentd knows"


def client_name(request: Request) -> str:
    """The client as its ``User-Agent`` names it: its first product token (``claude-cli/2.1``,
    ``codex_exec/0.171``, ``opencode/1.18``), or ``unknown``."""
    agent = request.headers.get("user-agent", "").strip()
    return agent.split()[0][:64] if agent else "unknown"


def unknown_fields(body: bytes, request_type: type[msgspec.Struct]) -> list[str]:
    """The top-level field names of ``body`` that ``request_type`` does not have."""
    try:  # Raw values: the keys are read without decoding the values again
        keys = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, RecursionError):
        return []
    return sorted(set(keys) - set(request_type.__struct_fields__))


def note(request: Request, fields: Iterable[Ignored]) -> None:
    """Remember ``fields`` as ignored for this request's reply (``ignored``)."""
    state = request.scope.setdefault("state", {})
    state.setdefault(_SCOPE_KEY, []).extend(fields)


def ignored(request: Request) -> list[Ignored]:
    """What was noted for this request so far, each field once, in order."""
    found = request.scope.get("state", {}).get(_SCOPE_KEY, ())
    return list({item.field: item for item in found}.values())


MAX_IN_HEADER = 32  # names a header lists; the rest are counted


def header_value(fields: Iterable[Ignored]) -> str:
    """The names, comma-separated, as printable ASCII (a client's field names are its own:
    anything else, a comma or a line break included, is escaped), at most ``MAX_IN_HEADER``."""
    names = [_printable(item.field) for item in fields]
    shown = ", ".join(names[:MAX_IN_HEADER])
    return shown if len(names) <= MAX_IN_HEADER else \
        f"{shown}, and {len(names) - MAX_IN_HEADER} more"


def _printable(name: str) -> str:
    return "".join(c if 32 <= ord(c) < 127 and c not in ",\\" else f"\\u{ord(c):04x}"
                   for c in name[:128])


class IgnoredLog:
    """Logs each ignored field once per client and route (thread-safe)."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, str, str]] = set()
        self._lock = threading.Lock()

    def log(self, client: str, route: str, fields: Iterable[Ignored]) -> None:
        with self._lock:
            new = [f for f in fields if (client, route, f.field) not in self._seen]
            if len(self._seen) + len(new) <= MAX_LOGGED:
                self._seen.update((client, route, f.field) for f in new)
        for item in new:
            logger.info("%s: ignoring the field '%s' from %s: %s (logged once per client and "
                        "field)", route, _printable(item.field), _printable(client), item.why)
