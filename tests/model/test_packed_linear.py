"""oneDNN-packed linear layers (the CPU fast path): same math as ``F.linear`` to fp32 rounding,
rows independent of batch size, dense weights dropped, tied LM heads left alone."""

from __future__ import annotations

import os
import subprocess
import sys

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
    nn.init.normal_(model.embed_tokens.weight)  # the tied head's weight: not all zeros
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


_GROWTH_SCRIPT = """
import re, sys, torch
from torch import nn
from agentd.model.llama import PackedLinear, bound_onednn_caches
if sys.argv[1] == "bounded":
    bound_onednn_caches()
def rss_mb():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1024
layers = [PackedLinear(nn.Linear(576, n, bias=False)) for n in (960, 3072)]
def run(rows):
    for m in rows:
        for layer in layers:
            layer(torch.randn(m, 576))
run(range(1, 41))  # fills a bounded cache
before = rss_mb()
run(range(41, 301))
print(rss_mb() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_new_row_counts_do_not_grow_memory_without_bound() -> None:
    """oneDNN compiles a primitive per input shape and, by default, keeps 1,024 of them; a
    daemon sees a new row count nearly every step. Bounded, 260 new row counts cost little."""
    growth = {}
    env = {k: v for k, v in os.environ.items()  # packing in this process set them
           if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    for mode in ("bounded", "default"):
        result = subprocess.run([sys.executable, "-c", _GROWTH_SCRIPT, mode], capture_output=True,
                                text=True, timeout=120, check=True, env=env)
        growth[mode] = float(result.stdout.split()[-1])
    assert growth["default"] > 300, growth  # the failure this guards against is real here
    assert growth["bounded"] < 80, growth
