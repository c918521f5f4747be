"""``python -m agentd.cli``: the same entry point as the ``agentd`` console script (``start
--detach`` runs the daemon this way, with the interpreter that runs the CLI)."""

from __future__ import annotations

from agentd.cli import main

if __name__ == "__main__":
    main(prog_name="agentd")
