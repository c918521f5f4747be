"""Attention and KV-write kernels over the paged KV pool.

Two backends behind one interface (:class:`AttentionBackend`): ``torch`` (the references; the CPU
path) and ``triton`` (CUDA, or CPU under ``TRITON_INTERPRET=1`` for tests).

The pool may store a narrower dtype than the queries (``--kv-cache-dtype float16`` under fp32
activations): every path casts what it reads to its product's dtype, one block run or chunk at a
time, never the whole pool, and the KV write rounds to the pool's dtype.
"""

from __future__ import annotations

from agentd.kernels._common import attention_step, matmul_dtype
from agentd.kernels.backend import AttentionBackend, get_attention_backend

__all__ = ["AttentionBackend", "attention_step", "get_attention_backend", "matmul_dtype"]
