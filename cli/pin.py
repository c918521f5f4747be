"""``agentd pin FILE``: register a system prompt (and tools) with the daemon, prefilled at once.

Invariants: the files are read and checked here — a missing file, tools that are not a JSON list
of OpenAI tools, or a bad ``--ttl`` fail in one line before any request is sent; the command
returns only once the daemon has prefilled and pinned the prefix, and prints what it holds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from agentd.cli._client import DaemonClient, error_message, url_option
from agentd.pins.registry_file import pin_ttl_s

PIN_TIMEOUT_S = 900.0  # a cold prefill of a long prompt on a CPU takes a while


@click.command()
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--name", default=None, help="Pin name [default: FILE's name without suffix].")
@click.option("--tools", "tools_file", default=None, type=click.Path(dir_okay=False,
              path_type=Path), help="JSON file with OpenAI-format tools (a list, or {\"tools\": "
              "[...]}).")
@click.option("--ttl", default=None,
              help="Unpin after this long without a hit, e.g. 90s, 15m, 1h (at most 365d) "
                   "[default: never].")
@click.option("--json", "as_json", is_flag=True, help="Print the daemon's JSON reply.")
@url_option
def command(file: Path, name: str | None, tools_file: Path | None, ttl: str | None,
            as_json: bool, url: str) -> None:
    """Pin the system prompt in FILE: prefill it now and keep its KV cache resident.

    Chat requests with this system prompt (and these tools) then prefill only their own turns.
    """
    system = read_text(file, "FILE")
    tools = read_tools(tools_file) if tools_file is not None else None
    if ttl is not None:
        try:
            pin_ttl_s(ttl)
        except ValueError as exc:
            raise click.ClickException(f"--ttl: {exc}") from None
    body: dict[str, Any] = {"name": name or file.stem, "system": system}
    if tools is not None:
        body["tools"] = tools
    if ttl is not None:
        body["ttl"] = ttl
    client = DaemonClient(url, timeout_s=PIN_TIMEOUT_S)
    response = client.request("POST", "/v1/pins", json=body)
    if response.is_error:
        raise click.ClickException(f"could not pin {body['name']!r}: {error_message(response)}")
    info = response.json()
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    ttl_text = f", unpinned after {ttl} without a hit" if ttl else ""
    click.echo(f"pinned {info['name']}: {info['num_tokens']} tokens in {info['num_blocks']} "
               f"blocks, prefilled in {info['prefill_s']:.2f} s{ttl_text}")


def read_text(path: Path, what: str) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise click.ClickException(f"{what} {path} does not exist; pass the path of a text "
                                   "file that holds the system prompt") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise click.ClickException(f"cannot read {what} {path}: {exc}") from None
    if not text.strip():
        raise click.ClickException(f"{what} {path} is empty; put the system prompt in it")
    return text


def read_tools(path: Path) -> list[dict[str, Any]]:
    """OpenAI tools from a JSON file: a list of tools, or an object with a "tools" list."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise click.ClickException(f"--tools file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise click.ClickException(f"cannot read --tools file {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise click.ClickException(f"--tools file {path} is not valid JSON: {exc.msg} at line "
                                   f"{exc.lineno} column {exc.colno}") from None
    tools = doc.get("tools") if isinstance(doc, dict) else doc
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools):
        raise click.ClickException(
            f"--tools file {path} must hold a JSON list of OpenAI tools, each "
            '{"type": "function", "function": {"name": ..., "parameters": {...}}}')
    return tools
