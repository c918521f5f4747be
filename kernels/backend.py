"""Backend selection: the runner calls ``write_kv``, ``decode`` and ``prefill`` on one object.

``torch`` holds the references, ``cpu`` runs attention in agentd's C++ extension
(``agentd.kernels.cpu.fused``: the paged pool read in place; decode with a shared prefix once per
group of rows, torch's where the extension is not built, the activations are not fp32, or rows on
one prefix in an fp32 pool, see :func:`cpu_decode`; prefill in flash-style tiles, short chunks in
an fp16/bf16 pool as decode rows, :func:`cpu_prefill`), ``triton`` is CUDA's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from agentd.kernels._common import step_plan
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


def rows_share_a_block(block_tables: torch.Tensor) -> bool:
    """Whether two rows of the step start with the same block (agents on one cached prefix)."""
    return step_plan("decode-shared", (block_tables,), lambda: block_tables.shape[0] > 1 and (
        torch.unique(block_tables[:, 0]).numel() < block_tables.shape[0]))


def cpu_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """agentd's C++ decode attention, but for rows on one prefix in an fp32 pool: there torch's
    grouped products (the shared keys as one GEMM for all the rows' heads) are faster. SmolLM2's
    exact mode, one thread, tok/s kernel vs torch: one row behind 5,000 cached tokens 15.6 vs
    13.6, four rows of their own behind 2,000 each 54.0 vs 44.7, four rows behind one 5,000-token
    prefix 32.6 vs 36.7 (an fp16 pool, as GGUFs are served, widens the prefix in registers)."""
    from agentd.kernels.cpu import fused

    if kv_cache.dtype == torch.float32 and rows_share_a_block(block_tables):
        return torch_decode_attention(query, kv_cache, block_tables, seq_lens, scale)
    return fused.decode_attention(query, kv_cache, block_tables, seq_lens, scale)


SHORT_CHUNK_ROWS = 9  # up to here a chunk's rows run as decode rows (speculative drafts)


def chunks_as_decode_rows(block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                          seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Prefill chunks of at most ``SHORT_CHUNK_ROWS`` rows as decode rows: row ``j`` of a chunk
    of ``n`` rows in a sequence of ``L`` tokens is a decode row over the sequence's blocks with
    ``L - n + 1 + j`` tokens (its own key is the last it sees). None when a chunk is longer."""
    counts = query_start_loc[1:] - query_start_loc[:-1]
    if counts.numel() == 0 or int(counts.max()) > SHORT_CHUNK_ROWS:
        return None
    seq = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    within = torch.arange(seq.numel()) - query_start_loc[:-1].long()[seq]
    lens = seq_lens[seq] - counts[seq] + 1 + within
    return block_tables[seq].contiguous(), lens.to(torch.int32).contiguous()


def cpu_prefill(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                scale: float) -> torch.Tensor:
    """agentd's C++ prefill attention (``ops_prefill.h``: the context read in place in the
    pool's dtype, flash-style tiles, fp32 softmax and sums; the products in bfloat16 for a
    non-fp32 pool on CPUs with AVX512-BF16, see ``fused.prefill_attention``), but chunks of at
    most ``SHORT_CHUNK_ROWS`` rows in a float16/bfloat16 pool (a speculative step's drafts) as
    decode rows: they read a row group's blocks once with no padding of the queries, and a
    draft row's logits come out of the same kernel as the row a plain decode step runs. Torch's
    path where the queries are not fp32.

    1.7B's shape (32 heads of 64), a float16 pool, 2 Zen 5 cores, one layer: 300 rows behind
    16,384 cached tokens 72 ms with bf16 products (fp32 ones, ``AGENTD_PREFILL_BF16=0``: 162
    ms) against torch's 408 ms; 512 rows from nothing 2.2 ms against 13.3 ms; one row behind
    16k, 7.6 ms as a decode row against 30 ms here (the tiles' 64 query lanes mostly empty)."""
    if query.dtype != torch.float32:
        return torch_prefill_attention(query, kv_cache, block_tables, query_start_loc,
                                       seq_lens, scale)
    from agentd.kernels.cpu import fused

    if kv_cache.dtype != torch.float32:
        rows = step_plan("prefill-as-decode", (block_tables, query_start_loc, seq_lens),
                         lambda: chunks_as_decode_rows(block_tables, query_start_loc, seq_lens))
        if rows is not None:
            return fused.decode_attention(query, kv_cache, rows[0], rows[1], scale)
    return fused.prefill_attention(query, kv_cache, block_tables, query_start_loc, seq_lens,
                                   scale)


CPU_BACKEND = AttentionBackend("cpu", reference_write_kv, cpu_decode, cpu_prefill)


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """Pick ``torch``, ``cpu`` or ``triton``; ``auto`` is Triton on CUDA, ``cpu`` on the CPU."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu" if device.type == "cpu" else "torch"
    if name == "torch":
        return TORCH_BACKEND
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError("the cpu attention backend runs on the CPU only")
        return CPU_BACKEND
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
