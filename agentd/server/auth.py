"""Who may call what: the API-key guards and the tenant a key stands for.

Invariants: every /v1 and /admin route is behind ``require_api_key`` when keys are set; /health
stays open, and /metrics too only with ``metrics_public``. With two or more ``--api-key`` keys
(and no ``shared_cache``) the guard tags each request with its key's tenant id
(``cache_tenant``), which the handlers mix into the cache salt and use as the owner of what it
pins and retains, so tenants never share KV blocks nor see each other's pins; only an operator
(an ``--admin-key``, or any key when there is one tenant) reaches /admin, /v1/stats, /metrics and
every tenant's pins. Whatever the cache, each key's conversations are its own: the guard tags
every keyed request with its key's id (``key_owner``), which owns its stored responses, also
with ``shared_cache`` (which shares prefixes, not conversations). A guard's refusal is raised, so
it answers in its route's wire shape.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler

from agentd.server.errors import APIError
from agentd.server.settings import ServerSettings


def require_api_key(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Litestar guard: when API keys are set, ``Authorization: Bearer <key>`` (or Anthropic's
    ``x-api-key: <key>``) must match one.

    The key's id goes to ``connection.state.key_owner``; with per-key caches, a tenant key's
    id goes to ``connection.state.cache_tenant`` too; whether the key is an operator's goes to
    ``connection.state.operator``.
    """
    settings: ServerSettings = connection.app.state.agentd.settings
    keys = settings.all_keys
    if not keys:
        return
    scheme, _sep, token = connection.headers.get("authorization", "").partition(" ")
    if "authorization" not in connection.headers and "x-api-key" in connection.headers:
        scheme, token = "bearer", connection.headers["x-api-key"]
    given = token.strip().encode()
    matched = [key for key in keys if hmac.compare_digest(given, key.encode())]
    if scheme.lower() != "bearer" or not matched:
        raise APIError(401, "missing or incorrect API key; send 'Authorization: Bearer <key>' "
                       "(or 'x-api-key: <key>') with a key given to `agentd start --api-key`",
                       headers={"WWW-Authenticate": "Bearer"})
    connection.state.key_owner = tenant_of(matched[0])
    if settings.per_key_cache and matched[0] not in settings.admin_keys:
        connection.state.cache_tenant = connection.state.key_owner
    connection.state.operator = settings.is_operator(matched[0])


def require_operator(connection: ASGIConnection[Any, Any, Any, Any],
                     handler: BaseRouteHandler) -> None:
    """Litestar guard: the API-key guard, and then (when keys are set) an operator's key."""
    require_api_key(connection, handler)
    if not is_operator(connection):
        raise APIError(403, "this needs an admin key: with several --api-key keys only the keys "
                       "given to `agentd start --admin-key` reach /admin, /v1/stats, /metrics and "
                       "other tenants' pins", code="permission_denied")


def require_metrics_access(connection: ASGIConnection[Any, Any, Any, Any],
                           handler: BaseRouteHandler) -> None:
    """Litestar guard for /metrics: open with ``metrics_public``, else an operator's key."""
    if not connection.app.state.agentd.settings.metrics_public:
        require_operator(connection, handler)


def is_operator(connection: ASGIConnection[Any, Any, Any, Any]) -> bool:
    """Whether the guard let an operator in (everyone is, when no keys are set)."""
    settings: ServerSettings = connection.app.state.agentd.settings
    return getattr(connection.state, "operator", not settings.all_keys)


def tenant_of(api_key: str) -> str:
    """A stable, non-reversible id for an API key (the key itself never reaches the cache)."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:32]


def cache_tenant(connection: ASGIConnection[Any, Any, Any, Any]) -> str | None:
    """The tenant id the guard set, or None when tenants share the cache."""
    return getattr(connection.state, "cache_tenant", None)


def key_owner(connection: ASGIConnection[Any, Any, Any, Any]) -> str | None:
    """The id of the key the request came with (what owns its stored responses), whether or not
    keys share the cache; None when no keys are set."""
    return getattr(connection.state, "key_owner", None)
