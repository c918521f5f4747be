"""Paged attention for prefill chunks over a cached prefix (variable length, causal).

The batch is flattened: sequence ``i`` owns query rows ``query_start_loc[i] ..
query_start_loc[i+1] - 1``. Its new keys/values are already in the pool, so its context is
``seq_lens[i]`` tokens and query row ``j`` of a chunk of ``q`` tokens sits at position
``seq_lens[i] - q + j``; it attends to every key at a position ``<=`` its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentd.kernels._common import (
    block_run,
    cdiv,
    check_attention_inputs,
    check_index,
    dot_dtype,
    jit,
    matmul_dtype,
    next_pow2,
    step_plan,
    take_blocks,
    tl,
)
from agentd.kernels.decode_attention import gather_kv, shared_blocks
from agentd.kernels.prefill_cpu import (  # noqa: F401  (MATMUL_TILE_ROWS: importable from here)
    MATMUL_TILE_ROWS,
    Chunks,
    each_chunk,
    matmul_attention,
    sdpa_attention,
)


def reference_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Torch reference (and CPU path).

    Args:
        query: ``[num_tokens, num_heads, head_dim]``, all sequences' chunks back to back.
        kv_cache: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32.
        query_start_loc: ``[num_seqs + 1]`` int32 offsets into ``query``.
        seq_lens: ``[num_seqs]`` total context per sequence (cached prefix + this chunk).
        scale: softmax scale.
    Returns:
        ``[num_tokens, num_heads, head_dim]`` in the query's dtype.
    """
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        if end > start:
            out[start:end] = _attend_one(query[start:end], kv_cache, block_tables[i], seq_len,
                                         scale)
    return out


def _attend_one(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                seq_len: int, scale: float) -> torch.Tensor:
    """One sequence's chunk ``[q, H, D]`` (its last ``q`` positions) over its whole context."""
    num_queries = len(query)
    keys, values = gather_kv(kv_cache, block_table.long(), seq_len)
    mask = None
    if num_queries != seq_len:  # a cached prefix: causal with an offset
        q_pos = torch.arange(seq_len - num_queries, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        mask = (k_pos[None, :] <= q_pos[:, None])[None, None]  # [1, 1, q, L]
    attn = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0),  # [1, H, q, D]
        keys.transpose(0, 1).unsqueeze(0).to(query.dtype),  # [1, Hkv, L, D]
        values.transpose(0, 1).unsqueeze(0).to(query.dtype),
        attn_mask=mask,
        is_causal=mask is None,  # no prefix: plain causal, which skips masked tiles
        scale=scale,
        enable_gqa=True,
    )
    return attn[0].transpose(0, 1)


def torch_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The CPU path: :func:`reference_prefill_attention`'s contract, shared prefixes read once.

    Agents that send the same system prompt arrive together and are prefilled in one step, each
    over the same cached blocks. Chunks whose sequences share leading full blocks (before any of
    their queries) form a group: the shared blocks are gathered once and attended to by every
    row of the group, each chunk attends causally to its own tail (the rest of its context), and
    the parts are merged by their log-sum-exps. No mask is built: one mask over every tail made
    every row attend to every tail (8 turns behind a shared prompt, one of them 800 tokens into
    its own: a 5.8 s step). A lone chunk whose blocks are consecutive in the pool reads them in
    place.
    """
    plan = step_plan("prefill", (block_tables, query_start_loc, seq_lens),
                     lambda: _plan_prefill(block_tables, query_start_loc, seq_lens,
                                           kv_cache.shape[2]))
    out = torch.empty_like(query)
    low_precision = matmul_dtype(query.dtype, query.device) != torch.float32
    for call in plan:
        keys = take_blocks(kv_cache, 0, call.blocks)[:call.num_keys]
        values = take_blocks(kv_cache, 1, call.blocks)[:call.num_keys]
        shared = None
        if call.shared is not None:
            shared = (take_blocks(kv_cache, 0, call.shared), take_blocks(kv_cache, 1, call.shared))
        if len(call.rows) == 1:
            queries = query[call.rows[0][0]:call.rows[0][1]]
        else:
            queries = torch.cat([query[start:end] for start, end in call.rows])
        if low_precision:  # GEMMs in the query's dtype: a pool of another dtype is cast per call
            keys, values = keys.to(query.dtype), values.to(query.dtype)
            if shared is not None:
                shared = (shared[0].to(query.dtype), shared[1].to(query.dtype))
            attn = torch.cat([matmul_attention(rows, k, v, scale, cached, shared) for rows, k, v,
                              cached in each_chunk(queries, keys, values, call.chunks)])
        else:
            attn = sdpa_attention(queries, keys, values, call.chunks, scale, shared)
        row = 0
        for start, end in call.rows:
            out[start:end] = attn[row:row + end - start]
            row += end - start
    return out


@dataclass
class _PrefillCall:
    """The chunks of a CPU prefill step that attend together: one, or a group over shared blocks."""

    rows: list[tuple[int, int]]  # query row ranges, stacked in this order
    blocks: slice | torch.Tensor  # the pool blocks holding the chunks' own keys, back to back
    num_keys: int  # tokens used from those blocks (the rest of a lone chunk's last is unused)
    chunks: Chunks  # per chunk (in ``rows`` order): its rows, first key, number of keys
    shared: slice | torch.Tensor | None = None  # a group's common blocks, before every chunk's


def _plan_prefill(block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                  seq_lens: torch.Tensor, block_size: int) -> list[_PrefillCall]:
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    tables = block_tables.tolist()
    device = block_tables.device
    groups: dict[int, list[int]] = {}
    for i, seq_len in enumerate(lens):
        num_queries = starts[i + 1] - starts[i]
        if num_queries == 0:
            continue
        first = tables[i][0] if seq_len - num_queries >= block_size else -1 - i
        groups.setdefault(first, []).append(i)
    calls = []
    for rows in groups.values():
        call = (_plan_group(tables, starts, lens, rows, block_size, device)
                if len(rows) > 1 else None)
        if call is not None:
            calls.append(call)
            continue
        for i in rows:
            seq_len = lens[i]
            calls.append(_PrefillCall([(starts[i], starts[i + 1])],
                                      block_run(tables[i][:cdiv(seq_len, block_size)], device),
                                      seq_len, [(starts[i + 1] - starts[i], 0, seq_len)]))
    return calls


def _plan_group(tables, starts, lens, rows, block_size, device) -> _PrefillCall | None:
    """One call for chunks over a common cached prefix; None if they share no full block.

    The shared blocks are gathered once; each chunk's own tail blocks follow, back to back.
    """
    num_shared = shared_blocks([tables[i] for i in rows],
                               [lens[i] - (starts[i + 1] - starts[i]) for i in rows], block_size)
    if num_shared == 0:
        return None
    shared_len = num_shared * block_size
    block_ids: list[int] = []
    chunks = []
    for i in rows:
        tail_len = lens[i] - shared_len
        chunks.append((starts[i + 1] - starts[i], len(block_ids) * block_size, tail_len))
        block_ids.extend(tables[i][num_shared:num_shared + cdiv(tail_len, block_size)])
    return _PrefillCall([(starts[i], starts[i + 1]) for i in rows], block_run(block_ids, device),
                        len(block_ids) * block_size, chunks,
                        block_run(tables[rows[0]][:num_shared], device))


# ---------------------------------------------------------------------------------------------
# Triton: one program per (BLOCK_M query rows of one sequence, query head). The grid's first axis
# runs over every sequence's query tiles back to back; a program finds its sequence by binary
# search over the tiles' start offsets, so the launch needs no device->host sync. It walks that
# sequence's keys in BLOCK_N-token tiles gathered through the block table, from position 0 up to
# the tile's last causal position, with an fp32 online softmax.
# ---------------------------------------------------------------------------------------------

_BLOCK_M = 64  # query rows per program (smaller for short chunks; tl.dot needs >= 16)
_BLOCK_N = 64  # key tokens per inner-loop tile, independent of the pool's block size
_LOG2E = 1.4426950408889634


@jit
def _prefill_kernel(
    out_ptr, q_ptr, kv_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    tile_start_loc_ptr,  # [num_seqs + 1]: the first query tile of each sequence, then the total
    num_seqs, qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    stride_qt, stride_qh,
    stride_kvb, stride_kvkv, stride_kvt, stride_kvh,
    stride_bts, stride_ot, stride_oh,
    GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    if tile >= tl.load(tile_start_loc_ptr + num_seqs):
        return  # the grid is sized by an upper bound on the number of tiles
    # The owner is the last sequence whose first tile is <= this one (empty chunks own none).
    lo = tile * 0  # int32 scalars even when num_seqs == 1 is specialised to a constant
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(tile_start_loc_ptr + mid) <= tile:
            lo = mid
        else:
            hi = mid - 1
    seq = lo
    m_tile = tile - tl.load(tile_start_loc_ptr + seq)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len

    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    # Rows past the chunk sit past seq_len, so they see every key and stay finite; never stored.
    q_pos = prefix_len + rows
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=q_mask, other=0.0).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bts
    kv_head_off = (head // GROUP_SIZE) * stride_kvh + dims
    kv_end = tl.minimum(seq_len, prefix_len + (m_tile + 1) * BLOCK_M)
    for start in range(0, kv_end, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        token_mask = tokens < kv_end
        # Table entries past the sequence's last block are padding: masked, never dereferenced.
        block_ids = tl.load(table_row + tokens // BLOCK_SIZE, mask=token_mask, other=0)
        row_off = block_ids.to(tl.int64) * stride_kvb + (tokens % BLOCK_SIZE) * stride_kvt
        kv_off = row_off[:, None] + kv_head_off[None, :]
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        k = tl.load(kv_ptr + kv_off, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        v = tl.load(kv_ptr + stride_kvkv + kv_off, mask=kv_mask, other=0.0).to(DOT_DTYPE)

        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        causal = token_mask[None, :] & (tokens[None, :] <= q_pos[:, None])
        scores = tl.where(causal, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision="ieee")
        m_i = m_new

    out = acc / l_i[:, None]
    out_off = (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :]
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _launch_prefill(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> None:
    """Grid ``(cdiv(num_tokens, BLOCK_M) + num_seqs, num_heads)``: an upper bound on the total
    number of query tiles (each chunk wastes at most one partial tile), known without a sync."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    block_m = min(_BLOCK_M, max(next_pow2(num_tokens), 16))
    chunk_lens = query_start_loc[1:] - query_start_loc[:-1]
    tile_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int32, device=query.device)
    tile_start_loc[1:] = torch.cumsum(
        torch.div(chunk_lens + block_m - 1, block_m, rounding_mode="floor"), 0
    )
    grid = (cdiv(num_tokens, block_m) + num_seqs, num_heads)
    _prefill_kernel[grid](
        out, query, kv_cache, block_tables, query_start_loc, seq_lens, tile_start_loc,
        num_seqs, scale * _LOG2E,
        query.stride(0), query.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP_SIZE=num_heads // kv_cache.shape[3],
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(next_pow2(head_dim), 16),
        BLOCK_SIZE=kv_cache.shape[2], BLOCK_M=block_m, BLOCK_N=_BLOCK_N,
        DOT_DTYPE=dot_dtype(query.dtype),
        num_warps=4, num_stages=2 if query.dtype == torch.float32 else 3,
    )


def triton_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Triton varlen causal paged prefill with the contract of
    :func:`reference_prefill_attention`.

    Rows of ``query`` not covered by ``query_start_loc`` are left unwritten (as in the reference,
    whose output starts from ``torch.empty``).
    """
    check_attention_inputs("prefill", query, kv_cache, block_tables)
    check_index("prefill", "query_start_loc", query_start_loc, 1, query.device)
    check_index("prefill", "seq_lens", seq_lens, 1, query.device)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"prefill: {num_seqs} sequences need query_start_loc [{num_seqs + 1}] "
                         f"and block_tables [{num_seqs}, *], got {list(query_start_loc.shape)} "
                         f"and {list(block_tables.shape)}")
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs > 0 and query.shape[0] > 0:
        _launch_prefill(out, query, kv_cache, block_tables, query_start_loc, seq_lens, scale)
    return out
