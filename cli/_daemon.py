"""Process plumbing for ``agentd start``: binding the port, and running a detached daemon.

Invariants: the port is checked by binding it (never by connecting), so "in use" means in use;
a detached daemon is a new session whose stdout and stderr go to ``<state>/agentd.log``, and the
parent returns success only after ``GET /health`` answered 200. If the daemon exits first, the
parent shows the end of this run's log and exits non-zero.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import time

import click
import httpx

from agentd.cli._state import StatePaths

READY_TIMEOUT_S = 900.0  # a first run builds the kernels and tokenizer cache; a hub download more
_POLL_S = 0.2
_LOG_TAIL_LINES = 20


def display_url(host: str, port: int) -> str:
    """The URL a client should use: wildcard addresses are reached through loopback."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``; a clear one-line error if that is impossible."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise click.ClickException(f"cannot resolve --host {host!r}: {exc.strerror}") from None
    family = infos[0][0]
    try:
        sock = socket.create_server((host, port), family=family, backlog=2048)
    except OSError as exc:
        raise click.ClickException(_bind_error(host, port, exc)) from None
    sock.set_inheritable(False)
    return sock


def _bind_error(host: str, port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return (f"port {port} on {host} is in use (is agentd already running? try "
                "`agentd status`, or pick another --port)")
    if exc.errno == errno.EACCES:
        return f"no permission to listen on port {port}; pick a port above 1024 with --port"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{host} is not an address of this machine; pass another --host"
    return f"cannot listen on {host}:{port}: {exc.strerror or exc}"


def detach(child_args: list[str], api_key: str | None, paths: StatePaths, url: str,
           admin_key: str | None = None) -> None:
    """Start ``agentd start <child_args>`` in the background and wait until it is ready."""
    paths.make_root()
    env = dict(os.environ)
    for name, key in (("AGENTD_API_KEY", api_key), ("AGENTD_ADMIN_KEY", admin_key)):
        if key:
            env[name] = key
    with paths.open_log() as log:
        log_offset = log.tell()
        log.write(f"--- agentd start --detach at {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
                  .encode())
        log.flush()
        process = subprocess.Popen(
            [sys.executable, "-m", "agentd.cli", "start", *child_args],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,  # a Ctrl+C in this terminal must not reach the daemon
        )
    paths.write_pid(process.pid)
    _wait_ready(process, url, paths, log_offset)
    click.echo(f"agentd is ready at {url} (pid {process.pid}, log {paths.log_file})")
    if url != os.environ.get("AGENTD_URL", "http://127.0.0.1:8000"):
        click.echo(f"point the CLI at it with: export AGENTD_URL={url}", err=True)


def _wait_ready(process: subprocess.Popen[bytes], url: str, paths: StatePaths,
                log_offset: int) -> None:
    from rich.console import Console

    deadline = time.monotonic() + READY_TIMEOUT_S
    console = Console(stderr=True)
    with httpx.Client(base_url=url, timeout=2.0, trust_env=False) as http, \
            console.status(f"starting agentd at {url} (loading the model)…"):
        while time.monotonic() < deadline:
            code = process.poll()
            if code is not None:
                _show_log_tail(paths, log_offset)
                paths.remove_if_owned(process.pid)
                raise click.ClickException(
                    f"agentd exited with status {code} before it was ready; full log: "
                    f"{paths.log_file}"
                )
            try:
                if http.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(_POLL_S)
    raise click.ClickException(
        f"agentd (pid {process.pid}) was not ready after {READY_TIMEOUT_S:.0f} s; it is still "
        f"starting — see {paths.log_file}, or stop it with `agentd stop`"
    )


def _show_log_tail(paths: StatePaths, log_offset: int) -> None:
    try:
        with open(paths.log_file, "rb") as log:
            log.seek(log_offset)
            lines = [line for line in log.read().decode(errors="replace").splitlines()
                     if '"GET /health ' not in line]  # our own readiness polls
    except OSError:
        return
    for line in lines[-_LOG_TAIL_LINES:]:
        click.echo(line, err=True)
