"""Shared fixtures: the default model's files and tiny random models per architecture.

Tiny models reuse the default model's real tokenizer (SmolLM2, 49,152 tokens) so that prompts are
real text; their weights are random, with a wide init so that greedy choices are not near-ties.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from agentd.model.loader import resolve_model

    return resolve_model(None).path


def tiny_config(model_type: str, vocab_size: int = 49152):
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=4096, initializer_range=0.25, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if model_type == "llama":
        return transformers.LlamaConfig(**common)
    if model_type == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None)
    if model_type == "qwen2":
        return transformers.Qwen2Config(**common)
    if model_type == "qwen3":
        return transformers.Qwen3Config(**{**common, "num_key_value_heads": 1}, head_dim=32)
    raise ValueError(model_type)


def build_tiny_model(root: Path, model_type: str, tokenizer_dir: Path, seed: int = 0) -> Path:
    import transformers

    path = root / f"tiny-{model_type}"
    if path.exists():
        return path
    torch.manual_seed(seed)
    config = tiny_config(model_type)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("tiny-models")

    def make(model_type: str) -> Path:
        return build_tiny_model(root, model_type, default_model_dir)

    return make
