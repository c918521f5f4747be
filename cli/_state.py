"""The daemon's state directory: where ``agentd start`` keeps its pid file, log and address.

Invariants: files are written atomically (temp file + rename), so a reader never sees half a pid;
the directory is 0700 and every file agentd writes in it 0600 (they hold prompts and keys' use);
a process removes a pid file only when it holds that process's own pid; a pid counts as alive
only if the process exists and is not a zombie. The directory is ``--state-dir``, else
``$AGENTD_HOME``, else ``$XDG_STATE_HOME/agentd``, else ``~/.local/state/agentd``.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

STATE_DIR_ENVVAR = "AGENTD_HOME"


def default_state_dir() -> Path:
    """``$XDG_STATE_HOME/agentd``, else ``~/.local/state/agentd`` (``$AGENTD_HOME`` is read by
    the ``--state-dir`` option itself)."""
    if xdg := os.environ.get("XDG_STATE_HOME"):
        return Path(xdg).expanduser() / "agentd"
    return Path.home() / ".local" / "state" / "agentd"


state_dir_option = click.option(
    "--state-dir", envvar=STATE_DIR_ENVVAR, show_envvar=True, default=None,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory for the pid file, log, daemon.json, pins (pins.json) and the KV block "
         "store (kv-store/: the disk tier's blocks and pins' KV) "
         "[default: $XDG_STATE_HOME/agentd or ~/.local/state/agentd].",
)


@dataclass(frozen=True)
class StatePaths:
    root: Path

    @classmethod
    def of(cls, state_dir: Path | None) -> StatePaths:
        return cls((state_dir or default_state_dir()).expanduser().absolute())

    @property
    def pid_file(self) -> Path:
        return self.root / "agentd.pid"

    @property
    def log_file(self) -> Path:
        return self.root / "agentd.log"

    @property
    def daemon_file(self) -> Path:
        return self.root / "daemon.json"

    def make_root(self) -> Path:
        """Create the state dir if needed; make it (and an older, looser one) 0700."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.root, 0o700)
        return self.root

    def open_log(self) -> Any:
        """The log, opened for appending, 0600 (an older, looser one is tightened)."""
        self.make_root()
        fd = os.open(self.log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        if stat.S_ISREG(os.fstat(fd).st_mode):  # never chmod what a link points to
            os.fchmod(fd, 0o600)
        return os.fdopen(fd, "ab")

    def read_pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None

    def live_pid(self) -> int | None:
        """The pid in the pid file if that process is still running."""
        pid = self.read_pid()
        return pid if pid is not None and pid_alive(pid) else None

    def write_pid(self, pid: int) -> None:
        write_atomic(self.pid_file, f"{pid}\n")

    def write_daemon_info(self, info: dict[str, Any]) -> None:
        write_atomic(self.daemon_file, json.dumps(info, indent=2) + "\n")

    def remove_if_owned(self, pid: int) -> None:
        """Remove the pid file and daemon.json if they describe ``pid``."""
        if self.read_pid() == pid:
            for path in (self.pid_file, self.daemon_file):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()


def write_atomic(path: Path, text: str) -> None:
    """Write ``path`` (0600, like every file mkstemp makes) through a temp file and a rename."""
    StatePaths(path.parent).make_root()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie, or a child we reap here, is not)."""
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False  # it was our child and has just been reaped
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs: trust kill(0)
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"
