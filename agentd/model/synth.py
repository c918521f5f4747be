"""Random-weight GGUF files of real model shapes, so benchmarks and tests see true speed and memory.

The values are noise; everything else is real: llama.cpp's tensor names, ggml shapes and llama
metadata, real blocks of the target format (random codes, fp16 scales chosen so the weights have
std ~0.02 like a fresh init), Q4_K_M's per-tensor mix as llama.cpp's quantizer picks it, and the
default model's tokenizer and chat template (every ``tokenizer.*`` key, copied), so every shape
has the default's 49,152-token vocab.

Invariant: the writer holds one tensor at a time (peak memory ~ the largest tensor, 165 MB for
8b's Q6_K head), and a tensor's bytes depend only on the seed and the tensor's name, so
``--layers`` changes no other tensor.

    python -m agentd.model.synth --shape 8b --type Q4_K_M -o synth-8b-Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import resource
import struct
import time
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

import gguf
import numpy as np

from agentd.model.default_model import default_gguf_path

VT = gguf.GGUFValueType
QT = gguf.GGMLQuantizationType
FILE_TYPES = {"Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
              "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
              "F16": gguf.LlamaFileType.MOSTLY_F16}
_TARGET_STD = 0.02
_CHUNK_BLOCKS = 1 << 17  # blocks generated per step: bounds the temporaries (~30 MB)


@dataclass(frozen=True)
class SynthShape:
    name: str
    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied: bool
    rope_theta: float
    context_len: int
    rms_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: {self.num_heads} heads are not a multiple of "
                             f"{self.num_kv_heads} kv heads")
        for dim in (self.hidden, self.intermediate, self.num_heads * self.head_dim):
            if dim % 32:
                raise ValueError(f"{self.name}: input dim {dim} is not a multiple of 32")


SHAPES = {
    "tiny": SynthShape("tiny", 256, 512, 2, 4, 2, 64, True, 10000.0, 2048),
    "1.7b": SynthShape("1.7b", 2048, 8192, 24, 32, 32, 64, True, 130000.0, 8192),
    "3b": SynthShape("3b", 3072, 8192, 28, 24, 8, 128, True, 500000.0, 131072),
    "8b": SynthShape("8b", 4096, 14336, 32, 32, 8, 128, False, 500000.0, 8192),
}


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]  # numpy order: (out, in) for a matrix; ggml's is the reverse
    qtype: QT


def _use_more_bits(i_layer: int, num_layers: int) -> bool:
    # llama.cpp's Q4_K_M rule for attn_v and ffn_down: the first and last eighth of the layers
    # and every third layer in between get Q6_K.
    eighth = num_layers // 8
    return i_layer < eighth or i_layer >= 7 * num_layers // 8 or (i_layer - eighth) % 3 == 2


def _linear_type(ftype: str, kind: str, i_layer: int, num_layers: int) -> QT:
    if ftype != "Q4_K_M":
        return QT[ftype]
    if kind in ("attn_v", "ffn_down") and _use_more_bits(i_layer, num_layers):
        return QT.Q6_K
    return QT.Q4_K


def _head_type(ftype: str, cols: int) -> QT:
    # llama.cpp quantizes output.weight (and a tied token_embd) to Q6_K unless the mix is Q8_0
    # or F16, falling back to Q8_0 when the row is not a multiple of 256.
    if ftype in ("Q8_0", "F16"):
        return QT[ftype]
    return QT.Q6_K if cols % 256 == 0 else QT.Q8_0


def plan_tensors(shape: SynthShape, ftype: str, vocab_size: int) -> list[TensorPlan]:
    """Every tensor of the file, in writing order, with the type llama.cpp's quantizer gives."""
    if ftype not in FILE_TYPES:
        raise ValueError(f"unknown type {ftype!r}; choose one of {', '.join(FILE_TYPES)}")
    h, q_dim = shape.hidden, shape.num_heads * shape.head_dim
    kv_dim = shape.num_kv_heads * shape.head_dim
    embd_type = _head_type(ftype, h) if shape.tied else _linear_type(ftype, "token_embd", 0, 1)
    plans = [TensorPlan("token_embd.weight", (vocab_size, h), embd_type)]
    linears = [("attn_q", q_dim, h), ("attn_k", kv_dim, h), ("attn_v", kv_dim, h),
               ("attn_output", h, q_dim), ("ffn_gate", shape.intermediate, h),
               ("ffn_up", shape.intermediate, h), ("ffn_down", h, shape.intermediate)]
    for i in range(shape.num_layers):
        plans.append(TensorPlan(f"blk.{i}.attn_norm.weight", (h,), QT.F32))
        for kind, rows, cols in linears:
            if kind == "ffn_gate":
                plans.append(TensorPlan(f"blk.{i}.ffn_norm.weight", (h,), QT.F32))
            qtype = _linear_type(ftype, kind, i, shape.num_layers)
            plans.append(TensorPlan(f"blk.{i}.{kind}.weight", (rows, cols), qtype))
    plans.append(TensorPlan("output_norm.weight", (h,), QT.F32))
    if not shape.tied:
        plans.append(TensorPlan("output.weight", (vocab_size, h), _head_type(ftype, h)))
    return plans


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype("<f2").view(np.uint8).reshape(len(values), 2)


def _block_scale(rng: np.random.Generator, n: int, code_rms: float) -> np.ndarray:
    # A per-block scale around the one that gives std _TARGET_STD, varied like real blocks' maxima.
    return _TARGET_STD / code_rms * rng.uniform(0.75, 1.25, n).astype(np.float32)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K's 12 bytes of eight 6-bit scales and mins (sc, m: uint8 [n, 8], values < 64)."""
    out = np.empty((len(sc), 12), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _random_blocks(rng: np.random.Generator, qtype: QT, n: int) -> np.ndarray:
    """``n`` random blocks of ``qtype`` as uint8 [n, block_bytes]: random codes, sane scales."""
    _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n, block_bytes), dtype=np.uint8)
    # RMS of the codes as each format centres them: uniform nibbles minus 8 (or 7.5), int8, and
    # Q6_K's 6-bit codes minus 32.
    if qtype == QT.Q8_0:
        blocks[:, 0:2] = _fp16_bytes(_block_scale(rng, n, 73.9))
    elif qtype == QT.Q4_0:
        blocks[:, 0:2] = _fp16_bytes(_block_scale(rng, n, 4.61))
    elif qtype == QT.Q4_1:  # w = d*q + m; m = -7.5*d centres the nibbles on zero
        d = _block_scale(rng, n, 4.61)
        blocks[:, 0:2], blocks[:, 2:4] = _fp16_bytes(d), _fp16_bytes(-7.5 * d)
    elif qtype == QT.Q4_K:
        # w = d*sc*q - dmin*m; m = sc and dmin = 7.5*d centre each sub-block on zero.
        sc = rng.integers(16, 64, (n, 8), dtype=np.uint8)
        d = _block_scale(rng, n, 4.61 * 42.4)
        blocks[:, 0:2], blocks[:, 2:4] = _fp16_bytes(d), _fp16_bytes(7.5 * d)
        blocks[:, 4:16] = _pack_k_scales(sc, sc)
    elif qtype == QT.Q6_K:
        blocks[:, 192:208] = rng.integers(16, 64, (n, 16), dtype=np.uint8)  # int8, positive
        blocks[:, 208:210] = _fp16_bytes(_block_scale(rng, n, 18.47 * 42.4))
    else:
        raise ValueError(f"no block writer for {qtype.name}")
    return blocks


def _stored(plan: TensorPlan) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype of the array GGUFWriter is given for ``plan``."""
    if plan.qtype == QT.F32:
        return plan.shape, np.dtype(np.float32)
    return tuple(gguf.quant_shape_to_byte_shape(plan.shape, plan.qtype)), np.dtype(np.uint8)


def tensor_bytes(plan: TensorPlan, seed: int) -> np.ndarray:
    """The tensor's data as GGUF stores it: uint8 [rows, row_bytes], or float32 norms."""
    if plan.qtype == QT.F32:
        return np.ones(plan.shape, np.float32)  # RMSNorm gains start at one
    rng = np.random.default_rng([seed, zlib.crc32(plan.name.encode())])
    rows, cols = plan.shape
    if plan.qtype == QT.F16:
        out16 = np.empty(plan.shape, np.float16)
        step = max(1, _CHUNK_BLOCKS // cols)
        for start in range(0, rows, step):
            chunk = out16[start:start + step]
            chunk[:] = rng.standard_normal(chunk.shape, np.float32) * _TARGET_STD
        return out16.view(np.uint8)
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[plan.qtype]
    if cols % block_weights:
        raise ValueError(f"{plan.name}: {cols} columns do not split into {block_weights}-blocks")
    out = np.empty((rows * cols // block_weights, block_bytes), np.uint8)
    for start in range(0, len(out), _CHUNK_BLOCKS):
        stop = min(start + _CHUNK_BLOCKS, len(out))
        out[start:stop] = _random_blocks(rng, plan.qtype, stop - start)
    return out.reshape(rows, cols // block_weights * block_bytes)


# --- the default model's tokenizer: every tokenizer.* key, arrays included ---

_SCALAR_CODES = {VT.UINT8: "B", VT.INT8: "b", VT.UINT16: "H", VT.INT16: "h", VT.UINT32: "I",
                 VT.INT32: "i", VT.FLOAT32: "f", VT.BOOL: "?", VT.UINT64: "Q", VT.INT64: "q",
                 VT.FLOAT64: "d"}


@dataclass(frozen=True)
class MetaValue:
    value: Any
    vtype: VT
    sub_type: VT | None = None  # an array's item type


def _unpack(f: BinaryIO, code: str) -> Any:
    return struct.unpack("<" + code, f.read(struct.calcsize("<" + code)))[0]


def _read_value(f: BinaryIO, vtype: VT) -> MetaValue:
    if vtype in _SCALAR_CODES:
        return MetaValue(_unpack(f, _SCALAR_CODES[vtype]), vtype)
    if vtype == VT.STRING:
        return MetaValue(f.read(_unpack(f, "Q")).decode("utf-8"), vtype)
    item_type, count = VT(_unpack(f, "I")), _unpack(f, "Q")
    if item_type in _SCALAR_CODES:
        code = _SCALAR_CODES[item_type]
        items = list(struct.unpack(f"<{count}{code}", f.read(count * struct.calcsize(code))))
    else:
        items = [_read_value(f, item_type).value for _ in range(count)]
    return MetaValue(items, VT.ARRAY, item_type)


def read_tokenizer_fields(path: Path) -> dict[str, MetaValue]:
    """Every ``tokenizer.*`` metadata item of a GGUF (a fast read: gguf.GGUFReader takes ~7 s on
    a 49k vocab here)."""
    fields: dict[str, MetaValue] = {}
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        _version, _num_tensors, num_fields = _unpack(f, "I"), _unpack(f, "Q"), _unpack(f, "Q")
        for _ in range(num_fields):
            key = f.read(_unpack(f, "Q")).decode("utf-8")
            item = _read_value(f, VT(_unpack(f, "I")))
            if key.startswith("tokenizer."):
                fields[key] = item
    return fields


def _add_metadata(writer: gguf.GGUFWriter, shape: SynthShape, ftype: str,
                  tokenizer: dict[str, MetaValue]) -> int:
    vocab_size = len(tokenizer["tokenizer.ggml.tokens"].value) if tokenizer else 49152
    writer.add_name(f"synth-{shape.name}")
    writer.add_block_count(shape.num_layers)
    writer.add_context_length(shape.context_len)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    if shape.head_dim * shape.num_heads != shape.hidden:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_vocab_size(vocab_size)
    writer.add_file_type(FILE_TYPES[ftype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, item in tokenizer.items():
        writer.add_key_value(key, item.value, item.vtype, item.sub_type)
    return vocab_size


def write_synth_gguf(path: Path | str, shape: str | SynthShape, type: str = "Q4_K_M",
                     seed: int = 0, num_layers: int | None = None,
                     tokenizer: bool = True,
                     context_len: int | None = None) -> list[TensorPlan]:
    """Write a random-weight GGUF of ``shape`` in llama.cpp's ``type`` mix to ``path``.

    Args:
        shape: a name of SHAPES or a SynthShape; num_layers overrides its layer count.
        tokenizer: copy the default model's tokenizer keys (False: none, for fast-opening files).
        context_len: the trained context its metadata names (default: the shape's; agent-length
            benchmarks want 32k, which llama-server will not exceed).
    Returns:
        The tensors written, in file order.
    """
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
        shape = SHAPES[shape]
    if num_layers is not None:
        shape = replace(shape, num_layers=num_layers)
    if context_len is not None:
        shape = replace(shape, context_len=context_len)
    fields = read_tokenizer_fields(default_gguf_path()) if tokenizer else {}
    writer = gguf.GGUFWriter(path, "llama")
    vocab_size = _add_metadata(writer, shape, type, fields)
    plans = plan_tensors(shape, type, vocab_size)
    for plan in plans:
        stored_shape, dtype = _stored(plan)
        writer.add_tensor_info(plan.name, stored_shape, dtype,
                               int(np.prod(stored_shape)) * dtype.itemsize, raw_dtype=plan.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for plan in plans:
        writer.write_tensor_data(tensor_bytes(plan, seed))
    writer.close()
    return plans


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m agentd.model.synth", description=__doc__)
    parser.add_argument("--shape", required=True, choices=list(SHAPES))
    parser.add_argument("--type", default="Q4_K_M", choices=list(FILE_TYPES))
    parser.add_argument("-o", "--output", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--context", type=int, default=None,
                        help="the trained context in its metadata (default: the shape's)")
    args = parser.parse_args(argv)
    start_s = time.monotonic()
    plans = write_synth_gguf(args.output, args.shape, args.type, args.seed, args.layers,
                             context_len=args.context)
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{args.output}: {len(plans)} tensors, {args.output.stat().st_size / 1e9:.3f} GB, "
          f"{time.monotonic() - start_s:.1f} s, generator peak RSS {peak_rss_mib:.0f} MiB")


if __name__ == "__main__":
    main()
