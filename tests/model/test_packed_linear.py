"""oneDNN-packed linear layers (the CPU fast path): same math as ``F.linear`` to fp32 rounding,
rows independent of batch size, dense weights dropped, tied LM heads left alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig

from agentd.model.llama import (
    LlamaModel,
    PackedLinear,
    SharedWeightLinear,
    pack_linears,
    packing_unsupported,
)

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="this torch build has no oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_packed_linear_matches_f_linear(bias: bool, dtype: torch.dtype, tolerance: float) -> None:
    if (reason := packing_unsupported(dtype)) is not None:  # the daemon's own probe
        pytest.skip(reason)  # e.g. bf16 on an AVX2-only CPU, where the daemon falls back
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


_FAULTS_SCRIPT = """
import resource, sys
import torch
from agentd.model.onednn import release_free_memory, reuse_large_buffers
if sys.argv[1] == "reuse":
    assert reuse_large_buffers()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():  # a prefill step's activations: 64 MiB buffers, written, freed, allocated again
    for _ in range(32):
        torch.empty(2000, 8192).fill_(1.0)
step()
release_free_memory()  # what the runner does after a long step
before = faults()
step()
print(faults() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or sys.implementation.name != "cpython",
                    reason="glibc's malloc")
def test_large_buffers_come_back_from_the_heap_without_page_faults() -> None:
    """glibc maps and unmaps every buffer of > 32 MiB, so each of a prefill's activations
    arrives as fresh pages, faulted in one by one (a 1.7B model's 2,000-token prefill: 5.2 GB of
    them, ~13% of its time); the daemon keeps them in the heap, handed back after each step."""
    faults = {}
    for mode in ("reuse", "default"):
        result = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT, mode], capture_output=True,
                                text=True, timeout=120, check=True)
        faults[mode] = int(result.stdout.split()[-1])
    pages = 32 * 2000 * 8192 * 4 // 4096  # every buffer's pages
    assert faults["default"] > 0.9 * pages, faults  # the cost this avoids is real here
    # After the trim the heap grows again by a few buffers (one or two here; five once, in a
    # CI worker, where its small allocations fell between them); the rest come back unfaulted.
    assert faults["reuse"] < pages / 4, faults


def test_a_cpu_without_bf16_packing_skips_the_bf16_case_and_the_daemon_falls_back(
        cpu_without_bf16) -> None:
    """On an AVX2-only CPU (the probe answering "no" as oneDNN does there) the bf16 case skips
    with the reason, and a bf16 model keeps torch's dense linears and still runs."""
    reason = packing_unsupported(torch.bfloat16)
    assert reason is not None and "avx512bw" in reason
    assert packing_unsupported(torch.float32) is None
    with pytest.raises(pytest.skip.Exception, match="avx512bw"):
        test_packed_linear_matches_f_linear(False, torch.bfloat16, 3e-2)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaModel(config).to(torch.bfloat16)
    assert pack_linears(model) == 0
    assert not any(isinstance(m, (PackedLinear, SharedWeightLinear)) for m in model.modules())


ISA_DEPENDENT_TESTS = ["tests/model/test_packed_linear.py", "tests/kernels/test_torch_prefill.py",
                       "tests/kernels/test_torch_decode.py"]


def test_isa_dependent_tests_pass_or_skip_on_a_cpu_without_bf16() -> None:
    """The README's test command on an AVX2-only CPU, for every test of an ISA-dependent path:
    nothing fails; each bf16-only test skips naming what the CPU lacks."""
    if os.environ.get("AGENTD_TEST_CPU_WITHOUT_BF16"):
        pytest.skip("already simulating a CPU without bf16")  # never recurse
    from agentd.kernels.cpu import bf16_tiles

    if not bf16_tiles():
        pytest.skip("this CPU has no bfloat16 GEMMs: the suite's own run is the run without them")
    env = {**os.environ, "AGENTD_TEST_CPU_WITHOUT_BF16": "1"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                             "-k", "(bf16 or bfloat16 or dtype1) and not isa_dependent",
                             *ISA_DEPENDENT_TESTS],
                            capture_output=True, text=True, timeout=600, env=env,
                            cwd=Path(__file__).parents[2])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    skipped = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    assert {line.split()[2].split(":")[0] for line in skipped} == set(ISA_DEPENDENT_TESTS)
    assert all("avx512bw" in line or "bfloat16 GEMMs" in line for line in skipped), skipped
