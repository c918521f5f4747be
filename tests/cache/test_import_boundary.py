"""agentd.cache must stay importable without torch (it deals in ints and bytes only)."""

from __future__ import annotations

import subprocess
import sys


def test_import_cache_leaves_torch_out() -> None:
    code = (
        "import sys, agentd.cache\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'numpy'})\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
