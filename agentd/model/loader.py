"""Find a model on disk and load its config, tokenizer and weights.

Invariant: `resolve_model` always returns a `ModelFiles` whose `path` is a complete local
Hugging Face directory (config.json, safetensors or .bin weights, tokenizer files). A `.gguf`
(the default model included) is converted once into the cache by `default_model`, and the
converted directory appears under its final name only when complete. Every failure a user can
fix surfaces as a one-line `ModelLoadError` that says what to do.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})

HUB_TIMEOUT_S = 10
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# Keys that say where or with which library version a config was loaded, not what the model is.
_VOLATILE_CONFIG_KEYS = frozenset({"transformers_version"})


class ModelLoadError(Exception):
    """A model could not be found or loaded; the message says what to do."""


class UnsupportedModelError(ModelLoadError):
    """The model's architecture is not one agentd implements."""


@dataclass(frozen=True)
class ModelFiles:
    """A resolved model.

    Attributes:
        path: local Hugging Face directory (config.json, weights, tokenizer files).
        name: the display name the API serves.
        source: what the user passed, or "default".
    """

    path: Path
    name: str
    source: str


def default_cache_dir() -> Path:
    """`$AGENTD_CACHE_DIR`, else `$XDG_CACHE_HOME/agentd`, else `~/.cache/agentd`."""
    if explicit := os.environ.get("AGENTD_CACHE_DIR"):
        return Path(explicit).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "agentd"
    return Path.home() / ".cache" / "agentd"


def resolve_model(
    model: str | None, cache_dir: Path | None = None, progress: bool = True
) -> ModelFiles:
    """Turn what the user passed into a local Hugging Face directory.

    Args:
        model: None for the default model, a directory, a .gguf file, or a hub id `org/name`.
        cache_dir: where converted GGUF models live; `default_cache_dir()` when None.
        progress: show progress bars while converting a GGUF.
    Returns:
        The resolved `ModelFiles`.
    """
    from agentd.model import default_model

    cache = cache_dir if cache_dir is not None else default_cache_dir()
    if model is None:
        gguf = default_model.default_gguf_path()
        path = default_model.ensure_converted(gguf, cache, progress=progress)
        return ModelFiles(path=path, name=default_model.DEFAULT_MODEL_NAME, source="default")
    local = Path(model).expanduser()
    if local.is_dir():
        return ModelFiles(path=_check_hf_dir(local), name=local.resolve().name, source=model)
    if local.is_file():
        if local.suffix != ".gguf":
            raise ModelLoadError(
                f"{model} is a file but not a .gguf; pass a .gguf file or a model directory"
            )
        path = default_model.ensure_converted(local, cache, progress=progress)
        return ModelFiles(path=path, name=local.stem, source=model)
    if _HUB_ID.fullmatch(model) and not model.endswith(".gguf"):
        return ModelFiles(path=_check_hf_dir(_fetch_from_hub(model)), name=model, source=model)
    raise ModelLoadError(
        f"model not found: {model}; pass an existing model directory, a .gguf file, "
        "or a Hugging Face hub id such as org/name"
    )


def _check_hf_dir(path: Path) -> Path:
    path = path.resolve()
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"{path} has no config.json; pass a Hugging Face model directory or a .gguf file"
        )
    return path


def _fetch_from_hub(repo_id: str) -> Path:
    # huggingface_hub reads these when first imported; setdefault keeps a user's own choice.
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", str(HUB_TIMEOUT_S))
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", str(HUB_TIMEOUT_S))
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not cached locally; go online below
        pass
    try:
        path = snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS, etag_timeout=HUB_TIMEOUT_S)
    except Exception as exc:  # any hub failure becomes one user-facing line
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(
            f"could not fetch {repo_id} from the Hugging Face hub ({reason}); "
            "pass a local directory or a .gguf file instead"
        ) from exc
    return Path(path)


def load_config(files: ModelFiles) -> PretrainedConfig:
    """Load the model's config; raise `UnsupportedModelError` for architectures we lack."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(files.path)
    except ValueError as exc:  # unknown model_type: transformers itself cannot read it
        raise UnsupportedModelError(
            f"cannot read the config of {files.name} ({exc}); "
            f"agentd supports model types {_supported()}"
        ) from exc
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{files.name} has model_type {config.model_type!r} "
            f"(architectures {config.architectures}); agentd supports {_supported()}, "
            "so pass a model of one of those types"
        )
    return config


def _supported() -> str:
    return ", ".join(sorted(SUPPORTED_MODEL_TYPES))


def load_tokenizer(files: ModelFiles) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved beside the weights."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(files.path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"cannot load the tokenizer of {files.name} from {files.path} ({exc}); "
            "the directory needs tokenizer.json or tokenizer.model beside config.json"
        ) from exc


def weight_files(files: ModelFiles) -> list[Path]:
    """The model's `*.safetensors` shards, else its `pytorch_model*.bin` shards, sorted."""
    shards = sorted(files.path.glob("*.safetensors"))
    return shards or sorted(files.path.glob("pytorch_model*.bin"))


def load_state_dict(
    files: ModelFiles, dtype: torch.dtype | str, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """Load every weight shard, casting floating-point tensors to `dtype`.

    Tied weights (e.g. `lm_head.weight` with `tie_word_embeddings`) may be absent.
    """
    import torch
    from safetensors.torch import load_file

    target = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    shards = weight_files(files)
    if not shards:
        raise ModelLoadError(
            f"no *.safetensors or pytorch_model*.bin in {files.path}; "
            "pass a directory that holds the model weights"
        )
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        if shard.suffix == ".safetensors":
            part = load_file(shard, device=device)
        else:
            part = torch.load(shard, map_location=device, weights_only=True)
        state.update(part)
    return {key: t.to(target) if t.is_floating_point() else t for key, t in state.items()}


def model_fingerprint(
    files: ModelFiles, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, dtype: str
) -> str:
    """A stable hex digest of what determines the model's outputs.

    Hashes the config, the tokenizer's vocab size, chat template and special token ids, the
    dtype, and the weight files' names and sizes (sizes, not contents, to stay fast).
    """
    config_dict = {
        key: value
        for key, value in config.to_dict().items()
        if not key.startswith("_") and key not in _VOLATILE_CONFIG_KEYS
    }
    special_ids = {
        name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")
    }
    parts: dict[str, Any] = {
        "config": config_dict,
        "vocab_size": len(tokenizer),
        "chat_template": getattr(tokenizer, "chat_template", None),
        "special_ids": special_ids,
        "all_special_ids": sorted(tokenizer.all_special_ids),
        "dtype": dtype,
        "weights": [[p.name, p.stat().st_size] for p in weight_files(files)],
    }
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()
