"""``agentd cache``: the KV disk tier under the pool; ``agentd cache clear`` empties it.

Invariant: only ``GET /v1/stats`` and ``POST /admin/kv-disk/clear`` are sent (an operator's
routes where keys are set).
"""

from __future__ import annotations

import click

from agentd.cli._client import DaemonClient, url_option


@click.group(invoke_without_command=True)
@url_option
@click.pass_context
def command(ctx: click.Context, url: str) -> None:
    """Show the KV disk tier: blocks, bytes against the budget, traffic, where it lives."""
    if ctx.invoked_subcommand is not None:
        return
    from agentd.cli.stats import _disk

    stats = DaemonClient(url).json("GET", "/v1/stats")
    disk = stats.get("kv_disk")
    if not disk:
        click.echo("the KV disk tier is off (agentd start --no-kv-disk, or a GPU pool)")
        return
    click.echo(f"disk tier: {_disk(disk, markup=False)}")
    click.echo(f"prompt tokens read back from disk since start: "
               f"{stats.get('prefix_cache_disk_hits', 0)}")


@command.command()
@url_option
def clear(url: str) -> None:
    """Remove every block of the KV disk tier (the pool's blocks stay cached)."""
    reply = DaemonClient(url).json("POST", "/admin/kv-disk/clear")
    if not reply["enabled"]:
        click.echo("the KV disk tier is off: nothing to clear")
        return
    click.echo(f"removed {reply['num_blocks_removed']} blocks from the KV disk tier")
