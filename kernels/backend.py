"""Backend selection: the runner calls ``write_kv``, ``decode`` and ``prefill`` on one object.

``torch`` holds the references, ``cpu`` runs decode attention in agentd's C++ extension
(``agentd.kernels.cpu.fused``: the paged pool read in place, a shared prefix once per group of
rows; torch's reference where the extension is not built or the activations are not fp32) and
prefill on torch, ``triton`` is CUDA's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from agentd.kernels.decode_attention import torch_decode_attention
from agentd.kernels.kv_write import reference_write_kv
from agentd.kernels.prefill_attention import torch_prefill_attention


class _WriteKV(Protocol):
    def __call__(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None: ...


class _Decode(Protocol):
    def __call__(self, query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float) -> torch.Tensor: ...


class _Prefill(Protocol):
    def __call__(self, query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float) -> torch.Tensor: ...


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv: _WriteKV
    decode: _Decode
    prefill: _Prefill


TORCH_BACKEND = AttentionBackend(
    "torch", reference_write_kv, torch_decode_attention, torch_prefill_attention
)


def _cpu_backend() -> AttentionBackend:
    from agentd.kernels.cpu import fused

    return AttentionBackend("cpu", reference_write_kv, fused.decode_attention,
                            torch_prefill_attention)


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """Pick ``torch``, ``cpu`` or ``triton``; ``auto`` is Triton on CUDA, ``cpu`` on the CPU."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu" if device.type == "cpu" else "torch"
    if name == "torch":
        return TORCH_BACKEND
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError("the cpu attention backend runs on the CPU only")
        return _cpu_backend()
    if name == "triton":
        try:
            from agentd.kernels.triton_backend import TRITON_KERNELS
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeError(
                f"the triton attention backend is unavailable ({exc}); install it with "
                "`pip install triton` or use --attention-backend torch"
            ) from exc
        return AttentionBackend("triton", *TRITON_KERNELS)
    raise ValueError(f"unknown attention backend {name!r}: use auto, torch, cpu or triton")
