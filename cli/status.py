"""``agentd status``: is a daemon running, and how busy is it.

Invariant: status only reads (``GET /health``, ``/v1/stats``, ``/v1/models``); its exit status is
0 when a daemon answers (ready or still loading) and 3 when none does (the LSB convention for
"not running"), so scripts can test it.
"""

from __future__ import annotations

import json
from typing import Any

import click

from agentd.cli._client import DaemonClient, DaemonUnreachable, url_option

NOT_RUNNING = 3


@click.command()
@url_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.pass_context
def command(ctx: click.Context, url: str, as_json: bool) -> None:
    """Show whether the daemon runs, its model, uptime, pool usage and requests."""
    client = DaemonClient(url)
    try:
        health = client.health()
    except DaemonUnreachable:
        if as_json:
            click.echo(json.dumps({"running": False, "url": client.url}))
        else:
            click.echo(f"agentd is not running (nothing at {client.url}); start it with "
                       "`agentd start`")
        ctx.exit(NOT_RUNNING)
    report: dict[str, Any] = {"running": True, "url": client.url, **health}
    if health.get("status") == "ready":
        stats = client.request("GET", "/v1/stats")
        if stats.status_code == 403:  # a tenant's key on a multi-tenant daemon: no pool figures
            report["stats_note"] = "pool and request figures need an admin key"
        else:
            report["stats"] = client.json("GET", "/v1/stats")
        report["models"] = [m["id"] for m in client.json("GET", "/v1/models")["data"]]
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        _print_table(report)


def _print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    state = {"ready": "[green]running[/]", "loading": "[yellow]starting (loading the model)[/]",
             "stopping": "[yellow]stopping[/]"}.get(report["status"], "[red]failed[/]")
    table.add_row("agentd", f"{state} at {report['url']} (pid {report.get('pid')})")
    if report.get("error"):
        table.add_row("error", report["error"])
    stats = report.get("stats")
    if stats is not None:
        _stats_rows(table, stats)
    elif report.get("models"):
        table.add_row("model", ", ".join(report["models"]))
    if report.get("stats_note"):
        table.add_row("note", report["stats_note"])
    Console().print(table)


def _stats_rows(table: Any, s: dict[str, Any]) -> None:
    total = s["num_blocks_total"]
    table.add_row("model", f"{s['model']} (max_model_len {s['max_model_len']})")
    for name, value in startup_rows(s):
        table.add_row(name, value)
    if compute := s.get("compute"):
        table.add_row("compute", f"{compute.get('isa') or compute['device']} · dtype "
                                 f"{compute['dtype']} · weights {compute['weights']}")
        for kind, choice in (compute.get("kernels") or {}).items():
            table.add_row("", f"{kind}: {choice}")
    table.add_row("uptime", format_duration(s["uptime_s"]))
    if s.get("num_threads") is not None:
        table.add_row("threads", threads_note(s["num_threads"], s["num_threads_default"]))
    table.add_row("pool", f"{s['num_blocks_used']} / {total} blocks in use "
                          f"({100 * s['kv_cache_usage']:.1f}%; {s['num_blocks_pinned']} of them "
                          f"pinned, {s.get('num_blocks_retained', 0)} retained), "
                          f"{s['num_blocks_cached']} cached, {s['num_blocks_free']} free")
    if s.get("num_pins"):
        table.add_row("pins", f"{s['num_pins']} (see `agentd pins` and `agentd stats`)")
    table.add_row("requests", f"{s['num_requests_running']} running, "
                              f"{s['num_requests_waiting']} waiting, "
                              f"{s['num_requests_finished']} finished")
    queries, hits = s["prefix_cache_queries"], s["prefix_cache_hits"]
    rate = f" ({100 * hits / queries:.1f}%)" if queries else ""
    table.add_row("prefix cache", f"{hits} of {queries} prompt tokens hit{rate}")
    table.add_row("tokens", f"{s['prompt_tokens_total']} prompt, "
                            f"{s['generation_tokens_total']} generated")


def startup_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """Load time, memory, context (and why it is capped) and the KV pool, from ``/v1/stats``;
    rows a daemon without those figures does not report are left out."""
    rows = []
    if s.get("load_s") is not None:
        rows.append(("loaded in", f"{s['load_s']:.1f} s"))
    memory = s.get("memory") or {}
    if memory.get("rss_bytes") is not None:
        rows.append(("memory", f"RSS {format_bytes(memory['rss_bytes'])}, peak "
                               f"{format_bytes(memory.get('peak_rss_bytes'))}"))
    kv = s.get("kv_cache")
    if kv:
        context = f"{kv['max_model_len']:,} tokens"
        if kv.get("cap_reason"):
            context += f", capped below the model's {kv['model_len']:,}: {kv['cap_reason']}"
        rows.append(("context", context))
        budget = "set by --kv-cache-memory" if kv.get("budget_bytes") is None else \
            f"budget {format_bytes(kv['budget_bytes'])}"
        rows.append(("kv cache", f"{kv['dtype']} · {kv['num_tokens']:,} tokens · "
                                 f"{format_bytes(kv['num_bytes'])} ({kv['bytes_per_token']:,} "
                                 f"bytes a token; {budget}; resident as it fills)"))
    return rows


def format_bytes(num_bytes: int | None) -> str:
    if num_bytes is None:
        return "?"
    if num_bytes >= 2**30:
        return f"{num_bytes / 2**30:.1f} GiB"
    return f"{num_bytes / 2**20:,.0f} MiB"


def threads_note(num_threads: int, is_default: bool) -> str:
    """How many CPU threads the daemon computes with, and what that means for a second one."""
    if not is_default:
        return f"{num_threads} (--num-threads)"
    return (f"{num_threads} (the default: all cores; every daemon on this host takes as many, "
            "so give several daemons a share each with --num-threads)")


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h {minutes:02d}m"
    if hours:
        return f"{hours}h {minutes:02d}m {secs:02d}s"
    return f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"
