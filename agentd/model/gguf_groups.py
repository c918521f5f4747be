"""A GGUF's quantized linear weights read as their own integer groups, without a float copy.

Q4_0, Q4_1 and Q4_K store 4-bit values in groups of 32 along the input dim with a scale and
(Q4_1, Q4_K) a minimum per group, so int4 groups with zero points hold them exactly:
- Q4_0: ``w = d (q - 8)``            -> ``scale = d, zero = 0``
- Q4_1: ``w = d q + m``              -> ``scale = d, zero = m + 8 d``
- Q4_K: ``w = d sc_j q - dmin m_j`` -> ``scale = d sc_j, zero = 8 d sc_j - dmin m_j`` (6-bit
  ``sc_j, m_j`` per sub-block of 32 in a super-block of 256)
Other types (Q8_0, Q5_K, Q6_K, F16, ...) hold more than 4 bits per weight; no CPU kernel here
takes their groups as they are, so the caller dequantizes them (``gguf.quants``) into its format.

Invariant: ``read_int4_groups`` returns, for every 4-bit linear weight of the file, groups whose
dequantization equals ``gguf.quants.dequantize`` of the same tensor up to fp32 rounding, in
transformers' layout (names, and llama's q/k rows un-permuted as transformers loads them).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from agentd.model.gguf_check import check_layout
from agentd.model.gguf_header import read_index
from agentd.model.quant import IntGroups

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}

# GGUF tensor name (after blk.N.) -> transformers' name (after model.layers.N.)
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; ``output.weight``
    -> ``lm_head.weight``; ``None`` for tensors that are not linear layers."""
    if gguf_name == "output.weight":
        return "lm_head.weight"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"


def _halves(raw: np.ndarray) -> np.ndarray:
    """``[..., 16]`` bytes of nibbles -> ``[..., 32]`` values: low nibbles first (ggml's order)."""
    return np.concatenate([raw & 15, raw >> 4], axis=-1)


def _f16(raw: np.ndarray) -> np.ndarray:
    """``[..., 2]`` bytes -> ``[...]`` float32 of the little-endian fp16 they hold."""
    return np.ascontiguousarray(raw).view("<f2")[..., 0].astype(np.float32)


# Decoders: ``[rows, blocks, block bytes]`` uint8 -> values, scales and zeros (numpy: on 2 busy
# cores torch's elementwise uint8 ops on these small tensors ran ~20x slower).
def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(blocks[..., 0:2])
    return _halves(blocks[..., 2:18]), d, np.zeros_like(d)


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, m = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    return _halves(blocks[..., 4:20]), d, m + 8 * d


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Super-blocks of 256 -> 8 groups of 32 each: ``[..., 8, 32]`` values, ``[..., 8]`` scales."""
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    s = blocks[..., 4:16].astype(np.int32)
    # 12 bytes hold eight 6-bit scales and eight 6-bit minimums: sub-blocks 0-3 in the low six
    # bits of bytes 0-3 (scales) and 4-7 (minimums); sub-blocks 4-7 in the nibbles of bytes 8-11
    # with their top two bits in the high bits of bytes 0-3 (scales) and 4-7 (minimums).
    low_sc, low_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    high_sc = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    high_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    sc = np.concatenate([low_sc, high_sc], axis=-1).astype(np.float32)
    mins = np.concatenate([low_m, high_m], axis=-1).astype(np.float32)
    # 128 bytes of values: four runs of 32 bytes, each run's low nibbles are sub-block 2j and its
    # high nibbles sub-block 2j + 1.
    runs = blocks[..., 16:144].reshape(*blocks.shape[:-1], 4, 1, 32)
    values = np.concatenate([runs & 15, runs >> 4], axis=-2).reshape(*blocks.shape[:-1], 8, 32)
    scales = d[..., None] * sc
    return values, scales, 8 * scales - dmin[..., None] * mins


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k}


def int4_groups(raw: np.ndarray, type_name: str, out_features: int,
                in_features: int) -> IntGroups:
    """One tensor's raw blocks (uint8, row after row) as :class:`IntGroups`."""
    values, scales, zeros = _DECODERS[type_name](raw.reshape(out_features, -1,
                                                             _BLOCK_BYTES[type_name]))
    return IntGroups(torch.from_numpy(np.ascontiguousarray(values).reshape(out_features, -1)),
                     torch.from_numpy(np.ascontiguousarray(scales).reshape(out_features, -1)),
                     torch.from_numpy(np.ascontiguousarray(zeros).reshape(out_features, -1)))


def _unpermute_rows(groups: IntGroups, num_heads: int) -> IntGroups:
    """Undo llama.cpp's q/k row order (each head's two rotary halves interleaved), as transformers
    does when it loads a llama GGUF: a permutation of output rows, so groups stay whole."""
    rows = groups.values.shape[0]
    order = np.arange(rows).reshape(num_heads, rows // num_heads // 2, 2).swapaxes(1, 2)
    order = order.reshape(rows)
    return IntGroups(*(torch.from_numpy(t.numpy()[order])
                       for t in (groups.values, groups.scales, groups.zeros)), groups.group_size)


def read_int4_groups(path: Path) -> dict[str, IntGroups]:
    """Every Q4_0/Q4_1/Q4_K linear weight of the GGUF at ``path``, by transformers' name."""
    index = read_index(path)
    check_layout(index)  # the model's own claims were checked when it was converted
    arch = index.fields.get("general.architecture")
    num_heads = index.fields.get(f"{arch}.attention.head_count")
    num_kv_heads = index.fields.get(f"{arch}.attention.head_count_kv") or num_heads
    out: dict[str, IntGroups] = {}
    with path.open("rb") as f:
        for tensor in index.tensors:
            name = hf_name(tensor.name)
            if name is None or tensor.type_name not in INT4_TYPES:
                continue
            in_features, out_features = tensor.shape[0], tensor.shape[1]
            f.seek(tensor.offset)
            raw = np.frombuffer(f.read(tensor.num_bytes), dtype=np.uint8)
            groups = int4_groups(raw, tensor.type_name, out_features, in_features)
            if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                groups = _unpermute_rows(groups, num_heads if "q_proj" in name else num_kv_heads)
            out[name] = groups
    return out
