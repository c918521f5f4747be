"""A pin to register and how its registration ended, as frozen values: the request built once
by whoever asks (the pin service, a restart, a test), handed to the engine whole and carried by
the prefill request that computes it (``Request.pin``); the result on that request's last delta.

Invariant: ``token_ids`` are the pin's whole blocks, then its tail (fewer than a block); the pin
lives in ``owner``'s name space and its blocks are hashed with ``cache_salt``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from agentd.cache import Pin, PinKey


@dataclass(frozen=True)
class PinRequest:
    name: str
    token_ids: tuple[int, ...]
    ttl_s: float | None = None  # None: until unpinned
    meta: Mapping[str, Any] = field(default_factory=dict)  # what the pin reports of its source
    owner: str | None = None  # the tenant; None: the server-wide name space
    cache_salt: str | None = None  # the owner's

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(self.token_ids))
        object.__setattr__(self, "meta", MappingProxyType(dict(self.meta)))

    @property
    def key(self) -> PinKey:
        return PinKey(self.owner, self.name)


@dataclass(frozen=True)
class PinResult:
    """How a pin's registration ended: the pin, or the error that refused it."""

    pin: Pin | None
    error: Exception | None
    elapsed_s: float
    restored: bool  # KV came from a snapshot instead of a prefill
