"""Build a ready-to-run model from an engine config: files → config → weights → device.

Invariant: the returned model's weights are exactly the checkpoint's, cast to ``dtype``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from agentd.config import EngineConfig
from agentd.kernels import matmul_dtype
from agentd.model.llama import (
    LlamaModel,
    RotaryEmbedding,
    pack_linears,
    release_free_memory,
)
from agentd.model.loader import (
    ModelFiles,
    iter_state_dict,
    load_config,
    load_tokenizer,
    model_fingerprint,
    resolve_model,
)

logger = logging.getLogger("agentd")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    files: ModelFiles
    hf_config: object
    tokenizer: object
    model: LlamaModel
    device: torch.device
    dtype: torch.dtype
    fingerprint: str
    eos_token_ids: list[int]


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def eos_token_ids(hf_config, tokenizer, files: ModelFiles) -> list[int]:
    """Every id that ends a generation: config, generation config and tokenizer agree or add up."""
    ids: set[int] = set()
    for source in (getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    gen_path = files.path / "generation_config.json"
    if gen_path.exists():
        import json

        gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
        ids.update([gen_eos] if isinstance(gen_eos, int) else gen_eos or [])
    return sorted(ids)


def load_model(config: EngineConfig) -> LoadedModel:
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    files = resolve_model(config.model)
    hf_config = load_config(files)
    tokenizer = load_tokenizer(files)
    device = pick_device(config.device)
    dtype = pick_dtype(config.dtype, device)
    # Shapes only: no memory, no random init.
    model = LlamaModel(hf_config, device="meta")
    model = model.to_empty(device="cpu")
    model.load_hf_state_dict(iter_state_dict(files, torch.float32))
    model = model.to(device=device, dtype=dtype).eval()
    num_packed = pack_linears(model) if device.type == "cpu" and config.cpu_linear == "onednn" \
        else 0
    # The cos/sin table stays float32 whatever the weights' dtype (built after the cast).
    model.rotary = RotaryEmbedding(hf_config, model.dims.head_dim,
                                   model.dims.max_position_embeddings).to(device)
    release_free_memory()
    dtype_name = str(dtype).removeprefix("torch.")
    fingerprint = model_fingerprint(files, hf_config, tokenizer, dtype_name)
    logger.info("loaded %s (%s) on %s as %s%s", files.name, hf_config.model_type, device,
                dtype_name, f", {num_packed} linear layers packed for oneDNN" if num_packed else "")
    if config.dtype == "auto" and dtype == torch.float32 and matmul_dtype(
            torch.bfloat16, device) == torch.bfloat16:
        logger.info("this CPU has bfloat16 GEMMs: --dtype bfloat16 is faster (prefill ~2x on "
                    "a 2-core AMD EPYC), at the price of bf16 rounding in the outputs")
    return LoadedModel(files, hf_config, tokenizer, model, device, dtype, fingerprint,
                       eos_token_ids(hf_config, tokenizer, files))
