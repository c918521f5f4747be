"""Model runner: the only place that builds tensors. It executes one scheduled step.

Invariant: one forward per step over the flattened batch (decode rows first, then prefill chunks);
each token's K/V lands in the slot its block table names; logits are computed only for the rows
that sample: a request's last token and its draft tokens, if any.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from agentd.cache import KVCopy
from agentd.engine.scheduler import ScheduledRequest
from agentd.kernels import AttentionBackend, attention_step, kv_quant
from agentd.model.llama import AttentionMetadata, LlamaModel
from agentd.model.onednn import release_free_memory

TRIM_AFTER_TOKENS = 512  # such a step takes >= 0.3 s on CPU; trimming the heap takes ~4 ms


@dataclass
class StepResult:
    request_ids: list[str]  # the sampling requests, in the order of their rows of ``logits``
    # [num_sampling_rows, vocab_size] float32: per sampling request, 1 + its num_draft_tokens
    # rows (the logits after its last token, then after each draft)
    logits: torch.Tensor
    num_tokens: int  # tokens that went through the model this step


_NUMPY_TWINS = {torch.float32: np.float32, torch.float16: np.float16,
                torch.bfloat16: np.uint16,  # numpy has no bfloat16: its bits, viewed
                torch.int8: np.int8}  # q8_0's bytes


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros whose pages cost RSS only once written. On CPU numpy's zeros is ``calloc``, which
    maps large sizes to fresh zero pages, faulted in at first write; ``torch.zeros`` writes every
    byte, so a pool sized for the whole context was resident at start however little was used.
    Zeros, not ``empty``: kernels read a partial block's unused slots (masked: 0 x NaN is NaN)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(shape, dtype=_NUMPY_TWINS[dtype])).view(dtype)


@torch.inference_mode()
def copy_kv(kv_caches: list[torch.Tensor], copies: list[KVCopy]) -> None:
    """Run ``copies`` on the pool's layers, in order."""
    for copy in copies:
        for kv in kv_caches:
            kv[copy.dst, :, :copy.num_slots] = kv[copy.src, :, :copy.num_slots]


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int,
                 device: torch.device, kv_dtype: torch.dtype, backend: AttentionBackend) -> None:
        """``kv_dtype``: what the pool stores; attention upcasts what it reads to its own."""
        self.model = model
        self.block_size = block_size
        self.device = device
        self.backend = backend
        dims = model.dims
        # Logically [num_blocks, 2, B, Hkv, D]; stored as all keys, then all values, so that a
        # run of blocks' keys (or values) is one contiguous slice the CPU attention reads in place.
        shape = (2, num_blocks, block_size, dims.num_kv_heads,
                 kv_quant.row_width(dims.head_dim, kv_dtype))
        self.kv_caches = [lazy_zeros(shape, kv_dtype, device).transpose(0, 1)
                          for _ in range(dims.num_layers)]

    @staticmethod
    def kv_bytes_per_block(model: LlamaModel, block_size: int, dtype: torch.dtype) -> int:
        dims = model.dims
        row = kv_quant.row_width(dims.head_dim, dtype) * torch.empty((), dtype=dtype).element_size()
        return dims.num_layers * 2 * block_size * dims.num_kv_heads * row

    def copy_kv(self, copies: list[KVCopy]) -> None:
        """Copy the first slots of blocks into others, in every layer, in order (before a
        forward: a step's ``kv_copies``)."""
        copy_kv(self.kv_caches, copies)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest]) -> StepResult:
        decodes = [s for s in scheduled if len(s.token_ids) == 1]
        prefills = [s for s in scheduled if len(s.token_ids) > 1]
        batch = decodes + prefills
        input_ids, positions, meta, sample_rows = self._prepare(batch, len(decodes))
        with attention_step():
            hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        request_ids = [s.request_id for s in batch if s.sample]
        if self.device.type == "cpu" and input_ids.shape[0] >= TRIM_AFTER_TOKENS:
            del hidden
            release_free_memory()  # a long step's activations, or RSS keeps their high mark
        return StepResult(request_ids, logits, int(input_ids.shape[0]))

    def _prepare(self, batch: list[ScheduledRequest], num_decodes: int
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        token_ids: list[int] = []
        seq_index: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        for i, s in enumerate(batch):
            num = len(s.token_ids)
            token_ids.extend(s.token_ids)
            positions.extend(range(s.start_position, s.start_position + num))
            seq_index.extend([i] * num)
            if s.sample:
                sample_rows.extend(range(len(token_ids) - 1 - s.num_draft_tokens,
                                         len(token_ids)))
        max_blocks = max(len(s.block_table) for s in batch)
        # Rows are padded with block 0; kernels never read past a sequence's length.
        tables = torch.tensor([s.block_table + [0] * (max_blocks - len(s.block_table))
                               for s in batch], dtype=torch.int32)
        pos = torch.tensor(positions, dtype=torch.long)
        seq = torch.tensor(seq_index, dtype=torch.long)
        slots = tables[seq, pos // self.block_size].long() * self.block_size + pos % self.block_size
        seq_lens = torch.tensor([s.start_position + len(s.token_ids) for s in batch],
                                dtype=torch.int32)
        query_lens = [len(s.token_ids) for s in batch[num_decodes:]]
        query_start = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        if query_lens:
            query_start[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev),
            num_decode_tokens=num_decodes,
            decode_block_tables=tables[:num_decodes].to(dev),
            decode_seq_lens=seq_lens[:num_decodes].to(dev),
            prefill_block_tables=tables[num_decodes:].to(dev),
            prefill_query_start_loc=query_start.to(dev),
            prefill_seq_lens=seq_lens[num_decodes:].to(dev),
        )
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=dev)
        return input_ids, pos.to(dev), meta, sample_rows
