"""oneDNN-packed linear layers (the CPU fast path): same math as ``F.linear`` to fp32 rounding,
rows independent of batch size, dense weights dropped, tied LM heads left alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig

from agentd.model.llama import LlamaModel, PackedLinear, SharedWeightLinear, pack_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="this torch build has no oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_packed_linear_matches_f_linear(bias: bool, dtype: torch.dtype, tolerance: float) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias).to(dtype)
    packed = PackedLinear(linear)
    for shape in [(1, 96), (7, 96), (300, 96), (2, 5, 96)]:
        x = torch.randn(shape, dtype=dtype)
        expected = F.linear(x.float(), linear.weight.float(),
                            None if linear.bias is None else linear.bias.float())
        got = packed(x)
        assert got.dtype == dtype and got.shape == expected.shape
        torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)


def test_a_row_does_not_depend_on_the_batch_it_runs_in() -> None:
    """What keeps greedy outputs equal alone and batched at the GEMM level."""
    torch.manual_seed(0)
    packed = PackedLinear(nn.Linear(576, 1536, bias=False))
    rows = torch.randn(64, 576)
    alone = torch.cat([packed(rows[i:i + 1]) for i in range(len(rows))])
    for size in (2, 8, 27, 64):
        batched = torch.cat([packed(rows[i:i + size]) for i in range(0, len(rows), size)])
        assert torch.equal(batched, alone), size


@pytest.mark.parametrize("tie", [True, False])
def test_pack_linears_swaps_every_layer_and_keeps_a_tied_head_dense(tie: bool) -> None:
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    model = LlamaModel(config)
    num_linears = sum(type(m) is nn.Linear for m in model.modules())
    x = torch.randn(5, 32)
    head = model.lm_head(x)
    mlp = model.layers[0].mlp.gate_up_proj(x)
    assert pack_linears(model) == num_linears - (1 if tie else 0)
    assert isinstance(model.layers[0].mlp.gate_up_proj, PackedLinear)
    assert isinstance(model.lm_head, SharedWeightLinear if tie else PackedLinear)
    if tie:  # still one tensor: the embedding lookup needs it dense
        assert model.lm_head.weight is model.embed_tokens.weight
    torch.testing.assert_close(model.layers[0].mlp.gate_up_proj(x), mlp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.lm_head(x), head, atol=1e-5, rtol=1e-5)
    assert not any(type(m) is nn.Linear for m in model.layers.modules())  # no dense copy kept


def test_nothing_is_packed_off_cpu_or_in_float16() -> None:
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4)
    model = LlamaModel(config).to(torch.float16)
    assert pack_linears(model) == 0
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
