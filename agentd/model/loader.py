"""Find a model on disk and load its config, tokenizer and weights.

Invariant: `resolve_model` returns a `ModelFiles` whose `path` is a complete local Hugging Face
directory (config.json, safetensors or .bin weights, tokenizer files). A `.gguf` (the default
model included) is converted once into the cache by `default_model`, and the converted directory
appears under its final name only when complete; served as it ships (``serve_gguf``), it is not
converted: `gguf` names the file (``served_gguf`` finds it without reading it, so its header is
checked before the tokenizer is built from it) and `path` holds its cached tokenizer files alone.
Every failure a user can fix surfaces as a one-line `ModelLoadError` that says what to do.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentd.model.load_errors import ModelLoadError, UnsupportedModelError
from agentd.model.paths import default_cache_dir

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})

HUB_TIMEOUT_S = 10
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# Keys that say where or with which library version a config was loaded, not what the model is.
_VOLATILE_CONFIG_KEYS = frozenset({"transformers_version"})


@dataclass(frozen=True)
class ModelFiles:
    """A resolved model.

    Attributes:
        path: local Hugging Face directory (config.json, weights, tokenizer files); with
            ``gguf`` set, the tokenizer files only.
        name: the display name the API serves.
        source: what the user passed, or "default".
        gguf: the .gguf served as it ships (its own tensors and header); None otherwise.
    """

    path: Path
    name: str
    source: str
    gguf: Path | None = None


def resolve_model(
    model: str | None, cache_dir: Path | None = None, progress: bool = True,
    serve_gguf: bool = False,
) -> ModelFiles:
    """Turn what the user passed into a local Hugging Face directory.

    Args:
        model: None for the default model, a directory, a .gguf file, or a hub id `org/name`.
        cache_dir: where converted GGUF models live; `default_cache_dir()` when None.
        progress: show progress bars while converting a GGUF.
        serve_gguf: the model must be a .gguf served as it ships: no conversion (module
            docstring); anything else is a `ModelLoadError`.
    Returns:
        The resolved `ModelFiles`.
    """
    from agentd.model import default_model

    cache = cache_dir if cache_dir is not None else default_cache_dir()
    if serve_gguf:
        gguf = served_gguf(model)
        return ModelFiles(path=default_model.ensure_tokenizer(gguf, cache),
                          name=default_model.DEFAULT_MODEL_NAME if model is None
                          else Path(model).expanduser().stem,
                          source="default" if model is None else model, gguf=gguf)
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
    raise _not_found(model)


def served_gguf(model: str | None) -> Path:
    """The .gguf file ``--weights gguf`` serves for ``model`` (None: the default model's), found
    without reading it: the caller checks its header before anything is built from it."""
    from agentd.model import default_model

    if model is None:
        return default_model.default_gguf_path()
    local = Path(model).expanduser()
    if local.is_file() and local.suffix == ".gguf":
        return local.resolve()
    if local.exists() or _HUB_ID.fullmatch(model):
        raise ModelLoadError(
            f"--weights gguf serves a .gguf file's own tensors, and {model} is not one; pass "
            "--model with a .gguf file (or no --model for the default model), or another --weights"
        )
    raise _not_found(model)


def _not_found(model: str) -> ModelLoadError:
    return ModelLoadError(
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


class ModelConfig:
    """A model config read straight from config.json: attribute access like a transformers
    config, without importing transformers' configuration machinery (which pulls in
    torch.distributed and costs ~140 MB of daemon RSS). Keys absent from the file take the
    transformers class defaults below; shape keys must be present."""

    _REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads")
    _DEFAULTS: dict[str, dict[str, Any]] = {
        "llama": {"max_position_embeddings": 2048},
        "mistral": {"max_position_embeddings": 4096 * 32, "sliding_window": 4096},
        "qwen2": {"max_position_embeddings": 32768, "use_sliding_window": False},
        "qwen3": {"max_position_embeddings": 32768, "use_sliding_window": False,
                  "head_dim": 128},
    }
    _COMMON = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
               "attention_bias": False, "head_dim": None, "num_key_value_heads": None,
               "sliding_window": None, "eos_token_id": None, "architectures": None}

    def __init__(self, values: dict[str, Any]) -> None:
        self._values = dict(values)

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__["_values"]
        if name in values:
            return values[name]
        defaults = self._DEFAULTS.get(values.get("model_type"), {})
        if name in defaults:
            return defaults[name]
        if name in self._COMMON:
            return self._COMMON[name]
        raise AttributeError(name)

    def to_dict(self) -> dict[str, Any]:
        return dict(self._values)


def _rope_type(values: dict[str, Any]) -> str:
    params = values.get("rope_parameters") or values.get("rope_scaling") or {}
    return params.get("rope_type", params.get("type", "default")) or "default"


def load_config(files: ModelFiles) -> ModelConfig | PretrainedConfig:
    """Load the model's config; raise `UnsupportedModelError` for architectures we lack.

    Plain RoPE configs are read directly (:class:`ModelConfig`); scaled RoPE variants go through
    transformers' own config class, whose RoPE helpers compute their frequencies.
    """
    try:
        values = json.loads((files.path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {files.path / 'config.json'} ({exc})") from exc
    model_type = values.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{files.name} has model_type {model_type!r} "
            f"(architectures {values.get('architectures')}); agentd supports {_supported()}, "
            "so pass a model of one of those types"
        )
    if _rope_type(values) != "default":
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(files.path)
    missing = [key for key in ModelConfig._REQUIRED if key not in values]
    if missing:
        raise ModelLoadError(f"{files.path / 'config.json'} lacks {', '.join(missing)}")
    return ModelConfig(values)


def _supported() -> str:
    return ", ".join(sorted(SUPPORTED_MODEL_TYPES))


# Tokenizer classes that are nothing but tokenizer.json: loaded without AutoTokenizer, whose
# config lookup imports the heavy part of transformers (see ModelConfig).
_PLAIN_FAST_TOKENIZERS = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def load_tokenizer(files: ModelFiles) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved beside the weights."""
    try:
        tokenizer_config = json.loads((files.path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        tokenizer_config = {}
    try:
        if (tokenizer_config.get("tokenizer_class") in _PLAIN_FAST_TOKENIZERS
                and (files.path / "tokenizer.json").exists()):
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(files.path)
        from transformers import AutoTokenizer

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


def iter_state_dict(
    files: ModelFiles, dtype: torch.dtype | str, device: str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every weight, one at a time, floating-point ones cast to
    ``dtype``. Safetensors shards are read tensor by tensor (memory-mapped), so loading never
    holds a second copy of the model.

    Tied weights (e.g. `lm_head.weight` with `tie_word_embeddings`) may be absent.
    """
    import torch

    target = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    shards = weight_files(files)
    if not shards:
        raise ModelLoadError(
            f"no *.safetensors or pytorch_model*.bin in {files.path}; "
            "pass a directory that holds the model weights"
        )
    for shard in shards:
        if shard.suffix == ".safetensors":
            for key, tensor in _read_safetensors(shard):
                tensor = tensor.to(device)
                yield key, tensor.to(target) if tensor.is_floating_point() else tensor
        else:
            part = torch.load(shard, map_location=device, weights_only=True, mmap=True)
            for key, tensor in part.items():
                yield key, tensor.to(target) if tensor.is_floating_point() else tensor


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
                       "U8": "uint8", "BOOL": "bool"}


def _read_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Read a .safetensors file tensor by tensor with plain reads (8-byte little-endian header
    length, a JSON header of name -> dtype/shape/data_offsets, then the data). Unlike a memory
    map, pages already read do not stay resident, so the file never counts twice in RSS."""
    import torch

    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        base = 8 + header_len
        for key, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:
                raise ModelLoadError(f"{path.name}: tensor {key} has unsupported dtype "
                                     f"{info['dtype']}")
            begin, end = info["data_offsets"]
            tensor = torch.empty(info["shape"], dtype=getattr(torch, dtype))
            raw = tensor.reshape(-1).view(torch.uint8)
            if raw.numel() != end - begin:
                raise ModelLoadError(f"{path.name}: tensor {key} is {end - begin} bytes, expected "
                                     f"{raw.numel()} for shape {info['shape']} {info['dtype']}")
            f.seek(base + begin)
            if raw.numel() and f.readinto(memoryview(raw.numpy())) != raw.numel():
                raise ModelLoadError(f"{path.name} is truncated (tensor {key})")
            yield key, tensor


def load_state_dict(
    files: ModelFiles, dtype: torch.dtype | str, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """Every weight in one dict (see :func:`iter_state_dict`)."""
    return dict(iter_state_dict(files, dtype, device))


# Weight files at least this big have their digest cached (hashing 540 MB takes ~0.3 s).
DIGEST_CACHE_MIN_BYTES = 64 * 2**20
_DIGEST_CHUNK_BYTES = 8 * 2**20


def _hash_file(path: Path) -> str:
    import xxhash

    digest = xxhash.xxh3_128()
    with path.open("rb") as f:
        while chunk := f.read(_DIGEST_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def weights_digest(path: Path, cache_dir: Path | None = None) -> str:
    """The xxh3-128 of a weight file's bytes. Big files' digests are cached under
    ``<cache>/digests``, keyed by the file's resolved path, size and mtime (any rewrite of the
    file changes one of them), so a start hashes the weights only the first time."""
    stat = path.stat()
    if stat.st_size < DIGEST_CACHE_MIN_BYTES:
        return _hash_file(path)
    key = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{stat.st_ino}"
    cached = (cache_dir or default_cache_dir()) / "digests" / (
        hashlib.blake2b(key.encode(), digest_size=16).hexdigest() + ".xxh3")
    try:
        return cached.read_text().strip()
    except OSError:
        pass
    digest = _hash_file(path)
    try:  # a cache we cannot write only costs the next start the same hashing
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f".{cached.name}.{os.getpid()}.tmp")
        tmp.write_text(digest)
        os.replace(tmp, cached)
    except OSError:
        pass
    return digest


def model_fingerprint(
    files: ModelFiles, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, dtype: str
) -> str:
    """A stable hex digest of what determines the model's outputs.

    Hashes the config, the tokenizer's vocab size, chat template and special token ids, the
    dtype, and the weights' contents (``weights_digest`` of the safetensors, or of the .gguf
    served as it ships: a fine-tune with the same shapes gets another fingerprint, so it never
    restores this model's stored KV).
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
        "weights": [[p.name, weights_digest(p)]
                    for p in ([files.gguf] if files.gguf else weight_files(files))],
    }
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()
