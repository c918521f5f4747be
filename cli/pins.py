"""``agentd pins``: the pins a daemon holds, as a table or JSON.

Invariants: read-only (``GET /v1/pins``); every pin's name is shown whole (folded onto more
lines if need be) at any terminal width: number columns are dropped from the right, and the
caption says which, before a name would be cut.
"""

from __future__ import annotations

import json
import time
from typing import Any

import click

from agentd.cli._client import DaemonClient, url_option

_NEVER_S = 100 * 365 * 86400.0


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the JSON list instead of a table.")
@url_option
def command(as_json: bool, url: str) -> None:
    """List pinned prefixes: size, hits, tokens served from cache, TTL."""
    pins = DaemonClient(url).json("GET", "/v1/pins")["data"]
    if as_json:
        click.echo(json.dumps(pins, indent=2))
        return
    if not pins:
        click.echo("no pins; add one with `agentd pin SYSTEM_PROMPT.txt [--tools TOOLS.json]`")
        return
    from rich.console import Console

    console = Console()
    console.print(fit_width(pins_table(pins), console.width))


def pins_table(pins: list[dict[str, Any]]) -> Any:
    table = compact_table("pins", "name", ["tokens", "blocks", "hits", "cached\ntokens", "TTL",
                                           "idle", "age"])
    now = time.time()
    for p in pins:
        table.add_row(p["name"], str(p["num_tokens"]), str(p["num_blocks"]), str(p["hits"]),
                      str(p["tokens_served"]), short_duration(p.get("ttl")),
                      short_duration(p["idle_s"]), short_duration(max(now - p["created"], 0)))
    return table


def compact_table(title: str, name: str, numbers: list[str], **kwargs: Any) -> Any:
    """A table whose first column (a pin's name) folds onto more lines rather than losing
    characters, and whose other columns (numbers) never wrap. Without vertical rules, so an
    80-column terminal holds the usual names whole."""
    from rich import box
    from rich.table import Table

    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, **kwargs)
    table.add_column(name, overflow="fold", ratio=1, min_width=12)
    for column in numbers:
        table.add_column(column, justify="right", no_wrap=True)
    return table


def fit_width(table: Any, width: int) -> Any:
    """Drop number columns from the right until the first column (the names, which rich would
    squeeze out first) keeps its min_width within ``width``; the caption says what is left
    out and how to see it."""
    dropped: list[str] = []
    while len(table.columns) > 1 and _needed_width(table) > width:
        dropped.insert(0, " ".join(str(table.columns.pop().header).split()))
    if dropped:
        table.caption = (f"not shown at this width: {', '.join(dropped)}; widen the terminal "
                         "or use --json")
        table.caption_justify = "left"
    return table


def _needed_width(table: Any) -> int:
    """The table's width with its first column at its min_width: each column's widest line and
    its padding (1 each side), a separator between columns and an edge at each end."""
    from rich.cells import cell_len

    first, *numbers = table.columns
    widths = [first.min_width or 1] + [
        max(cell_len(line) for cell in (column.header, *column.cells)
            for line in str(cell).splitlines() or [""])
        for column in numbers]
    return sum(widths) + 3 * len(widths) + 1


def short_duration(seconds: float | None) -> str:
    """``90`` → ``1m30s``, ``3600`` → ``1h``; None → ``-``; past a century (a TTL a registry
    from before TTLs were bounded may hold), infinite or NaN → ``never``."""
    if seconds is None:
        return "-"
    if not seconds < _NEVER_S:
        return "never"
    if seconds < 10:
        return f"{seconds:.1f}s".replace(".0s", "s")
    rest = int(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        count, rest = divmod(rest, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts[:2])
