"""Fields a client sent that agentd does not know: accepted, and said once.

Invariant: an unknown top-level field is accepted and logged once per field name and route
(agent frameworks send extras; vLLM accepts and logs them too), never silently.
"""

from __future__ import annotations

import logging
import threading

import msgspec

logger = logging.getLogger("agentd.server")


class UnknownFields:
    """Logs each unknown top-level field name once per route (thread-safe)."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def note(self, body: bytes, request_type: type[msgspec.Struct], route: str) -> list[str]:
        """The unknown top-level field names of ``body``; new ones are logged."""
        try:  # Raw values: the keys are read without decoding the values again
            keys = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
        except (msgspec.DecodeError, RecursionError):
            return []
        unknown = sorted(set(keys) - set(request_type.__struct_fields__))
        with self._lock:
            new = [name for name in unknown if (route, name) not in self._seen]
            self._seen.update((route, name) for name in new)
        for name in new:
            logger.warning("%s: ignoring the unknown field %r (accepted as vLLM does; logged "
                           "once per field)", route, name)
        return unknown
