"""Hold a GGUF's header to its file: the tensor table to the bytes, the model's metadata to the
tensors.

The one place a GGUF's claims are checked, before anything is mapped, allocated or built from
them (``GgufFile.open`` calls :func:`check_header`; the served model, the fp32 conversion and the
tokenizer build all start there):
- layout: the tensor table as llama.cpp's reader requires it. Tensors lie in table order, each at
  the end of the one before padded to ``general.alignment``, each whole inside the file, each row
  a whole number of its type's blocks. A retyped, resized or moved tensor, or a cut file, breaks
  this.
- model (llama, qwen2 and qwen3 files): ``block_count`` is the number of layers the tensors hold,
  the embedding size, head counts, head size, feed-forward size and vocabulary are the shapes of
  the tensors that carry them, special token ids lie inside the vocabulary, and the few numbers
  no tensor holds (``context_length``, the rotary base, the norm epsilon) are in range.

Invariant: a header that passes describes tensors that all lie in the file, with the shapes the
model code will ask for; one that fails raises a one-line ``GgufHeaderError`` naming the field or
tensor, what it claims and what the file holds. The context length is only bounded below: what
it costs is the KV pool's and the rotary table's, both sized for the context served.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

from agentd.model.gguf_header import BLOCK_WEIGHTS, DAMAGED, GgufIndex, TensorInfo, read_index
from agentd.model.load_errors import GgufHeaderError, ModelLoadError

ARCHITECTURES = ("llama", "qwen2", "qwen3")
REQUANTIZE_HINT = ("re-quantize to Q4_K_M/Q8_0 with llama-quantize, or pass --weights float32 to "
                   "convert")
_LAYER = re.compile(r"blk\.(\d+)\.")


def read_checked(path: Path, kernel_types: Collection[str] | None = None) -> GgufIndex:
    """The index of the GGUF at ``path``, held to the file by :func:`check_header`."""
    try:
        index = read_index(path)
    except GgufHeaderError:
        raise
    except ValueError as exc:  # a tensor type the reader does not know (IQ*, TQ*, ...)
        raise ModelLoadError(f"{exc}; {REQUANTIZE_HINT}") from exc
    check_header(index, kernel_types)
    return index


def check_header(index: GgufIndex, kernel_types: Collection[str] | None = None) -> None:
    """Raise ``GgufHeaderError`` where the header claims what the file does not hold (module
    docstring); with ``kernel_types``, a tensor of another type is a ``ModelLoadError`` that says
    to re-quantize."""
    check_layout(index)
    if kernel_types is not None:
        for t in index.tensors:
            if t.type_name not in kernel_types:
                raise ModelLoadError(f"{index.name}: tensor {t.name} is {t.type_name}, which "
                                     f"--weights gguf does not serve; {REQUANTIZE_HINT}")
    if index.fields.get("general.architecture") in ARCHITECTURES:
        _check_model(index)


def _fail(index: GgufIndex, message: str) -> GgufHeaderError:
    return GgufHeaderError(f"{index.name}: {message}; {DAMAGED}")


def _describe(t: TensorInfo) -> str:
    return f"{t.name} ({' x '.join(map(str, t.shape))} {t.type_name}, {t.num_bytes:,} bytes)"


def check_layout(index: GgufIndex) -> None:
    """The tensor table against the file's bytes alone (module docstring, layout)."""
    if index.tensors and index.data_start > index.file_bytes:
        raise _fail(index, f"the header ends at byte {index.data_start:,}, past the end of the "
                    f"{index.file_bytes:,}-byte file")
    names: set[str] = set()
    expected, before = 0, None
    for t in index.tensors:
        if t.name in names:
            raise _fail(index, f"tensor {t.name} is listed twice in the tensor table")
        names.add(t.name)
        block = BLOCK_WEIGHTS[t.type_name]
        if t.shape[0] % block:
            raise _fail(index, f"tensor {t.name} claims rows of {t.shape[0]:,} weights, which "
                        f"do not split into {t.type_name}'s blocks of {block}")
        start = t.offset - index.data_start
        if start != expected:
            held = "the data begins with it, at 0" if before is None else \
                f"{_describe(before)} before it ends at {expected:,} (padded to " \
                f"{index.alignment})"
            raise _fail(index, f"tensor {t.name} claims offset {start:,} in the data, but "
                        f"{held}")
        end = t.offset + t.num_bytes
        if end > index.file_bytes:
            raise _fail(index, f"tensor {_describe(t)} claims bytes {t.offset:,} to {end:,}, "
                        f"past the end of the {index.file_bytes:,}-byte file")
        expected = start + -(-t.num_bytes // index.alignment) * index.alignment
        before = t
    unclaimed = index.file_bytes - index.data_start - expected
    if before is not None and unclaimed > 0:  # the last tensor retyped or resized smaller
        raise _fail(index, f"the file holds {unclaimed:,} bytes after its last tensor, "
                    f"{_describe(before)}, that no tensor claims")


class _Claims:
    """The model's metadata under ``<arch>.``, read as the numbers the model code will use."""

    def __init__(self, index: GgufIndex) -> None:
        self.index = index
        self.arch = index.fields["general.architecture"]
        self.tensors = {t.name: t for t in index.tensors}

    def key(self, name: str) -> str:
        return f"{self.arch}.{name}"

    def count(self, name: str, default: int | None = None) -> int:
        """A positive integer field; ``default`` where it is absent (None: it must be there)."""
        value: Any = self.index.fields.get(self.key(name), default)
        if value is None:
            raise GgufHeaderError(
                f"{self.index.name} lacks {self.key(name)} (or has it per layer); pass a GGUF "
                "made by llama.cpp's converter")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _fail(self.index, f"{self.key(name)} claims {value!r}; it counts something "
                        "the model has, so it is a whole number of at least 1")
        return value

    def tensor(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise GgufHeaderError(f"{self.index.name} has no tensor {name}; pass a complete "
                                  "GGUF of a supported architecture")
        return self.tensors[name]


def _check_model(index: GgufIndex) -> None:
    c = _Claims(index)
    num_layers, hidden = c.count("block_count"), c.count("embedding_length")
    num_heads, ffn = c.count("attention.head_count"), c.count("feed_forward_length")
    num_kv_heads = c.count("attention.head_count_kv", num_heads)
    c.count("context_length", 1)
    if index.fields.get(c.key("attention.key_length")) is None and hidden % num_heads:
        raise _fail(index, f"{c.key('embedding_length')} {hidden} is not a multiple of "
                    f"{c.key('attention.head_count')} {num_heads}, and no key_length gives the "
                    "head size")
    head_dim = c.count("attention.key_length", hidden // num_heads)
    if num_heads % num_kv_heads:
        raise _fail(index, f"{c.key('attention.head_count')} {num_heads} is not a multiple of "
                    f"{c.key('attention.head_count_kv')} {num_kv_heads}")
    _check_layers(c, num_layers)
    embd = c.tensor("token_embd.weight")
    if len(embd.shape) != 2 or embd.shape[0] != hidden:
        raise _fail(index, f"{c.key('embedding_length')} claims {hidden}, but token_embd.weight "
                    f"holds rows of {embd.shape[0]:,} (shape {embd.shape})")
    vocab = embd.shape[1]
    _check_vocab(c, vocab)
    q_rows, kv_rows = num_heads * head_dim, num_kv_heads * head_dim
    heads = f"{c.key('attention.head_count')} {num_heads} x head size {head_dim}"
    kv_heads = f"{c.key('attention.head_count_kv')} {num_kv_heads} x head size {head_dim}"
    width = f"{c.key('embedding_length')} {hidden}"
    layer_shapes = {  # role: (ggml shape, the fields that claim it)
        "attn_norm.weight": ((hidden,), width), "ffn_norm.weight": ((hidden,), width),
        "attn_q.weight": ((hidden, q_rows), f"{width} by {heads}"),
        "attn_k.weight": ((hidden, kv_rows), f"{width} by {kv_heads}"),
        "attn_v.weight": ((hidden, kv_rows), f"{width} by {kv_heads}"),
        "attn_output.weight": ((q_rows, hidden), f"{heads} by {width}"),
        "attn_q.bias": ((q_rows,), heads), "attn_k.bias": ((kv_rows,), kv_heads),
        "attn_v.bias": ((kv_rows,), kv_heads), "attn_output.bias": ((hidden,), width),
        "attn_q_norm.weight": ((head_dim,), heads), "attn_k_norm.weight": ((head_dim,), heads),
        "ffn_gate.weight": ((hidden, ffn), f"{width} by {c.key('feed_forward_length')} {ffn}"),
        "ffn_up.weight": ((hidden, ffn), f"{width} by {c.key('feed_forward_length')} {ffn}"),
        "ffn_down.weight": ((ffn, hidden), f"{c.key('feed_forward_length')} {ffn} by {width}"),
    }
    top_shapes = {"output.weight": ((hidden, vocab), f"{width} by the vocabulary {vocab:,}"),
                  "output_norm.weight": ((hidden,), width)}
    for t in index.tensors:
        match = _LAYER.match(t.name)
        want = layer_shapes.get(t.name[match.end():]) if match else top_shapes.get(t.name)
        if want is not None and t.shape != want[0]:
            raise _fail(index, f"{want[1]} claims tensor {t.name} is "
                        f"{' x '.join(map(str, want[0]))}, but the file holds "
                        f"{' x '.join(map(str, t.shape))}")
    if c.count("rope.dimension_count", head_dim) > head_dim:
        raise _fail(index, f"{c.key('rope.dimension_count')} claims "
                    f"{index.fields[c.key('rope.dimension_count')]} rotary dims, more than the "
                    f"head size {head_dim}")
    _check_floats(c)


def _check_layers(c: _Claims, num_layers: int) -> None:
    layers = {int(m.group(1)) for t in c.index.tensors if (m := _LAYER.match(t.name))}
    if len(layers) != num_layers or (layers and max(layers) != num_layers - 1):
        held = f"tensors of {len(layers)} layers (blk.{min(layers)} to blk.{max(layers)})" \
            if layers else "no layer tensors (blk.N.*)"
        raise _fail(c.index, f"{c.key('block_count')} claims {num_layers:,} "
                    f"layer{'s' if num_layers != 1 else ''}, but the file holds {held}")


def _check_vocab(c: _Claims, vocab: int) -> None:
    """The vocabulary is token_embd.weight's rows: every other count of it must agree."""
    held = f"token_embd.weight holds {vocab:,} tokens"
    for name, value in ((c.key("vocab_size"), c.index.fields.get(c.key("vocab_size"))),
                        ("tokenizer.ggml.tokens",
                         c.index.array_lengths.get("tokenizer.ggml.tokens"))):
        if value is not None and value != vocab:
            raise _fail(c.index, f"{name} claims {value!r} tokens, but {held}")
    for key, value in c.index.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id") and (
                isinstance(value, bool) or not isinstance(value, int)
                or not 0 <= value < vocab):
            raise _fail(c.index, f"{key} claims token {value!r}, but {held}")


def _check_floats(c: _Claims) -> None:
    """The numbers no tensor holds but every forward uses: a rotary base below or at 0, or a
    norm epsilon out of [0, 1), makes every logit NaN or noise."""
    for name, low, high in (("rope.freq_base", 0.0, math.inf),
                            ("attention.layer_norm_rms_epsilon", 0.0, 1.0)):
        value = c.index.fields.get(c.key(name))
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value) or not low <= value < high or \
                (name == "rope.freq_base" and value == 0):
            raise _fail(c.index, f"{c.key(name)} claims {value!r}; it must be a number in "
                        f"{'(0, inf)' if high == math.inf else f'[{low:g}, {high:g})'}")
