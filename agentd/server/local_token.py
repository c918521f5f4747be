"""The local token: what lets ``agentd stop`` shut down a daemon that has no API keys.

Invariants: each start writes a fresh random token to ``<state dir>/cli.token``, readable by its
owner only (the file is created 0600 before anything is written to it, then renamed into place),
so whoever can read the state dir — the user who started the daemon — can stop it, and a web
page cannot. Imports nothing heavy: the CLI reads it without loading the server.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

TOKEN_FILE = "cli.token"
TOKEN_HEADER = "x-agentd-token"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_token(state_dir: Path, token: str) -> None:
    """``<state_dir>/cli.token``, readable by its owner only."""
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_dir / f".{TOKEN_FILE}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.replace(tmp, state_dir / TOKEN_FILE)


def read_token(state_dir: Path) -> str | None:
    with contextlib.suppress(OSError):
        return (state_dir / TOKEN_FILE).read_text().strip() or None
    return None
