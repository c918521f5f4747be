"""Paged attention for decode: one query token per sequence over its cached context.

Each sequence ``i`` attends to tokens ``0 .. seq_lens[i] - 1`` stored in the blocks listed by
``block_tables[i]`` (entries past the sequence's last block are padding and never read).
GQA: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentd.kernels import kv_quant
from agentd.kernels._common import (
    block_run,
    cdiv,
    check_attention_inputs,
    check_index,
    dot_dtype,
    heads_first,
    jit,
    matmul_dtype,
    next_pow2,
    step_plan,
    take_blocks,
    tl,
)


def gather_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first ``num_tokens`` keys/values out of the pool: ``[n, Hkv, D]``."""
    num_blocks = cdiv(num_tokens, kv_cache.shape[2])
    blocks = block_table[:num_blocks].long()
    return (take_blocks(kv_cache, 0, blocks)[:num_tokens],
            take_blocks(kv_cache, 1, blocks)[:num_tokens])


def reference_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Torch reference (and CPU path).

    Args:
        query: ``[num_seqs, num_heads, head_dim]``.
        kv_cache: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32.
        seq_lens: ``[num_seqs]`` context length of each sequence, including its new token.
        scale: softmax scale, usually ``head_dim ** -0.5``.
    Returns:
        ``[num_seqs, num_heads, head_dim]`` in the query's dtype.
    """
    num_seqs = query.shape[0]
    if num_seqs == 0:
        return torch.empty_like(query)
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    max_len = int(seq_lens.max())
    num_blocks = cdiv(max_len, block_size)
    table = block_tables[:, :num_blocks].long()
    blocks = kv_cache[table]  # [S, nb, 2, B, Hkv, D]
    keys = kv_quant.widen(blocks[:, :, 0], query.dtype).reshape(
        num_seqs, num_blocks * block_size, num_kv_heads, -1)
    values = kv_quant.widen(blocks[:, :, 1], query.dtype).reshape(
        num_seqs, num_blocks * block_size, num_kv_heads, -1)
    positions = torch.arange(num_blocks * block_size, device=query.device)
    mask = positions[None, :] < seq_lens[:, None].to(query.device)  # [S, L]
    out = torch.nn.functional.scaled_dot_product_attention(
        query.unsqueeze(2),  # [S, H, 1, D]
        keys.transpose(1, 2).to(query.dtype),  # [S, Hkv, L, D]
        values.transpose(1, 2).to(query.dtype),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)


def torch_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The CPU path: :func:`reference_decode_attention`'s contract, shared prefixes read once.

    Agents send the same long prefix, so decode rows often share their leading blocks (a pin, a
    cached system prompt). Rows are grouped by their first block; each group's common leading
    blocks are gathered once and scored against all of the group's queries in one batched matmul,
    and only each row's own tail is gathered per row. One softmax spans both parts.
    """
    if query.shape[0] == 0:
        return torch.empty_like(query)
    plan = step_plan("decode", (block_tables, seq_lens),
                     lambda: _plan_decode(block_tables, seq_lens, kv_cache.shape[2],
                                          matmul_dtype(query.dtype, query.device)))
    if len(plan) == 1 and plan[0].rows is None:
        return _grouped_decode(query, kv_cache, plan[0], scale)
    out = torch.empty_like(query)
    for group in plan:
        result = _grouped_decode(query.index_select(0, group.rows), kv_cache, group, scale)
        out.index_copy_(0, group.rows, result)
    return out


def shared_blocks(tables: list[list[int]], lens: list[int], block_size: int) -> int:
    """Leading blocks common to every table and full in every row."""
    limit = min(lens) // block_size
    first = tables[0]
    num = 0
    while num < limit and all(t[num] == first[num] for t in tables):
        num += 1
    return num


@dataclass
class _DecodeGroup:
    """Decode rows that share leading blocks, and where their keys lie."""

    rows: torch.Tensor | None  # the group's rows of the batch; None: all of them, in order
    shared: slice | torch.Tensor  # the common leading blocks
    shared_len: int
    tail_blocks: torch.Tensor  # [R * num_tail_blocks]: each row's own blocks, padded with 0
    tail_bias: torch.Tensor  # [R, 1, 1, tail_len]: 0 for a row's own tail tokens, -inf past them


def _plan_decode(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                 dtype: torch.dtype = torch.float32) -> list[_DecodeGroup]:
    tables = block_tables.tolist()
    lens = seq_lens.tolist()
    device = block_tables.device
    by_first: dict[int, list[int]] = {}
    for i, table in enumerate(tables):
        by_first.setdefault(table[0], []).append(i)
    groups = []
    for rows in by_first.values():
        group_tables = [tables[i] for i in rows]
        num_shared = shared_blocks(group_tables, [lens[i] for i in rows], block_size)
        shared_len = num_shared * block_size
        tail_lens = [lens[i] - shared_len for i in rows]
        num_tail = cdiv(max(tail_lens), block_size)
        tail_ids = [t[num_shared:num_shared + num_tail] for t in group_tables]
        tail_ids = [ids + [0] * (num_tail - len(ids)) for ids in tail_ids]
        valid = (torch.arange(num_tail * block_size, device=device)[None, :]
                 < torch.tensor(tail_lens, device=device)[:, None])
        bias = torch.zeros(valid.shape, dtype=dtype, device=device).masked_fill_(~valid,
                                                                                  float("-inf"))
        groups.append(_DecodeGroup(
            rows=None if len(by_first) == 1 else torch.tensor(rows, device=device),
            shared=block_run(group_tables[0][:num_shared], device),
            shared_len=shared_len,
            tail_blocks=torch.tensor([b for ids in tail_ids for b in ids], dtype=torch.long,
                                     device=device),
            tail_bias=bias[:, None, None, :],
        ))
    return groups


def _grouped_decode(query: torch.Tensor, kv_cache: torch.Tensor, group: _DecodeGroup,
                    scale: float) -> torch.Tensor:
    """The group's common leading blocks are read once and scored against all its queries in
    one batched matmul; each row's own tail is gathered per row. One softmax spans both.

    Products run in ``matmul_dtype`` (bfloat16 stays bfloat16 where the CPU has bfloat16
    GEMMs: widening the shared prefix to fp32 every layer cost more than the products).
    """
    num_rows, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    group_size = num_heads // num_kv_heads
    work = group.tail_bias.dtype  # the plan's matmul dtype
    q = query.to(work).view(num_rows, num_kv_heads, group_size, head_dim)
    # The shared prefix as one batched product per KV head (an einsum here copied the prefix's
    # keys and values every layer: ~6 of a 29 ms decode step).
    q_heads = q.permute(1, 0, 2, 3).reshape(num_kv_heads, num_rows * group_size, head_dim)
    k_shared = heads_first(take_blocks(kv_cache, 0, group.shared).to(work))  # [Hkv, L, D]
    scores_shared = torch.bmm(q_heads, k_shared.transpose(1, 2)).view(
        num_kv_heads, num_rows, group_size, -1).permute(1, 0, 2, 3)  # [R, Hkv, g, L]
    k_tail = take_blocks(kv_cache, 0, group.tail_blocks).to(work).view(
        num_rows, -1, num_kv_heads, head_dim)
    scores_tail = torch.einsum("rkgd,rlkd->rkgl", q, k_tail) + group.tail_bias
    probs = torch.softmax(torch.cat([scores_shared, scores_tail], dim=-1) * scale, dim=-1)
    v_tail = take_blocks(kv_cache, 1, group.tail_blocks).to(work).view(
        num_rows, -1, num_kv_heads, head_dim)
    out = torch.einsum("rkgl,rlkd->rkgd", probs[..., group.shared_len:], v_tail)
    if group.shared_len:
        v_shared = heads_first(take_blocks(kv_cache, 1, group.shared).to(work))
        p_heads = probs[..., :group.shared_len].permute(1, 0, 2, 3).reshape(
            num_kv_heads, num_rows * group_size, group.shared_len)
        out = out + torch.bmm(p_heads, v_shared).view(
            num_kv_heads, num_rows, group_size, head_dim).permute(1, 0, 2, 3)
    return out.reshape(num_rows, num_heads, head_dim).to(query.dtype)


# ---------------------------------------------------------------------------------------------
# Triton: split-K paged decode. One program per (sequence, KV head, partition of
# PARTITION_SIZE tokens); it handles every query head of its GQA group at once so each K/V tile
# is read from the pool once. With more than one partition, each program writes its partial
# (max, sum, unnormalised acc) to a workspace and ``_decode_reduce_kernel`` merges them.
# ---------------------------------------------------------------------------------------------

PARTITION_SIZE = 512  # tokens per split-K program: enough work to hide latency, yet 8 splits at 4K
_BLOCK_N = 64  # KV tokens per inner-loop tile (any pool block size: tokens are gathered per row)
_LOG2E = 1.4426950408889634


@jit
def _decode_kernel(
    out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr,
    q_ptr, kv_ptr, block_tables_ptr, seq_lens_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    stride_qs, stride_qh,
    stride_kvb, stride_kvkv, stride_kvt, stride_kvh,
    stride_bts, stride_os, stride_oh,
    num_partitions,
    GROUP_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PARTITION: tl.constexpr,
    SPLIT: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    part_start = part * PARTITION
    if part_start >= seq_len:
        return  # this sequence is shorter than the grid's longest; the reducer skips it too
    part_end = tl.minimum(part_start + PARTITION, seq_len)

    groups = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP_SIZE + groups
    group_mask = groups < GROUP_SIZE
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :],
        mask=group_mask[:, None] & dim_mask[None, :], other=0.0,
    ).to(DOT_DTYPE)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bts
    kv_head_off = kv_head * stride_kvh + dims
    for start in range(part_start, part_end, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        token_mask = tokens < part_end
        # Table entries past the sequence's last block are padding: masked, never dereferenced.
        block_ids = tl.load(table_row + tokens // BLOCK_SIZE, mask=token_mask, other=0)
        row_off = block_ids.to(tl.int64) * stride_kvb + (tokens % BLOCK_SIZE) * stride_kvt
        kv_off = row_off[:, None] + kv_head_off[None, :]
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        k = tl.load(kv_ptr + kv_off, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        v = tl.load(kv_ptr + stride_kvkv + kv_off, mask=kv_mask, other=0.0).to(DOT_DTYPE)

        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision="ieee")
        m_i = m_new

    out_mask = group_mask[:, None] & dim_mask[None, :]
    if SPLIT:
        part_off = (seq * tl.num_programs(1) * GROUP_SIZE + heads) * num_partitions + part
        tl.store(part_max_ptr + part_off, m_i, mask=group_mask)
        tl.store(part_sum_ptr + part_off, l_i, mask=group_mask)
        tl.store(part_acc_ptr + part_off[:, None] * HEAD_DIM + dims[None, :], acc, mask=out_mask)
    else:
        out = acc / l_i[:, None]
        out_off = seq * stride_os + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@jit
def _decode_reduce_kernel(
    out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, seq_lens_ptr,
    stride_os, stride_oh, num_partitions,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    PARTITION: tl.constexpr, PARTITIONS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Partitions at or past this sequence's length were never written: mask them out.
    num_used = tl.cdiv(seq_len, PARTITION)
    parts = tl.arange(0, PARTITIONS_PAD)
    part_mask = parts < num_used
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    base = (seq * tl.num_programs(1) + head) * num_partitions
    part_max = tl.load(part_max_ptr + base + parts, mask=part_mask, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + base + parts, mask=part_mask, other=0.0)
    part_acc = tl.load(
        part_acc_ptr + (base + parts)[:, None] * HEAD_DIM + dims[None, :],
        mask=part_mask[:, None] & dim_mask[None, :], other=0.0,
    )
    max_all = tl.max(part_max, axis=0)
    weight = tl.where(part_mask, tl.exp2(part_max - max_all), 0.0)
    total = tl.sum(part_sum * weight, axis=0)
    out = tl.sum(part_acc * weight[:, None], axis=0) / total
    out_off = seq * stride_os + head * stride_oh + dims
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def _launch_decode(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    partition_size: int = PARTITION_SIZE,
) -> None:
    """Grid ``(num_seqs, num_kv_heads, num_partitions)``; the partition count is bounded by the
    block table's width, so no device->host sync is needed (surplus programs return at once)."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group_size = num_heads // num_kv_heads
    max_context = block_tables.shape[1] * block_size
    num_partitions = max(cdiv(max_context, partition_size), 1)
    split = num_partitions > 1
    head_dim_pad = max(next_pow2(head_dim), 16)
    workspace = _decode_workspace(num_seqs, num_heads, num_partitions, head_dim, split, out.device)
    _decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        out, *workspace,
        query, kv_cache, block_tables, seq_lens,
        scale * _LOG2E,
        query.stride(0), query.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1),
        num_partitions,
        GROUP_SIZE=group_size, GROUP_PAD=max(next_pow2(group_size), 16),  # tl.dot needs M >= 16
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, BLOCK_N=min(_BLOCK_N, partition_size), PARTITION=partition_size,
        SPLIT=split, DOT_DTYPE=dot_dtype(query.dtype),
        num_warps=4, num_stages=2 if query.dtype == torch.float32 else 3,
    )
    if split:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, *workspace, seq_lens,
            out.stride(0), out.stride(1), num_partitions,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            PARTITION=partition_size, PARTITIONS_PAD=next_pow2(num_partitions),
            num_warps=4,
        )


def _decode_workspace(
    num_seqs: int, num_heads: int, num_partitions: int, head_dim: int, split: bool,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-partition max, sum and unnormalised output, fp32; 1-element dummies when unsplit."""
    shape = (num_seqs, num_heads, num_partitions) if split else (1,)
    part_max = torch.empty(shape, dtype=torch.float32, device=device)
    part_sum = torch.empty(shape, dtype=torch.float32, device=device)
    part_acc = torch.empty((*shape, head_dim) if split else (1,), dtype=torch.float32,
                           device=device)
    return part_max, part_sum, part_acc


def triton_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Triton paged decode with the same contract as :func:`reference_decode_attention`.

    Every ``seq_lens[i]`` must be ``>= 1`` and ``<= block_tables.shape[1] * block_size``.
    """
    check_attention_inputs("decode", query, kv_cache, block_tables)
    check_index("decode", "seq_lens", seq_lens, 1, query.device)
    num_seqs = query.shape[0]
    if seq_lens.shape[0] != num_seqs or block_tables.shape[0] != num_seqs:
        raise ValueError(f"decode: {num_seqs} queries but seq_lens {list(seq_lens.shape)} and "
                         f"block_tables {list(block_tables.shape)}")
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs > 0:
        _launch_decode(out, query, kv_cache, block_tables, seq_lens, scale)
    return out
