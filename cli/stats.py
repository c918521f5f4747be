"""``agentd stats``: prefix-cache hit rate (overall and per pin), TTFT of hits vs misses, pool
blocks, throughput, prefixes retained by cache control, and near misses, as rich tables, JSON, or
a live view (``--watch``); ``--by-key``: hit rates per ``prompt_cache_key`` (the conversation or
agent a client names).

Invariant: read-only (``GET /v1/stats``, which answers from snapshots, so watching never slows
the engine); ``--watch`` runs until Ctrl-C and then exits 0.
"""

from __future__ import annotations

import json
import time
from typing import Any

import click

from agentd.cli._client import DaemonClient, url_option
from agentd.cli.pins import compact_table, short_duration
from agentd.cli.status import format_duration

NUM_NEAR_MISSES_SHOWN = 5
NUM_RETAINED_SHOWN = 10


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print /v1/stats as JSON.")
@click.option("--by-key", is_flag=True,
              help="Hit rates per prompt_cache_key (Anthropic: metadata.user_id) instead.")
@click.option("--watch", type=click.FloatRange(min=0.2), is_flag=False, flag_value=2.0,
              default=None, metavar="[SECONDS]",
              help="Refresh every SECONDS (default 2) until Ctrl-C.")
@url_option
def command(as_json: bool, by_key: bool, watch: float | None, url: str) -> None:
    """Show cache hit rates, TTFT of hits vs misses, pool blocks, tokens/s and near misses."""
    client = DaemonClient(url)
    view = render_by_key if by_key else render
    if as_json:
        stats = client.json("GET", "/v1/stats")
        click.echo(json.dumps(stats.get("by_key", []) if by_key else stats, indent=2))
        return
    from rich.console import Console

    console = Console()
    if watch is None:
        console.print(view(client.json("GET", "/v1/stats")))
        return
    from rich.live import Live

    try:
        with Live(view(client.json("GET", "/v1/stats")), console=console,
                  auto_refresh=False) as live:
            while True:
                time.sleep(watch)
                live.update(view(client.json("GET", "/v1/stats")), refresh=True)
    except KeyboardInterrupt:
        pass


def render(s: dict[str, Any]) -> Any:
    """All sections of the stats view, as one rich renderable."""
    from rich.console import Group

    parts = [_overview(s), _ttft(s["ttft"])]
    if s["pins"]:
        parts.append(_pins(s["pins"]))
    if s.get("retained"):
        parts.append(_retained(s["retained"]))
    near = s["near_misses"]
    if near["top"]:
        parts.append(_near_misses(near))
    if s.get("prompt_near_misses", {}).get("top"):
        parts.append(_prompt_near_misses(s["prompt_near_misses"]))
    if s.get("pin_restore"):
        parts.append(_restore(s["pin_restore"]))
    return Group(*parts)


def render_by_key(s: dict[str, Any]) -> Any:
    """One row per session (its ``prompt_cache_key``, or the session a coding agent names in
    its headers, as ``client:id``): requests, hits and the share of prompt tokens cached."""
    rows = s.get("by_key", [])
    tenants = any(row["tenant"] for row in rows)
    table = compact_table("cache by session", "session", [
        *(["tenant"] if tenants else []), "requests", "hits", "prompt\ntokens",
        "cached\ntokens", "hit rate"], caption_justify="left",
        caption="hits: requests with any cached prompt token; a request is counted here when it "
                "names its session: prompt_cache_key (OpenAI), a coding agent's session header "
                "(Claude Code, Codex and opencode send theirs) or metadata.user_id (Anthropic)"
                if not rows else None)
    for row in rows:
        table.add_row(row["key"], *([(row["tenant"] or "-")[:8]] if tenants else []),
                      str(row["requests"]), str(row["hits"]), str(row["prompt_tokens"]),
                      str(row["cached_tokens"]), _pct(row["hit_rate"]))
    return table


def _overview(s: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    table.add_row("model", f"{s['model']} (max_model_len {s['max_model_len']}), up "
                           f"{format_duration(s['uptime_s'])}")
    queries, hits = s["prefix_cache_queries"], s["prefix_cache_hits"]
    rate = s.get("prefix_cache_hit_rate")
    disk_hits = s.get("prefix_cache_disk_hits", 0)
    table.add_row("prefix cache", f"{_pct(rate)} of prompt tokens hit ({hits} of {queries}"
                                  f"{f', {disk_hits} from disk' if disk_hits else ''})")
    if s.get("kv_disk"):
        table.add_row("disk tier", _disk(s["kv_disk"]))
    pinned, retained = s["num_blocks_pinned"], s.get("num_blocks_retained", 0)
    table.add_row("pool blocks", f"{s['num_blocks_free']} free, {s['num_blocks_cached']} cached, "
                                 f"{pinned} pinned, {retained} retained, "
                                 f"{s['num_blocks_used'] - pinned - retained} in use "
                                 f"(of {s['num_blocks_total']})")
    table.add_row("requests", f"{s['num_requests_running']} running, "
                              f"{s['num_requests_waiting']} waiting, "
                              f"{s['num_requests_finished']} finished")
    table.add_row("throughput", f"{s['tokens_per_s']:.1f} output tokens/s (last minute)")
    if s.get("pin_persist_error"):
        table.add_row("[red]pins not saved[/]", s["pin_persist_error"])
    return table


def _pinned(num_bytes: int) -> str:
    return f" + {num_bytes / 2**20:.1f} MiB of pins' blocks" if num_bytes else ""


def _disk(disk: dict[str, Any], markup: bool = True) -> str:
    """The KV disk tier in one line: size against budget, traffic, trouble (``markup``: rich's
    colour for stopped writes)."""
    oldest = disk["oldest_use_s"]
    line = (f"{disk['num_blocks']} blocks, {disk['num_bytes'] / 2**30:.2f} of "
            f"{disk['budget_bytes'] / 2**30:.1f} GiB"
            f" ({disk.get('kept_bytes', 0) / 2**30:.2f} GiB sessions')"
            f"{_pinned(disk.get('pinned_bytes', 0))}"
            f"{f', oldest used {format_duration(oldest)} ago' if oldest is not None else ''}; "
            f"{disk['num_blocks_written']} written, {disk['num_blocks_read']} read back "
            f"({disk['num_loads']} loads, {disk['load_s']:.2f} s); {disk['directory']}")
    if disk["num_blocks_rejected"]:
        line += f"; {disk['num_blocks_rejected']} failed their checks (recomputed)"
    if disk["num_writes_dropped"]:
        line += (f"; {disk['num_writes_dropped']} writes dropped (queue full), "
                 f"{disk.get('num_writes_retried', 0)} of them retried at eviction")
    if disk["writes_stopped"]:
        stopped = f"writes stopped: {disk['writes_stopped']}"
        line += f"; [red]{stopped}[/]" if markup else f"; {stopped}"
    return line


def _ttft(ttft: dict[str, dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(title="time to first token (recent requests)", title_justify="left")
    for column in ("cache", "requests", "p50", "p90", "p99"):
        table.add_column(column, justify="left" if column == "cache" else "right")
    for outcome in ("hit", "miss"):
        row = ttft[outcome]
        table.add_row(outcome, str(row["count"]), *(_ms(row[q]) for q in ("p50", "p90", "p99")))
    return table


def _pins(pins: list[dict[str, Any]]) -> Any:

    table = compact_table("pins", "pin", ["tokens", "blocks", "hits", "cached\ntokens",
                                          "near\nmisses", "TTL", "idle"],
                          caption_justify="left",
                          caption="hits: requests that matched a whole pin; cached tokens: "
                                  "prompt tokens served from its KV instead of prefilled")
    for p in pins:
        table.add_row(p["name"], str(p["num_tokens"]), str(p["num_blocks"]), str(p["hits"]),
                      str(p["tokens_served"]), str(p["near_misses"]), short_duration(p.get("ttl")),
                      short_duration(p["idle_s"]))
    return table


def _retained(retained: list[dict[str, Any]]) -> Any:
    from rich.markup import escape

    table = compact_table(f"retained prefixes ({len(retained)}): kept by cache control "
                          "(cache_control, prompt_cache_options, prompt_cache_retention)",
                          "ends with", ["tokens", "blocks", "hits", "cached\ntokens", "TTL",
                                        "TTL left"],
                          caption_justify="left",
                          caption="each hit refreshes its TTL; over the pin budget the least "
                                  "recently used decays first; pins are never displaced")
    for r in retained[:NUM_RETAINED_SHOWN]:
        table.add_row(escape(r["ends_with"]), str(r["num_tokens"]), str(r["num_blocks"]),
                      str(r["hits"]), str(r["tokens_served"]), short_duration(r["ttl"]),
                      short_duration(r["ttl_left_s"]))
    return table


def _near_misses(near: dict[str, Any]) -> Any:
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table

    top = Table(title=f"near misses ({near['total']}): requests that left a pin before its end",
                title_justify="left")
    for column in ("pin", "likely cause", "count"):
        top.add_column(column, justify="right" if column == "count" else "left")
    for row in near["top"]:
        top.add_row(row["pin"], row["cause"], str(row["count"]))
    latest = Table(title="latest near misses (⟦ marks the first differing token)",
                   title_justify="left")
    for column in ("pin", "at token", "pin text", "request text"):
        latest.add_column(column, justify="right" if column == "at token" else "left")
    for miss in near["recent"][:NUM_NEAR_MISSES_SHOWN]:
        latest.add_row(miss["pin"], f"{miss['divergence_token']} / {miss['pin_num_tokens']}",
                       escape(miss["pin_text"]), escape(miss["request_text"]))
    return Group(top, latest)


def _prompt_near_misses(near: dict[str, Any]) -> Any:
    """Cache-busters between a client's own requests, by prompt_cache_key, with the span that
    varies and the client setting that turns it off, when the client is known."""
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table

    top = Table(title=f"cache-busters ({near['total']}): requests equal to an earlier one of "
                      "their prompt_cache_key but for a short span", title_justify="left")
    for column in ("prompt_cache_key", "likely cause", "count"):
        top.add_column(column, justify="right" if column == "count" else "left")
    for row in near["top"]:
        top.add_row(escape(row["key"] or "(none)"), escape(row["cause"]), str(row["count"]))
    latest = Table(title="latest: the span that varies (⟦this request⟧ vs ⟦the earlier one⟧)",
                   title_justify="left")
    for column in ("key", "at token", "span", "tokens lost", "fix"):
        latest.add_column(column, justify="right" if column in ("at token", "tokens lost")
                          else "left")
    for miss in near["recent"][:NUM_NEAR_MISSES_SHOWN]:
        span = f"{miss['before'][-24:]}⟦{miss['new_span']}⟧ vs ⟦{miss['old_span']}⟧"
        latest.add_row(escape(miss["key"] or "(none)"), str(miss["at_token"]), escape(span),
                       str(miss["num_tokens_lost"]), escape(miss["fix"] or "-"))
    return Group(top, latest)


def _restore(report: list[dict[str, Any]]) -> Any:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="pins restored at start", title_justify="left")
    for column in ("pin", "from", "tokens", "restore", "first prefill"):
        table.add_column(column, justify="left" if column in ("pin", "from") else "right")
    for entry in report:
        if "error" in entry:
            table.add_row(entry["name"], f"[red]failed: {escape(entry['error'])}[/]", "", "", "")
            continue
        prefill = entry.get("prefill_s")
        source = entry["source"]
        if entry.get("kv_error"):  # the stored KV was there but unusable
            source += f" (stored KV unusable: {escape(entry['kv_error'])})"
        table.add_row(entry["name"], source, str(entry["num_tokens"]),
                      f"{entry['elapsed_s']:.3f} s", "-" if prefill is None else f"{prefill:.3f} s")
    return table


def _pct(rate: float | None) -> str:
    return "-" if rate is None else f"{100 * rate:.1f}%"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f} ms"
