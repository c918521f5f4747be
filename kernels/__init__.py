"""Attention and KV-write kernels over the paged KV pool.

Two backends behind one interface (:class:`AttentionBackend`): ``torch`` (the references; the CPU
path) and ``triton`` (CUDA, or CPU under ``TRITON_INTERPRET=1`` for tests).
"""

from __future__ import annotations

from agentd.kernels._common import attention_step, matmul_dtype
from agentd.kernels.backend import AttentionBackend, get_attention_backend

__all__ = ["AttentionBackend", "attention_step", "get_attention_backend", "matmul_dtype"]
