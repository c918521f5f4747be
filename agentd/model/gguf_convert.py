"""A llama or qwen2 GGUF dequantized to an fp32 Hugging Face directory by agentd's own reader.

This is the conversion behind the default model's exact mode and ``--weights float32``. Why not
transformers' GGUF loading alone: it parses the file twice with gguf-py (its tokenizer arrays
included) and rebuilds gguf's tensor-name map once per tensor, ~15 s for the default model where
this reads the header once and dequantizes with agentd's CPU kernels, ~3 s.

transformers stays the reference. What this writes equals what ``from_pretrained(gguf_file=...)``
builds: each tensor value for value (llama's q/k rows put back in Hugging Face's order as
transformers does), and the config from the same GGUF-to-config key table
(tests/model/test_loader.py holds both to transformers). A file outside what is mirrored here
(another architecture, a llama file that transformers reads as mistral, Llama 3's rope_freqs, a
tensor type agentd does not dequantize, a tensor of unknown role) gets False from
:func:`convert`, and the caller converts it through transformers as before; a file whose header
claims what it does not hold (:mod:`agentd.model.gguf_check`) is a ``GgufHeaderError``, which no
reader would do better with.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch

from agentd.kernels.cpu import GGML_TYPES
from agentd.kernels.cpu import dequantize as dequantize_rows
from agentd.model.gguf_index import GgufFile
from agentd.model.load_errors import GgufHeaderError, ModelLoadError

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
        "output_norm.weight": "model.norm.weight"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def hf_name(name: str) -> str | None:
    """The Hugging Face name of GGUF tensor ``name``, or None for one of no known role."""
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _LAYER \
            or parts[3] not in ("weight", "bias"):
        return None
    return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{parts[3]}"


def unpermute_rows(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order (each head's rotary halves interleaved) back to Hugging Face's."""
    head_half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, head_half, 2, *rows.shape[1:]).transpose(1, 2) \
        .reshape(rows.shape)


def config_dict(gguf: GgufFile) -> dict[str, Any] | None:
    """The config transformers derives from ``gguf``'s header, through its own key table; None
    where this module does not mirror transformers (module docstring)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    fields = gguf.index.fields
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES or "mistral" in str(fields.get("general.name", "")):
        return None
    values: dict[str, Any] = {"model_type": arch}
    if "general.name" in fields:
        values["_model_name_or_path"] = fields["general.name"]
    for prefix in (arch, "tokenizer"):
        for key, renamed in GGUF_CONFIG_MAPPING[prefix].items():
            if renamed is not None and f"{prefix}.{key}" in fields:
                values[renamed] = fields[f"{prefix}.{key}"]
    values.setdefault("vocab_size", gguf.info("token_embd.weight").shape[1])
    values["tie_word_embeddings"] = "output.weight" not in gguf.tensors
    return values


def _tensor(gguf: GgufFile, name: str) -> torch.Tensor | None:
    info = gguf.info(name)
    shape = tuple(reversed(info.shape))  # ggml lists the innermost dim first
    raw = gguf.data[info.offset:info.offset + info.num_bytes]
    if info.type_name in _FLOATS:
        return raw.view(_FLOATS[info.type_name]).reshape(shape).float()
    kind = GGML_TYPES.get(info.type_name)
    if kind is None or len(shape) != 2 or shape[1] % kind.block_weights:
        return None
    return dequantize_rows(raw.view(shape[0], -1), info.type_name, shape[1])


def convert(path: Path, out_dir: Path, weights_file: str) -> bool:
    """Write ``path``'s fp32 weights and config into ``out_dir``; False (nothing written) for a
    file this module leaves to transformers."""
    from safetensors.torch import save_file
    from transformers import CONFIG_MAPPING

    try:
        gguf = GgufFile.open(path)
    except GgufHeaderError:  # a header that lies: no reader will do better with it
        raise
    except (ModelLoadError, ValueError, OSError, struct.error):  # transformers says what is wrong
        return False
    values = config_dict(gguf)
    if values is None or "rope_freqs.weight" in gguf.tensors:
        return False
    names = {t.name: hf_name(t.name) for t in gguf.index.tensors}
    if None in names.values():
        return False
    heads = {"attn_q": values["num_attention_heads"],
             "attn_k": values.get("num_key_value_heads", values["num_attention_heads"])}
    state: dict[str, torch.Tensor] = {}
    for name, target in names.items():
        tensor = _tensor(gguf, name)
        if tensor is None:
            return False
        role = name.split(".")[2] if name.startswith("blk.") else ""
        if values["model_type"] == "llama" and role in heads:
            tensor = unpermute_rows(tensor, heads[role])
        state[target] = tensor.contiguous()
    if values["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)
    config = CONFIG_MAPPING[values["model_type"]].from_dict(values).to_dict()
    config.pop("_name_or_path", None)
    config["architectures"] = [ARCHITECTURES[values["model_type"]]]
    config["dtype"] = config["torch_dtype"] = "float32"  # torch_dtype: transformers 4.x's name
    save_file(state, out_dir / weights_file)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
    return True
