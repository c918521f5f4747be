"""The Triton attention backend's kernels: importing this requires Triton (an ImportError
otherwise, which :func:`agentd.kernels.get_attention_backend` turns into an install hint, and
wraps these in its ``AttentionBackend``)."""

from __future__ import annotations

import triton  # noqa: F401  (fail here, loudly, when the optional extra is missing)

from agentd.kernels.decode_attention import triton_decode_attention
from agentd.kernels.kv_write import triton_write_kv
from agentd.kernels.prefill_attention import triton_prefill_attention

TRITON_KERNELS = (triton_write_kv, triton_decode_attention, triton_prefill_attention)
