"""A context past the model's own: RoPE stretched with YaRN (transformers' ``yarn`` RoPE type is
the oracle), served end to end on a tiny model, fingerprinted apart, and said once."""

from __future__ import annotations

import logging

import pytest
import torch

from agentd import LLM, SamplingParams
from agentd.model.context import extend_context, yarn_inv_freq
from agentd.model.load_errors import ModelLoadError
from agentd.model.loader import ModelConfig


@pytest.mark.parametrize("theta, head_dim, trained, factor", [
    (10000.0, 64, 8192, 4.0), (100000.0, 64, 8192, 2.0), (500000.0, 128, 4096, 8.0)])
def test_yarn_frequencies_are_transformers(theta: float, head_dim: int, trained: int,
                                           factor: float) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=int(trained * factor),
                         rope_parameters={"rope_type": "yarn", "factor": factor,
                                          "rope_theta": theta,
                                          "original_max_position_embeddings": trained})
    want, want_scale = ROPE_INIT_FUNCTIONS["yarn"](config, torch.device("cpu"))
    got, scale = yarn_inv_freq(theta, head_dim, factor, trained)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(want_scale)


def test_a_model_stretched_past_its_context_serves_a_longer_prompt(tiny_model_factory,
                                                                   caplog) -> None:
    path = tiny_model_factory("llama")
    plain = LLM(str(path), device="cpu", dtype="float32")
    trained = plain.engine.max_model_len
    caplog.set_level(logging.WARNING, logger="agentd")
    stretched = LLM(str(path), device="cpu", dtype="float32", max_model_len=2 * trained)
    assert stretched.engine.max_model_len == 2 * trained
    assert sum("stretched with YaRN" in r.getMessage() for r in caplog.records) == 1
    assert stretched.engine.fingerprint != plain.engine.fingerprint  # its KV is its own
    prompt = list(range(3, 3 + trained + trained // 2))  # past the trained context
    (out,) = stretched.generate([prompt], SamplingParams(temperature=0, max_tokens=4))
    assert len(out.token_ids) == 4
    with pytest.raises(ValueError, match="context"):
        plain.generate([prompt], SamplingParams(max_tokens=1))


def test_a_model_whose_rope_is_scaled_already_is_not_stretched_again() -> None:
    config = ModelConfig({"model_type": "llama", "max_position_embeddings": 4096,
                          "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ModelLoadError, match="scaled already"):
        extend_context(config, 8192)
    assert extend_context(config, 4096) is None  # not past its context: nothing to do
