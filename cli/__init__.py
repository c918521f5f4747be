"""The ``agentd`` command line: a click group whose subcommands are imported only when run.

Invariants: ``agentd --help`` imports neither torch, transformers nor litestar (each command module
imports only click and the standard library at the top); every subcommand but ``start`` reaches
the daemon over HTTP only; a user error is one ``Error: ...`` line and a non-zero exit status,
usage errors included.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

from agentd import __version__

# name -> "module:attribute"; add a command by adding a line here and a module beside this one.
COMMANDS = {
    "bench": "agentd.cli.bench:command",
    "cache": "agentd.cli.cache:command",
    "cluster": "agentd.cli.cluster:command",
    "launch": "agentd.cli.launch:command",
    "start": "agentd.cli.start:command",
    "stop": "agentd.cli.stop:command",
    "status": "agentd.cli.status:command",
    "pin": "agentd.cli.pin:command",
    "unpin": "agentd.cli.unpin:command",
    "pins": "agentd.cli.pins:command",
    "stats": "agentd.cli.stats:command",
}


class LazyGroup(click.Group):
    """A group that imports a subcommand's module only when the subcommand is looked up."""

    def __init__(self, *args: Any, lazy_subcommands: dict[str, str] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_subcommands = lazy_subcommands or {}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy_subcommands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy_subcommands:
            module_name, attribute = self.lazy_subcommands[cmd_name].split(":")
            command = getattr(importlib.import_module(module_name), attribute)
            if not isinstance(command, click.Command):
                raise TypeError(f"{self.lazy_subcommands[cmd_name]} is not a click command")
            return command
        return super().get_command(ctx, cmd_name)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.exceptions.NoArgsIsHelpError:
            raise
        except click.UsageError as exc:
            # Click prints usage + a hint + the error on three lines; keep it to one line.
            where = exc.ctx.command_path if exc.ctx is not None else ctx.command_path
            one_line = click.ClickException(f"{exc.format_message()} (see `{where} --help`)")
            one_line.exit_code = exc.exit_code
            raise one_line from exc


@click.group(cls=LazyGroup, lazy_subcommands=COMMANDS,
             context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="agentd")
def main() -> None:
    """agentd: a local LLM inference daemon for agents, with an OpenAI-compatible API.

    The daemon keeps the KV cache of long shared prompts resident. Commands other than `start`
    talk to a running daemon at $AGENTD_URL (default http://127.0.0.1:8000).
    """
