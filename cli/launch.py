"""``agentd launch claude|codex|opencode [-- client args]``: a coding agent run against this
daemon, configured the way its own docs say to use a custom endpoint.

Invariants: the client's own config files are never written (its settings come through its
environment and command line, for this run only); its model is the one the daemon serves; the
switches that bust the prompt cache or reach the internet for nothing are off; a client that is
not installed, or a daemon that does not answer, is one line saying what to do. The client then
replaces this process (``exec``), so its exit status, signals and terminal are its own.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Any

import click

from agentd.cli._client import API_KEY_ENVVAR, DaemonClient, url_option

# Sent when the daemon takes no key: these clients refuse to start without one.
PLACEHOLDER_KEY = "agentd"


@dataclass(frozen=True)
class Served:
    url: str  # the daemon's base URL, no /v1
    model: str
    max_model_len: int
    max_output_tokens: int  # the daemon's cap for requests that set none
    api_key: str


@dataclass(frozen=True)
class Launch:
    """One client's command line and the environment it adds."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Client:
    binary: str
    package: str  # what `npm install -g` installs

    def launch(self, served: Served, args: tuple[str, ...]) -> Launch:
        raise NotImplementedError


class ClaudeCode(Client):
    def launch(self, served: Served, args: tuple[str, ...]) -> Launch:
        return Launch([self.binary, *args], {
            "ANTHROPIC_BASE_URL": served.url,
            "ANTHROPIC_AUTH_TOKEN": served.api_key,
            "ANTHROPIC_MODEL": served.model,  # the main model, and the small one (titles)
            "ANTHROPIC_SMALL_FAST_MODEL": served.model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": served.model,
            # it asks 32,000 (clamped to the room left); the daemon's own cap instead, as the
            # other two clients get it
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(served.max_output_tokens),
            # its first system line carries a per-request hash: every prompt would miss the cache
            "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
            # no title requests, telemetry or update checks: a local model, a local machine
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        })


class Codex(Client):
    def launch(self, served: Served, args: tuple[str, ...]) -> Launch:
        provider = (f'{{name="agentd", base_url="{served.url}/v1", env_key="{API_KEY_ENVVAR}", '
                    'wire_api="responses"}')
        return Launch([self.binary, "-c", "model_provider=agentd",
                       "-c", f"model_providers.agentd={provider}",
                       "-c", f'model="{served.model}"', *args],
                      {API_KEY_ENVVAR: served.api_key})


class OpenCode(Client):
    def launch(self, served: Served, args: tuple[str, ...]) -> Launch:
        config: dict[str, Any] = {
            "$schema": "https://opencode.ai/config.json",
            "provider": {"agentd": {
                "npm": "@ai-sdk/openai-compatible", "name": "agentd",
                "options": {"baseURL": f"{served.url}/v1", "apiKey": served.api_key},
                # its context, so opencode compacts before the daemon must refuse
                "models": {served.model: {"name": served.model, "limit": {
                    "context": served.max_model_len,
                    "output": min(served.max_output_tokens, served.max_model_len // 4)}}}}},
            "model": f"agentd/{served.model}",
            "small_model": f"agentd/{served.model}",
        }
        return Launch([self.binary, *args], {
            "OPENCODE_CONFIG_CONTENT": json.dumps(config),
            "OPENCODE_DISABLE_MODELS_FETCH": "1",  # models.dev, on every start
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
        })


CLIENTS: dict[str, Client] = {
    "claude": ClaudeCode("claude", "@anthropic-ai/claude-code"),
    "codex": Codex("codex", "@openai/codex"),
    "opencode": OpenCode("opencode", "opencode-ai"),
}


def served(url: str | None) -> Served:
    """What the daemon at ``url`` serves; a ClickException when none answers."""
    daemon = DaemonClient(url)
    try:
        models = daemon.json("GET", "/v1/models")["data"]
    finally:
        daemon.close()
    key = (os.environ.get(API_KEY_ENVVAR) or "").split(",")[0].strip() or PLACEHOLDER_KEY
    card = models[0]
    return Served(daemon.url, card["id"], card["max_model_len"],
                  card.get("max_output_tokens", 4096), key)


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("client", type=click.Choice(sorted(CLIENTS)))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@url_option
@click.option("--print-env", is_flag=True,
              help="Print the environment and command instead of running them.")
def command(client: str, args: tuple[str, ...], url: str, print_env: bool) -> None:
    """Run a coding agent against this daemon: Claude Code (claude), Codex CLI (codex) or
    opencode, with its base URL, key and model set for it. Arguments after ``--`` go to the
    client, e.g. `agentd launch claude -- -p "fix the tests"`."""
    spec = CLIENTS[client]
    binary = shutil.which(spec.binary)
    if binary is None and not print_env:
        raise click.ClickException(
            f"{spec.binary} is not on PATH; install it with `npm install -g {spec.package}`")
    launch = type(spec)(binary or spec.binary, spec.package).launch(served(url), args)
    if print_env:
        for name, value in launch.env.items():
            click.echo(f"{name}={value}")
        click.echo(" ".join(launch.argv))
        return
    os.execvpe(launch.argv[0], launch.argv, {**os.environ, **launch.env})
