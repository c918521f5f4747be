"""Build a ready-to-run model from an engine config: files → config → weights → device.

Invariant: the returned model's weights are exactly the checkpoint's, cast to ``dtype``, unless a
low-precision weight format (``--weights``) was asked for; then its linear layers hold that format
(a GGUF's 4-bit groups as they are, for int4; the GGUF's own memory-mapped blocks, for gguf: the
default for a .gguf on the CPU) and ``weights`` says so.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from agentd.config import EngineConfig
from agentd.kernels import matmul_dtype
from agentd.model.context import extend_context
from agentd.model.dispatch import KernelChoice, calibrate, install, pick_auto
from agentd.model.isa import CpuIsa, detect_isa
from agentd.model.llama import LlamaModel, ModelDims, RotaryEmbedding
from agentd.model.loader import (
    ModelFiles,
    iter_state_dict,
    load_config,
    load_tokenizer,
    model_fingerprint,
    resolve_model,
    served_gguf,
)
from agentd.model.onednn import pack_linears, release_free_memory, reuse_large_buffers
from agentd.model.quant import IntGroups

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
    weights: str = "float32"  # the linear layers' format (dispatch.WEIGHT_FORMATS, or "gguf")
    isa: CpuIsa | None = None  # None off the CPU
    kernels: dict[str, KernelChoice] = field(default_factory=dict)

    def compute_report(self) -> dict[str, object]:
        """What ``/v1/stats``, ``agentd status`` and ``agentd bench`` print about the kernels."""
        return {
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "weights": self.weights,
            "isa": self.isa.name if self.isa else None,
            "isa_detail": self.isa.describe() if self.isa else None,
            "kernels": {kind: c.describe() for kind, c in self.kernels.items()},
        }


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


def gguf_source(files: ModelFiles) -> Path | None:
    """The .gguf a model was converted from, if it was (the default model is one)."""
    if files.source == "default":
        from agentd.model.default_model import default_gguf_path

        return default_gguf_path()
    path = Path(files.source).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def fused_int4_groups(model: LlamaModel, files: ModelFiles) -> dict[str, IntGroups]:
    """The GGUF source's 4-bit layers as int4 groups under the model's fused names (q/k/v and
    gate/up stacked); a fused layer any of whose parts is not 4-bit is left out."""
    from agentd.model.gguf_groups import read_int4_groups

    path = gguf_source(files)
    if path is None:
        return {}
    parts: dict[str, list[tuple[int, IntGroups]]] = {}
    for name, groups in read_int4_groups(path).items():
        key, rows = model._fused_target(name.removeprefix("model."))
        parts.setdefault(key, []).append((0 if rows is None else rows.start, groups))
    own = model.state_dict()
    fused = {}
    for key, pieces in parts.items():
        stacked = IntGroups.cat([g for _, g in sorted(pieces, key=lambda p: p[0])])
        if stacked.values.shape == own[key].shape:
            fused[key] = stacked
    return fused


def pick_weights(config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 hf_config) -> str:
    """The weight format to load: ``None`` follows ``--dtype``; ``auto`` measures (CPU only)."""
    if config.weights is None or device.type != "cpu":
        return str(dtype).removeprefix("torch.")
    if config.weights == "auto":
        dims = ModelDims.from_config(hf_config)
        chosen, timings = pick_auto(detect_isa(), dims.hidden_size, dims.vocab_size)
        logger.info("--weights auto: %s (one decode row on a %dx%d matrix, ms: %s)", chosen,
                    dims.vocab_size, dims.hidden_size, timings)
        return chosen
    return config.weights


def install_weights(model: LlamaModel, weights: str, files: ModelFiles,
                    config: EngineConfig) -> dict[str, KernelChoice]:
    """Put the low-precision layers in and measure their kernels; ``{}`` for the exact mode."""
    if weights in ("float32", str(next(model.parameters()).dtype).removeprefix("torch.")):
        return {}
    isa = detect_isa()
    start = time.perf_counter()
    groups = fused_int4_groups(model, files) if weights == "int4" else {}
    num_swapped = install(model, weights, groups, isa, config.prefill_weights == "keep")
    del groups
    release_free_memory()
    loaded_s = time.perf_counter() - start
    kernels = calibrate(model, isa, config.max_num_batched_tokens)
    logger.info("weights %s: %d linear layers (%s, %.1f s); kernels on %s, measured in %.1f s: "
                "%s", weights, num_swapped, "4-bit groups from the GGUF as they are"
                if weights == "int4" and gguf_source(files) else "converted at load", loaded_s,
                isa.describe(), time.perf_counter() - start - loaded_s,
                "; ".join(f"{kind} {c.describe()}" for kind, c in kernels.items()))
    return kernels


def serves_gguf(config: EngineConfig, device: torch.device) -> bool:
    """Whether to serve a GGUF's own blocks: ``--weights gguf``, or by default a .gguf on the CPU
    with float32 activations: a file passed with ``--model``, and the default model, which ships
    as a Q4_1 GGUF (an fp32 upcast is no more exact than the file, costs 4-8x its memory, and
    decodes ~4x slower on an AVX2 CPU). ``--weights float32`` keeps the exact fp32 conversion."""
    if config.weights == "gguf":
        if device.type != "cpu":
            raise ValueError("--weights gguf runs on the CPU only; pass --device cpu")
        return True
    if config.weights is not None or device.type != "cpu" or \
            config.dtype not in ("auto", "float32"):
        return False
    if config.model is None:
        return True
    model = Path(config.model).expanduser()
    return model.suffix == ".gguf" and model.is_file()


def load_gguf(config: EngineConfig) -> LoadedModel:
    """The GGUF served as it ships (agentd.model.gguf_model): float32 activations, the file's
    blocks multiplied by agentd.kernels.cpu."""
    from agentd.model.gguf_model import kernel_path, load_gguf_model

    start = time.perf_counter()
    # The header is checked and the model built before the tokenizer is built from the file's
    # metadata: a damaged file is one line about the file, not a tokenizer error seconds later.
    gguf = load_gguf_model(served_gguf(config.model))
    files = resolve_model(config.model, serve_gguf=True)
    if extend_context(gguf.config, config.context_target) is not None:
        model = gguf.model  # its frequencies stretched; the engine sizes its table
        model.dims = dataclasses.replace(model.dims,
                                         max_position_embeddings=config.context_target)
        model.rotary = RotaryEmbedding(gguf.config, model.dims.head_dim,
                                       model.rotary.num_positions)
    if config.mlock:
        locking = time.perf_counter()
        problem = gguf.file.lock()
        if problem is None:
            logger.info("--mlock: %s's %.0f MiB locked in RAM in %.1f s", files.name,
                        gguf.file.data.numel() / 2**20, time.perf_counter() - locking)
        else:
            logger.warning("--mlock: %s's weights stay paged from the file: %s", files.name,
                           problem)
    tokenizer = load_tokenizer(files)
    fingerprint = model_fingerprint(files, gguf.config, tokenizer, "float32+weights-gguf")
    isa = detect_isa()
    kernels = {kind: KernelChoice(f"{types} blocks on {kernel_path()}", None, "")
               for kind, types in gguf.types_by_kind().items()}
    logger.info("loaded %s (%s) from its GGUF as it ships in %.1f s: %s; %.0f MiB of weights "
                "memory-mapped; kernels on %s; CPU %s", files.name, gguf.config.model_type,
                time.perf_counter() - start, gguf.file.type_counts(), gguf.weight_bytes() / 2**20,
                kernel_path(), isa.describe())
    if config.model is None and config.weights is None:
        logger.info("the default model is served from its Q4_1 file as it ships; --weights "
                    "float32 serves the exact fp32 conversion (same tokens as transformers, "
                    "decode ~4x slower on an AVX2 CPU)")
    return LoadedModel(files, gguf.config, tokenizer, gguf.model, torch.device("cpu"),
                       torch.float32, fingerprint, eos_token_ids(gguf.config, tokenizer, files),
                       "gguf", isa, kernels)


def load_model(config: EngineConfig) -> LoadedModel:
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    device = pick_device(config.device)
    if device.type == "cpu":
        reuse_large_buffers()
    if serves_gguf(config, device):
        return load_gguf(config)
    if config.mlock:
        logger.info("--mlock locks a GGUF's mapped weights; these are loaded into the "
                    "process's own memory, which --mlock leaves as it is")
    files = resolve_model(config.model)
    hf_config = load_config(files)
    extend_context(hf_config, config.context_target)
    tokenizer = load_tokenizer(files)
    dtype = pick_dtype(config.dtype, device)
    weights = pick_weights(config, device, dtype, hf_config)
    # Shapes only: no memory, no random init.
    model = LlamaModel(hf_config, device="meta").materialize("cpu")
    model.load_hf_state_dict(iter_state_dict(files, torch.float32))
    model = model.to(device=device, dtype=dtype).eval()
    kernels = install_weights(model, weights, files, config)
    num_packed = pack_linears(model) if device.type == "cpu" and config.cpu_linear == "onednn" \
        else 0
    # The cos/sin table stays float32 whatever the weights' dtype (built after the cast); the
    # engine fits it to the context it serves.
    model.fit_context(model.rotary.num_positions)
    release_free_memory()
    dtype_name = str(dtype).removeprefix("torch.")
    # A weight format other than the dtype changes every output: it is part of the fingerprint.
    fingerprint = model_fingerprint(files, hf_config, tokenizer,
                                    dtype_name if weights == dtype_name else
                                    f"{dtype_name}+weights-{weights}")
    isa = detect_isa() if device.type == "cpu" else None
    logger.info("loaded %s (%s) on %s as %s, weights %s%s%s", files.name, hf_config.model_type,
                device, dtype_name, weights,
                f", {num_packed} linear layers packed for oneDNN" if num_packed else "",
                f"; CPU {isa.describe()}" if isa else "")
    if config.weights is None and device.type == "cpu" and weights == "float32":
        logger.info("decode reads every weight once per token: --weights auto keeps the "
                    "weights in the fastest accurate low-precision format measured here (int4 "
                    "holds a Q4 GGUF's own groups) and leaves prefill as it is; docs/weights.md, "
                    "Weight formats, gives its accuracy")
    if config.dtype == "auto" and dtype == torch.float32 and weights == "float32" and \
            matmul_dtype(torch.bfloat16, device) == torch.bfloat16:
        logger.info("this CPU has bfloat16 GEMMs: --dtype bfloat16 is faster (prefill ~2x on "
                    "a 2-core AMD EPYC), at the price of bf16 rounding in the outputs")
    return LoadedModel(files, hf_config, tokenizer, model, device, dtype, fingerprint,
                       eos_token_ids(hf_config, tokenizer, files), weights, isa, kernels)
