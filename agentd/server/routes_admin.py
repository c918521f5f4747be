"""Operational routes: ``/health``, ``/version``, ``/v1/stats``, ``/metrics``,
``/admin/integrity``, ``/admin/kv-disk/clear`` and ``/admin/shutdown``.

Invariant: none of these waits on the engine thread — they read the engine's latest stats and
pin snapshots — so monitoring answers at once even while a long prefill is running. ``/health`` is
503 until the model is loaded (and after a failed load), 200 once requests can be served.
``/admin/integrity`` and ``/admin/kv-disk/clear`` are the exceptions: they run on the engine
thread, between steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from litestar import Controller, HttpMethod, Response, get, post, route
from litestar.datastructures import State

from agentd import __version__
from agentd.server.auth import require_metrics_access, require_operator
from agentd.server.metrics import CONTENT_TYPE
from agentd.server.state import server_of
from agentd.server.stats_report import stats_report
from agentd.server.web_guard import require_local_token


@get("/health", summary="Readiness: 200 when the model is loaded, 503 before",
     tags=["Admin"], sync_to_thread=False)
def health(state: State) -> Response[dict[str, Any]]:
    server = server_of(state)
    body: dict[str, Any] = {"status": server.status, "pid": server.pid, "version": __version__}
    engine = server.engine
    if engine is not None:
        body["model"] = engine.model_name
    if server.load_error is not None:
        body["error"] = server.load_error
    return Response(body, status_code=200 if server.status == "ready" else 503)


@route("/", http_method=[HttpMethod.GET, HttpMethod.HEAD], tags=["Admin"],
       summary="The base URL: 200, so clients that probe it (Claude Code sends HEAD) go on",
       sync_to_thread=False)
def root(state: State) -> dict[str, Any]:
    """Open like ``/health``, and 200 whatever the status: the probe asks whether a server
    answers here, not whether its model is ready (a request before that is a 503)."""
    server = server_of(state)
    return {"server": "agentd", "version": __version__, "status": server.status,
            "api": "/v1 (OpenAI), /v1/messages (Anthropic); docs at /docs"}


@get("/version", summary="The server's version (vLLM's route, which routers probe)",
     tags=["Admin"], sync_to_thread=False)
def version() -> dict[str, str]:
    """Open like ``/health``: SMG recognises a vLLM-shaped worker by this route."""
    return {"version": __version__, "server": "agentd"}


def _num_threads() -> int:
    """torch's CPU threads in this daemon (``--num-threads``; default: every core)."""
    import torch  # loaded with the engine already

    return torch.get_num_threads()


def _memory() -> dict[str, int | None]:
    """The daemon's resident memory now and its peak since start (``/proc/self/status``)."""
    from agentd.engine.kv_sizing import proc_status_bytes

    return {"rss_bytes": proc_status_bytes("VmRSS"), "peak_rss_bytes": proc_status_bytes("VmHWM")}


def _prompt_near_misses(server: Any) -> dict[str, Any]:
    """Cache-busters found between a client's own prompts, by ``prompt_cache_key``."""
    history = server.prompt_history
    return history.report() if history is not None else {"total": 0, "top": [], "recent": []}


@get("/metrics", summary="Prometheus metrics (vLLM names)", tags=["Admin"], sync_to_thread=False,
     guards=[require_metrics_access])
def metrics(state: State) -> Response[bytes]:
    server = server_of(state)
    return Response(server.metrics.render(), media_type=CONTENT_TYPE)


class AdminController(Controller):
    guards = [require_operator]
    tags = ["Admin"]

    @get("/v1/stats", summary="Engine, pool, cache-hit, TTFT and pin statistics",
         sync_to_thread=False)
    def stats(self, state: State) -> dict[str, Any]:
        server = server_of(state)
        engine = server.require_engine()
        pins = server.require_pins()
        return {
            "model": engine.model_name,
            "max_model_len": engine.max_model_len,
            "block_size": engine.block_size,
            "compute": engine.compute_report(),
            "uptime_s": round(server.uptime_s, 3),
            "pid": server.pid,
            "version": __version__,
            "num_threads": _num_threads(),
            "num_threads_default": server.config.num_threads is None,
            "memory": _memory(),
            **stats_report(engine.stats(), engine.pin_summary(), server.metrics.recent,
                           pins.restore_report, pins.last_persist_error),
            "by_key": server.key_stats.report(),
            "prompt_near_misses": _prompt_near_misses(server),
        }

    @get("/admin/integrity", summary="Check the KV block pool's invariants (debugging)")
    async def integrity(self, state: State) -> dict[str, Any]:
        """Runs ``check_integrity()`` and a reference audit on the engine thread between steps:
        ``ok`` false names the first violation. Idle means no requests or streams and
        ``num_blocks_used == num_blocks_pinned + num_blocks_retained``."""
        engine = server_of(state).require_engine()
        return dataclasses.asdict(await engine.check_integrity())

    @post("/admin/kv-disk/clear", status_code=200,
          summary="Remove every block of the KV disk tier (the pool keeps its own)")
    async def clear_kv_disk(self, state: State) -> dict[str, Any]:
        """Runs between two engine steps; a load in flight then finds its blocks gone and the
        request computes them."""
        engine = server_of(state).require_engine()
        enabled = engine.engine.disk.enabled
        removed = await engine.call(lambda e: e.disk.clear())
        return {"enabled": enabled, "num_blocks_removed": removed}

    @post("/admin/shutdown", status_code=202, summary="Stop the daemon gracefully",
          sync_to_thread=False, guards=[require_local_token])
    def shutdown(self, state: State) -> dict[str, Any]:
        """In-flight requests get the grace period to finish; the rest are aborted. Without API
        keys the caller must send the local token from the state dir (``agentd stop`` does)."""
        server = server_of(state)
        server.begin_shutdown()
        return {"status": "stopping", "pid": server.pid,
                "grace_s": server.settings.shutdown_grace_s}
