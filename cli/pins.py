"""``agentd pins``: the pins a daemon holds, as a table or JSON.

Invariant: read-only (``GET /v1/pins``).
"""

from __future__ import annotations

import json
import time
from typing import Any

import click

from agentd.cli._client import DaemonClient, url_option


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

    Console().print(pins_table(pins))


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


def short_duration(seconds: float | None) -> str:
    """``90`` → ``1m30s``, ``3600`` → ``1h``; None → ``-``."""
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.1f}s".replace(".0s", "s")
    rest = int(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        count, rest = divmod(rest, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts[:2])
