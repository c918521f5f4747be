"""A CPU decode step's small per-layer operations fused into one C++ call each (``ops.h``).

Run as torch ops, rotary + KV write, the norms with their residual adds, SiLU x up and paged
decode attention cost ~40 dispatches a layer: on a 1.7B model about a third of a decode step,
for few bytes. Each function here is one call into ``agentd.kernels.cpu``'s extension on the ISA
the products use, with a torch reference beside it that tests compare against and that runs
where the extension is unavailable (``AGENTD_CPU_ISA=torch`` or no compiler).

Invariant: each function's results equal its reference up to fp32 rounding (summation order,
and ~2 ulp in exp); the pool's dtype is written by rounding to nearest even, as ``Tensor.to``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from agentd.kernels import cpu as _cpu
from agentd.kernels.decode_attention import torch_decode_attention
from agentd.kernels.kv_write import reference_write_kv

BF16_ENV = "AGENTD_PREFILL_BF16"  # "0": prefill attention's products in fp32 in every pool


def _native_isa() -> int | None:
    """The extension's ISA index, or None where products run on torch."""
    isa = _cpu.active_isa()
    return None if isa == "torch" else _cpu.ISAS.index(isa)


def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`agentd.kernels.decode_attention.reference_decode_attention`'s contract in C++:
    rows grouped by their shared leading blocks, which are read once per group."""
    isa = _native_isa()
    if isa is None or query.dtype != torch.float32:
        return torch_decode_attention(query, kv_cache, block_tables, seq_lens, scale)
    return _cpu._native().module.decode_attention(query, kv_cache, block_tables, seq_lens,
                                                  scale, isa)


def prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                      bf16: bool | None = None) -> torch.Tensor:
    """:func:`agentd.kernels.prefill_attention.reference_prefill_attention`'s contract in C++
    (``ops_prefill.h``): each chunk's rows against their context read in the pool's dtype in
    place, tile by tile; softmax and sums in fp32. ``bf16``: the products in bfloat16 where the
    CPU has AVX512-BF16 (2-2.4x faster; outputs off by up to ~1% of their scale, where fp32
    products are off by ~1e-6; elsewhere the fp32 kernel runs). Default: on for a float16,
    bfloat16 or q8_0 pool, the low-precision modes, whose outputs already differ from the exact
    mode's (a GGUF's prompt products run as bfloat16 GEMMs on such a CPU); never for the exact
    mode's float32 pool, whose prompt rows match decode rows to rounding.
    ``AGENTD_PREFILL_BF16=0`` keeps every pool's in fp32."""
    isa = _native_isa()
    if isa is None or query.dtype != torch.float32:
        from agentd.kernels.prefill_attention import torch_prefill_attention

        return torch_prefill_attention(query, kv_cache, block_tables, query_start_loc,
                                       seq_lens, scale)
    if bf16 is None:
        bf16 = _bf16_by_default(kv_cache.dtype)
    return _cpu._native().module.prefill_attention(query, kv_cache, block_tables,
                                                   query_start_loc, seq_lens, scale, bf16, isa)


def _bf16_by_default(kv_dtype: torch.dtype) -> bool:
    """Whether :func:`prefill_attention` asks for bfloat16 products in a pool of ``kv_dtype``."""
    return kv_dtype != torch.float32 and os.environ.get(BF16_ENV) != "0"


def prefill_products(kv_dtype: torch.dtype, head_dim: int) -> str:
    """What :func:`prefill_attention`'s default multiplies in, for a pool of ``kv_dtype`` here:
    ``bfloat16`` or ``fp32`` (``agentd status`` says it)."""
    isa = _native_isa()
    if isa is None:
        return "fp32 (torch)"
    bf16 = (_bf16_by_default(kv_dtype) and _cpu.ISAS[isa] == "avx512_vnni"
            and head_dim % 16 == 0 and _cpu._native().module.has_bf16_attention())
    return "bfloat16 (AVX512-BF16)" if bf16 else "fp32"


def reference_rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
                            kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Rotary on ``q`` ``[T, H, D]`` and ``k`` ``[T, Hkv, D]`` in place (``cos``/``sin``
    ``[T, D/2]``; pairs side by side if ``interleaved``, else halves), then ``k`` and ``v`` into
    their slots of the pool."""
    c, s = cos[:, None, :], sin[:, None, :]
    for x in (q, k):
        if interleaved:
            a, b = x[..., 0::2].clone(), x[..., 1::2].clone()
            x[..., 0::2], x[..., 1::2] = a * c - b * s, b * c + a * s
        else:
            a, b = x.chunk(2, dim=-1)
            a, b = a.clone(), b.clone()
            half = x.shape[-1] // 2
            x[..., :half], x[..., half:] = a * c - b * s, b * c + a * s
    reference_write_kv(k, v, kv_cache, slot_mapping)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, interleaved: bool, kv_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """:func:`reference_rope_write_kv` in one C++ call (views of one fused projection welcome)."""
    isa = _native_isa()
    if isa is None or q.dtype != torch.float32:
        reference_rope_write_kv(q, k, v, cos, sin, interleaved, kv_cache, slot_mapping)
        return
    _cpu._native().module.rope_write_kv(q, k, v, cos, sin, interleaved, kv_cache, slot_mapping,
                                        isa)


def reference_add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> torch.Tensor:
    """``residual += x`` (in place, unless x is None), then the RMS norm of ``residual``."""
    if x is not None:
        residual.add_(x)
    return F.rms_norm(residual, (residual.shape[-1],), weight, eps)


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """:func:`reference_add_rms_norm` in one C++ call."""
    isa = _native_isa()
    if isa is None or residual.dtype != torch.float32:
        return reference_add_rms_norm(x, residual, weight, eps)
    return _cpu._native().module.add_rms_norm(x, residual, weight, eps, isa)


def reference_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``[n, 2I]`` rows (gate first), in one C++ call."""
    isa = _native_isa()
    if isa is None or gate_up.dtype != torch.float32:
        return reference_silu_mul(gate_up)
    return _cpu._native().module.silu_mul(gate_up, isa)
