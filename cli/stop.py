"""``agentd stop``: ask the daemon to shut down gracefully and wait until it has exited.

Invariants: the daemon is asked over HTTP first (``POST /admin/shutdown`` with the local token
from the state dir, and ``$AGENTD_API_KEY``: in-flight requests get its grace period, then are
aborted); a daemon without keys that refuses the token is answered with where the token was
looked for and how to point at the daemon's own state dir; signals are only a fallback, for a
daemon on this machine
that does not answer or does not exit in time (SIGTERM, then SIGKILL). On success no process is
left and the state dir holds no pid file for it.
"""

from __future__ import annotations

import os
import signal
import time
from urllib.parse import urlsplit

import click

from agentd.cli._client import DaemonClient, DaemonUnreachable, error_code, url_option
from agentd.cli._state import STATE_DIR_ENVVAR, StatePaths, pid_alive, state_dir_option
from agentd.server.local_token import TOKEN_FILE, TOKEN_HEADER, read_token

_KILL_WAIT_S = 5.0


@click.command()
@url_option
@state_dir_option
@click.option("--timeout", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds to wait for a graceful exit before sending SIGTERM.")
def command(url: str, state_dir: str | None, timeout: float) -> None:
    """Stop the daemon: in-flight requests finish or are aborted, then it exits."""
    paths = StatePaths.of(state_dir)
    client = DaemonClient(url)
    try:
        pid = client.health().get("pid")
    except DaemonUnreachable:
        pid = paths.live_pid()
        if pid is None:
            raise
        click.echo(f"no answer at {client.url}; signalling agentd (pid {pid}) from "
                   f"{paths.pid_file}", err=True)
        _terminate(pid, paths)
        return
    _ask_to_shut_down(client, paths)
    local = _is_loopback(client.url) and isinstance(pid, int)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        gone = not pid_alive(pid) if local else not _answers(client)
        if gone:
            break
        time.sleep(0.1)
    else:
        if not local:
            raise click.ClickException(f"the daemon at {client.url} did not stop within "
                                       f"{timeout:g} s")
        click.echo(f"agentd (pid {pid}) did not exit within {timeout:g} s; sending SIGTERM",
                   err=True)
        _terminate(pid, paths)
        return
    if local:
        paths.remove_if_owned(pid)
    click.echo(f"agentd stopped (pid {pid})")


def _ask_to_shut_down(client: DaemonClient, paths: StatePaths) -> None:
    """``POST /admin/shutdown`` with the local token (what a daemon without keys asks of the
    caller) and the API key; a refused token says where it was looked for."""
    token = read_token(paths.root)
    response = client.request("POST", "/admin/shutdown",
                              headers={TOKEN_HEADER: token} if token else None)
    if response.status_code == 401 and error_code(response) == "missing_token":
        found = (f"the local daemon token in {paths.root / TOKEN_FILE} is not the daemon's (it is "
                 "another start's)" if token else
                 f"no local daemon token was found in the state dir {paths.root} (no "
                 f"{TOKEN_FILE} there)")
        raise click.ClickException(
            f"{found}: the daemon at {client.url} keeps its token in the state dir it was started "
            f"with; point at that dir with --state-dir DIR or {STATE_DIR_ENVVAR}=DIR")
    client.check(response, "POST", "/admin/shutdown")


def _terminate(pid: int, paths: StatePaths) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + _KILL_WAIT_S
        while time.monotonic() < deadline and pid_alive(pid):
            time.sleep(0.1)
        if not pid_alive(pid):
            break
    if pid_alive(pid):
        raise click.ClickException(f"agentd (pid {pid}) is still running after SIGKILL")
    paths.remove_if_owned(pid)
    click.echo(f"agentd stopped (pid {pid})")


def _answers(client: DaemonClient) -> bool:
    try:
        client.health()
    except click.ClickException:
        return False
    return True


def _is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")
