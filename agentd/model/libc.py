"""The process's C library through ctypes, loaded once: glibc's malloc tuning (agentd.model.onednn)
and mlock of a GGUF's mapping (agentd.model.gguf_index) use it.

Invariant: loaded with ``use_errno=True``, so ``ctypes.get_errno()`` after a failed call is that
call's errno.
"""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def libc() -> ctypes.CDLL:
    """The C library (raises OSError where there is none to load)."""
    return ctypes.CDLL("libc.so.6", use_errno=True)
