"""A GGUF served as it ships: the file memory-mapped, its linear weights in their block format.

The file is mapped once, read-only; every quantized weight is a ``uint8 [rows, row_bytes]`` view
of that one mapping (a torch tensor over the whole file, so the views keep it alive as long as the
model), held by :mod:`agentd.model.ggml_linear` modules. The model is built on the meta device as
for any checkpoint, its linear layers, embedding and LM head are swapped for those modules, and
only the rest (norm weights, biases: F32 and small) is materialized, copied from the file. The
config comes from the file's header (``general.architecture``'s keys), never from a conversion.

Llama-arch files store each head's ``attn_q``/``attn_k`` rows permuted (its two rotary halves
interleaved, as llama.cpp's converter writes them); the rows stay as they are and the model runs
rotary on interleaved pairs instead (``ModelDims.rope_interleaved``): q and k carry the same
permutation, so every q.k, and the outputs, are unchanged, and the KV cache holds k in the file's
order. Qwen2/Qwen3 files are not permuted.

Invariant: no float copy of a quantized weight exists; every parameter and buffer of the model
comes from the file (a tensor the file lacks is a one-line ``ModelLoadError``, never zeros), and
nothing is built before the header has been held to the file (``gguf_check``: its layer count
and shapes are the tensors', every tensor lies inside the file).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from agentd.kernels import cpu as ggml
from agentd.model.ggml_linear import QUANT_MODULES, FusedQuantLinear, QuantEmbedding, QuantLinear
from agentd.model.gguf_index import GgufFile
from agentd.model.llama import LlamaModel
from agentd.model.loader import ModelConfig, ModelLoadError, UnsupportedModelError

# general.architecture -> model type. Mistral's files say "llama" (same keys, same layout).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}


def model_config(gguf: GgufFile) -> ModelConfig:
    """The model's config from the GGUF header (llama/qwen2/qwen3 keys), in transformers' names;
    ``GgufFile.open`` has held these keys to the tensors (``gguf_check``)."""
    fields, names = gguf.index.fields, gguf.tensors
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{gguf.path.name} has architecture {arch!r}; --weights gguf serves "
            f"{', '.join(ARCHITECTURES)} files, so pass one of those (or a model directory)")

    def key(name: str, default: object = None) -> object:
        return fields.get(f"{arch}.{name}", default)

    hidden, num_heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length") or hidden // num_heads
    if (key("rope.dimension_count") or head_dim) != head_dim:
        raise ModelLoadError(f"{gguf.path.name}: rotary over {key('rope.dimension_count')} of "
                             f"{head_dim} head dims is not supported; pass --weights float32")
    if key("rope.scaling.type", "none") not in ("none", ""):
        raise ModelLoadError(f"{gguf.path.name}: rope scaling {key('rope.scaling.type')!r} is not "
                             "supported by --weights gguf; pass --weights float32 to convert")
    values: dict[str, object] = {
        "model_type": arch,
        "architectures": [ARCHITECTURES[arch]],
        "vocab_size": gguf.info("token_embd.weight").shape[1],
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": key("attention.head_count_kv") or num_heads,
        "head_dim": head_dim,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": key("rope.freq_base", 10000.0),
        "max_position_embeddings": key("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
        "rope_interleaved": arch == "llama",
    }
    if "rope_freqs.weight" in names:  # Llama 3.x: its rope scaling as per-frequency divisors
        values["rope_freq_factors"] = gguf.floats("rope_freqs.weight", head_dim // 2).tolist()
    return ModelConfig(values)


def _parameter(values: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(values, requires_grad=False)


def _swap_attention(gguf: GgufFile, model: LlamaModel, i: int) -> None:
    d, attn = model.dims, model.layers[i].self_attn
    prefix = f"blk.{i}"
    sizes = {"q": attn.q_size, "k": attn.kv_size, "v": attn.kv_size}
    parts = [gguf.rows(f"{prefix}.attn_{p}.weight", rows, d.hidden_size)
             for p, rows in sizes.items()]
    bias = torch.cat([gguf.floats(f"{prefix}.attn_{p}.bias", rows) for p, rows in sizes.items()]
                     ) if d.attention_bias else None
    attn.qkv_proj = FusedQuantLinear(parts, d.hidden_size, bias)
    o_bias = gguf.floats(f"{prefix}.attn_output.bias", d.hidden_size) if d.o_proj_bias else None
    attn.o_proj = QuantLinear(*gguf.rows(f"{prefix}.attn_output.weight", d.hidden_size,
                                         attn.q_size), attn.q_size, o_bias)
    if d.qk_norm:
        attn.q_norm.weight = _parameter(gguf.floats(f"{prefix}.attn_q_norm.weight", d.head_dim))
        attn.k_norm.weight = _parameter(gguf.floats(f"{prefix}.attn_k_norm.weight", d.head_dim))


def _swap_layer(gguf: GgufFile, model: LlamaModel, i: int) -> None:
    d, layer, prefix = model.dims, model.layers[i], f"blk.{i}"
    _swap_attention(gguf, model, i)
    layer.mlp.gate_up_proj = FusedQuantLinear(
        [gguf.rows(f"{prefix}.ffn_{p}.weight", d.intermediate_size, d.hidden_size)
         for p in ("gate", "up")], d.hidden_size)
    layer.mlp.down_proj = QuantLinear(*gguf.rows(f"{prefix}.ffn_down.weight", d.hidden_size,
                                                 d.intermediate_size), d.intermediate_size)
    layer.input_layernorm.weight = _parameter(gguf.floats(f"{prefix}.attn_norm.weight",
                                                          d.hidden_size))
    layer.post_attention_layernorm.weight = _parameter(gguf.floats(f"{prefix}.ffn_norm.weight",
                                                                   d.hidden_size))


def build_model(gguf: GgufFile, config: ModelConfig) -> LlamaModel:
    """The model over ``gguf``'s own tensors (module docstring)."""
    model = LlamaModel(config, device="meta")
    d = model.dims
    embd, embd_type = gguf.rows("token_embd.weight", d.vocab_size, d.hidden_size)
    model.embed_tokens = QuantEmbedding(embd, embd_type, d.hidden_size)
    # A tied head is a product over the very same bytes as the embedding (no copy).
    head = (embd, embd_type) if d.tie_word_embeddings else \
        gguf.rows("output.weight", d.vocab_size, d.hidden_size)
    model.lm_head = QuantLinear(*head, d.hidden_size)
    for i in range(d.num_layers):
        _swap_layer(gguf, model, i)
    model.norm.weight = _parameter(gguf.floats("output_norm.weight", d.hidden_size))
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()]
            if t.is_meta]
    if left:  # a module this loader does not know of: never serve it uninitialized
        raise ModelLoadError(f"{gguf.path.name}: no GGUF tensor for {', '.join(left[:3])}")
    model.use_native_ops()
    return model.eval()


@dataclass(frozen=True)
class GgufModel:
    file: GgufFile
    config: ModelConfig
    model: LlamaModel

    def weight_bytes(self) -> int:
        """Bytes of the quantized weights the model multiplies by (a tied head counted once)."""
        seen: dict[int, int] = {}
        for module in self.model.modules():
            if isinstance(module, QUANT_MODULES):
                for t in module.buffers(recurse=False):
                    if t.dtype == torch.uint8:
                        seen[t.data_ptr()] = t.numel()
        return sum(seen.values())

    def types_by_kind(self) -> dict[str, str]:
        """Each kind of product and the block formats it multiplies (``qkv_proj: Q4_K/Q6_K``)."""
        types: dict[str, set[str]] = {}
        for name, module in self.model.named_modules():
            kind = name.rsplit(".", 1)[-1]
            if isinstance(module, FusedQuantLinear):
                types.setdefault(kind, set()).update(module.type_names)
            elif isinstance(module, (QuantLinear, QuantEmbedding)):
                types.setdefault(kind, set()).add(module.type_name)
        return {kind: "/".join(sorted(names)) for kind, names in types.items()}


def kernel_path() -> str:
    """Which products run: ``agentd.kernels.cpu``'s ISA, or why its extension is not there."""
    if ggml.native_available():
        return ggml.active_isa()
    return f"{ggml.active_isa()} ({ggml.native_unavailable_reason()})"


def load_gguf_model(path: Path) -> GgufModel:
    """Map ``path`` and build its model; the tokenizer is loaded apart (``default_model``)."""
    gguf = GgufFile.open(path, ggml.GGML_TYPES)
    config = model_config(gguf)
    return GgufModel(gguf, config, build_model(gguf, config))
