"""Where agentd caches what it builds (model conversions, tokenizers, compiled kernels).

Invariant: imports nothing of agentd, so the kernels' build may use it without importing the
model loader (which converts GGUFs with those kernels).
"""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """`$AGENTD_CACHE_DIR`, else `$XDG_CACHE_HOME/agentd`, else `~/.cache/agentd`."""
    if explicit := os.environ.get("AGENTD_CACHE_DIR"):
        return Path(explicit).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "agentd"
    return Path.home() / ".cache" / "agentd"
