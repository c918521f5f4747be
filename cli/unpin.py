"""``agentd unpin NAME``: drop a pin; its blocks stay cached as ordinary LRU blocks.

Invariant: only ``DELETE /v1/pins/{name}`` is sent; an unknown name fails in one line that says
how to list the pins.
"""

from __future__ import annotations

from urllib.parse import quote

import click

from agentd.cli._client import DaemonClient, error_message, url_option


@click.command()
@click.argument("name")
@click.option("--owner", default=None, metavar="TENANT_ID",
              help="With an admin key: unpin another tenant's pin (its owner in `agentd pins "
                   "--json`).")
@url_option
def command(name: str, owner: str | None, url: str) -> None:
    """Unpin NAME: its KV blocks become ordinary cached blocks (evictable, still hitting)."""
    query = f"?owner={quote(owner, safe='')}" if owner is not None else ""
    response = DaemonClient(url).request("DELETE", f"/v1/pins/{quote(name, safe='')}{query}")
    if response.status_code == 404:
        raise click.ClickException(f"no pin named {name!r}; list the pins with `agentd pins`")
    if response.is_error:
        raise click.ClickException(f"could not unpin {name!r}: {error_message(response)}")
    click.echo(f"unpinned {name}")
