"""The server's HTTP-side settings (the engine's live in ``EngineConfig``): keys and tenants,
limits, web safety, the response store.

Invariant: a ``ServerSettings`` is frozen and checked when built; a bad value is a ValueError
that names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServerSettings:
    """HTTP-side knobs (the engine's live in ``EngineConfig``)."""

    api_keys: tuple[str, ...] = ()
    admin_keys: tuple[str, ...] = ()  # operators: /admin, /v1/stats, /metrics, every tenant's pins
    metrics_public: bool = False  # serve /metrics without a key even when keys are set
    max_request_body_bytes: int = 16 * 2**20
    shutdown_grace_s: float = 10.0
    max_queue: int = 256  # requests that may wait beyond a full batch; then 503 + Retry-After
    shared_cache: bool = False  # with several keys, let tenants share cached prefixes (and pins)
    state_dir: Path | None = None  # pins.json and kv-store/; None keeps pins in memory only
    # Web safety (agentd.server.web_guard): the address bound, more names the Host header may
    # carry, origins whose pages may call the API, and how long a client may take to send a
    # request's headers, then its body.
    bind_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    read_timeout_s: float = 30.0
    # Responses API: stored responses (per API key) and how long one lives after its last use
    response_store_size: int = 1024
    response_store_ttl_s: float = 3600.0
    # The output cap of a request that sends none (Codex sends none): a model that never emits
    # an end token cannot hold a sequence until its context is full. See the options table.
    max_output_tokens: int = 4096
    # A stream that sends nothing this long sends its wire's keep-alive (a prefill of tens of
    # thousands of tokens takes minutes on a CPU; clients' idle timeouts are shorter)
    keepalive_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_request_body_bytes < 1024:
            raise ValueError("max_request_body_bytes must be at least 1024")
        if self.shutdown_grace_s < 0:
            raise ValueError("shutdown_grace_s must be >= 0")
        if any(not key for key in self.all_keys):
            raise ValueError("API keys must be non-empty")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, not {self.max_queue}")
        if self.read_timeout_s <= 0:
            raise ValueError(f"read_timeout_s must be > 0, not {self.read_timeout_s}")
        if self.keepalive_s <= 0:
            raise ValueError(f"keepalive_s must be > 0, not {self.keepalive_s}")
        if self.max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be >= 1, not {self.max_output_tokens}")
        if self.response_store_size < 0 or self.response_store_ttl_s <= 0:
            raise ValueError("response_store_size must be >= 0 and response_store_ttl_s > 0")

    @property
    def all_keys(self) -> tuple[str, ...]:
        return self.api_keys + self.admin_keys

    @property
    def per_key_cache(self) -> bool:
        """Each API key gets its own cache salt: two or more keys and no ``shared_cache``."""
        return len(self.api_keys) >= 2 and not self.shared_cache

    def is_operator(self, key: str) -> bool:
        """Admin keys are; with a single tenant (one key, or a shared cache) every key is."""
        return key in self.admin_keys or not self.per_key_cache
