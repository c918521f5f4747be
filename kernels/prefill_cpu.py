"""The tensor math of the CPU prefill path (:func:`agentd.kernels.prefill_attention.
torch_prefill_attention`): chunks attended through torch's flash SDPA kernel, parts merged by
their log-sum-exps, or, in bfloat16 on CPUs with bf16 GEMMs, as batched matrix products over
score tiles.

Invariant: each chunk's rows attend causally to their own keys and to every key before them
(the shared prefix, the chunk's cached tokens), exactly as the reference does, without building
a mask over more than one chunk.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from agentd.kernels._common import heads_first

Chunks = list[tuple[int, int, int]]  # per chunk: query rows, its first key, its number of keys


def each_chunk(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                chunks: Chunks) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
    """Each chunk's rows, its keys and values, and how many of those come before its rows."""
    row = 0
    for num_rows, first, num_keys in chunks:
        yield (query[row:row + num_rows], keys[first:first + num_keys],
               values[first:first + num_keys], num_keys - num_rows)
        row += num_rows


def sdpa_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   chunks: Chunks, scale: float,
                   shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention of chunks through torch's CPU flash kernel (fp32, and CPUs without
    bfloat16 GEMMs).

    ``query`` holds the chunks' rows back to back, ``keys``/``values`` ``[L, Hkv, D]`` their own
    keys (chunk ``i``'s last ``rows_i`` keys are its rows'); ``shared``: keys before every
    chunk's own, seen by every row. A chunk's last row sees all of its keys.

    Parts every row sees whole (``shared``, a chunk's cached keys) and each chunk's own rows
    (causal) run as separate flash calls merged by their log-sum-exps; the whole parts stack each
    GQA group's query heads as the rows of one KV head. SDPA with the equivalent [q, L] mask
    computes every tile and reads the mask per head: 62 vs 37 ms a layer for a 2,084-token chunk
    behind 16 cached tokens, 115 vs 86 ms for 2,048 behind 2,048.
    """
    # The op that also returns the log-sum-exp is internal API: without it, one masked call each.
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    cold = shared is None and len(chunks) == 1 and chunks[0][0] == chunks[0][2]
    if cold or flash is None or query.device.type != "cpu":
        return torch.cat([_sdpa_one_call(rows, k, v, scale, cached, shared)
                          for rows, k, v, cached in each_chunk(query, keys, values, chunks)])
    own = []
    for rows, k, v, cached in each_chunk(query, keys, values, chunks):
        parts = [_flash(flash, rows, k[cached:], v[cached:], scale, is_causal=True)]
        if cached:
            parts.append(_flash_stacked(flash, rows, k[:cached], v[:cached], scale))
        own.append(_merge(parts))
    parts = [own[0] if len(own) == 1 else (torch.cat([o for o, _ in own]),
                                           torch.cat([lse for _, lse in own]))]
    if shared is not None:
        parts.append(_flash_stacked(flash, query, *shared, scale))
    return _merge(parts)[0].to(query.dtype)


def _flash(flash, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
           **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """One flash call on ``[q, H, D]`` rows: the output ``[q, H, D]`` and log-sum-exp ``[q, H]``
    (views of the op's outputs)."""
    out, lse = flash(query.transpose(0, 1)[None], keys.transpose(0, 1)[None].to(query.dtype),
                     values.transpose(0, 1)[None].to(query.dtype), scale=scale, **kwargs)[:2]
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


def _flash_stacked(flash, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_flash` with no mask, each GQA group's heads stacked as the rows of one KV head, so
    each key tile is read once a group, not once a query head (SmolLM2, fp32: a 40-token turn
    behind 2,064 cached tokens, 80.8 vs 83.8 ms a step, medians of 46 alternating requests)."""
    num_rows, num_heads, head_dim = query.shape
    num_kv_heads = keys.shape[1]
    if num_kv_heads == num_heads:
        return _flash(flash, query, keys, values, scale)
    group = num_heads // num_kv_heads
    stacked = query.view(num_rows, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    out, lse = flash(stacked.reshape(1, num_kv_heads, group * num_rows, head_dim),
                     keys.transpose(0, 1)[None].to(query.dtype),
                     values.transpose(0, 1)[None].to(query.dtype), scale=scale)[:2]
    out = out.view(num_kv_heads, group, num_rows, head_dim).permute(2, 0, 1, 3)
    lse = lse.view(num_kv_heads, group, num_rows).permute(2, 0, 1)
    return out.reshape(num_rows, num_heads, head_dim), lse.reshape(num_rows, num_heads)


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of disjoint key sets, and its log-sum-exp, from each set's."""
    if len(parts) == 1:
        return parts[0]
    lse = parts[0][1]
    for _, part_lse in parts[1:]:
        lse = torch.logaddexp(lse, part_lse)
    merged = None
    for out, part_lse in parts:
        term = out * (part_lse - lse).exp_().unsqueeze(-1)
        merged = term if merged is None else merged.add_(term)
    return merged, lse


def _sdpa_one_call(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                   offset: int, shared: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """One chunk as one SDPA call: ``shared`` joined before its keys, causal behind ``offset``."""
    if shared is not None:
        keys, values = torch.cat([shared[0], keys]), torch.cat([shared[1], values])
        offset += shared[0].shape[0]
    mask = None
    if offset > 0:
        mask = _additive(_causal_visible(query.shape[0], offset, query.device), query.dtype)
    q = query.transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
    k = keys.transpose(0, 1).unsqueeze(0).to(query.dtype)  # [1, Hkv, L, D]
    v = values.transpose(0, 1).unsqueeze(0).to(query.dtype)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )[0].transpose(0, 1)


def _causal_visible(num_rows: int, offset: int, device: torch.device) -> torch.Tensor:
    """``[q, offset + q]``: row ``i`` sees keys ``0..offset + i``."""
    positions = offset + torch.arange(num_rows, device=device)
    return torch.arange(offset + num_rows, device=device)[None, :] <= positions[:, None]


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as SDPA's additive one (0 / -inf), ``[1, 1, q, L]``."""
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return bias.masked_fill_(~visible, float("-inf"))[None, None]


MATMUL_TILE_ROWS = 128  # query rows per score tile: 19 ms a 2,100-token causal layer (bf16), vs
# 39 ms with 256 (larger score tiles fall out of cache) and 36 ms for SDPA


def matmul_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     scale: float, offset: int = 0,
                     shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention of one chunk, ``query`` ``[q, H, D]`` over ``keys``/``values``
    ``[L, Hkv, D]`` (``offset`` cached keys, then the rows' own: row ``i`` sees keys
    ``0..offset + i``), as batched GEMMs in the inputs' dtype, ``MATMUL_TILE_ROWS`` rows at a
    time; a tile computes only the keys up to its last row. ``shared``: keys and values before
    ``keys`` that every row sees (a group's common prefix).

    Scores are produced in the input dtype; softmax accumulates in fp32. Each GQA group's query
    heads are stacked into the rows of one product with their KV head.
    """
    num_rows, num_heads, head_dim = query.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    q = (query * scale).view(num_rows, num_kv_heads, group, head_dim).transpose(0, 1)
    if shared is None:
        keys_h, values_h = heads_first(keys), heads_first(values)  # [Hkv, L, D]
    else:  # one head-major copy of both parts
        keys_h = torch.cat([shared[0].transpose(0, 1), keys.transpose(0, 1)], dim=1)
        values_h = torch.cat([shared[1].transpose(0, 1), values.transpose(0, 1)], dim=1)
        offset += shared[0].shape[0]
    keys_t = keys_h.transpose(1, 2)  # [Hkv, D, L]
    out = torch.empty_like(query)
    out_groups = out.view(num_rows, num_kv_heads, group, head_dim)
    for first in range(0, num_rows, MATMUL_TILE_ROWS):
        last = min(num_rows, first + MATMUL_TILE_ROWS)
        rows = last - first
        end = offset + last
        tile = q[:, first:last].reshape(num_kv_heads, rows * group, head_dim)
        scores = torch.bmm(tile, keys_t[:, :, :end]).view(num_kv_heads, rows, group, end)
        future = torch.ones(rows, rows, dtype=torch.bool, device=query.device).triu_(1)
        scores[..., end - rows:].masked_fill_(future[None, :, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(num_kv_heads, rows * group, end)
        tile_out = torch.bmm(probs, values_h[:, :end])  # [Hkv, rows * group, D]
        out_groups[first:last] = tile_out.view(num_kv_heads, rows, group, head_dim).transpose(0, 1)
    return out
