"""Weight formats: GGUF 4-bit blocks read as int4 groups, and the weight-only layers' products."""

from __future__ import annotations

import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from agentd.config import EngineConfig
from agentd.engine.sampling_params import SamplingParams
from agentd.llm import LLM
from agentd.model.dispatch import ACCURATE_FORMATS, calibrate
from agentd.model.gguf_groups import int4_groups, read_int4_groups
from agentd.model.gguf_header import read_index
from agentd.model.isa import CpuIsa, detect_isa
from agentd.model.quant import (
    HalfLinear,
    Int4Linear,
    Int8Linear,
    IntGroups,
    LowPrecisionLinear,
    make_linear,
    quantize_int4,
)

OUT, IN = 128, 256


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random raw blocks of a ggml type with finite fp16 scales: ``[rows, bytes per row]``."""
    qtype = gguf.GGMLQuantizationType[type_name]
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // block_weights, block_bytes), dtype=np.uint8)
    scale_bytes = 4 if type_name in ("Q4_1", "Q4_K") else 2  # d (and m or dmin) lead the block
    scales = (rng.random((blocks.shape[0], scale_bytes // 2)) * 0.02).astype(np.float16)
    blocks[:, :scale_bytes] = scales.view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_groups_dequantize_as_gguf_does(type_name: str) -> None:
    raw = random_blocks(type_name, OUT, IN)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    groups = int4_groups(raw, type_name, OUT, IN)
    assert groups.values.dtype == torch.uint8 and int(groups.values.max()) <= 15
    assert groups.scales.shape == (OUT, IN // 32)
    torch.testing.assert_close(groups.dequantize(), torch.from_numpy(expected),
                               rtol=1e-6, atol=1e-6)  # fp32 rounding of (q - 8) s + z


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, str]]) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.attention.head_count", 4)
    writer.add_uint32(f"{arch}.attention.head_count_kv", 2)
    writer.add_token_list(["a", "b", "c"])  # an array of strings the index skips
    for name, (data, type_name) in tensors.items():
        qtype = gguf.GGMLQuantizationType[type_name]
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_read_int4_groups_maps_names_and_unpermutes_llama_q_and_k(tmp_path: Path) -> None:
    q_raw, v_raw = random_blocks("Q4_1", OUT, IN, 1), random_blocks("Q4_0", 64, IN, 2)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", {
        "blk.0.attn_q.weight": (q_raw, "Q4_1"),
        "blk.0.attn_v.weight": (v_raw, "Q4_0"),
        "blk.0.attn_norm.weight": (np.ones(IN, dtype=np.float32), "F32"),
    })
    index = read_index(path)
    assert index.fields["llama.attention.head_count"] == 4
    assert [t.type_name for t in index.tensors] == ["Q4_1", "Q4_0", "F32"]
    groups = read_int4_groups(path)
    assert set(groups) == {"model.layers.0.self_attn.q_proj.weight",
                           "model.layers.0.self_attn.v_proj.weight"}
    q = torch.from_numpy(gguf.quants.dequantize(q_raw, gguf.GGMLQuantizationType.Q4_1))
    # llama.cpp interleaves each head's rotary halves; transformers' loader undoes it.
    unpermuted = q.reshape(4, OUT // 8, 2, IN).transpose(1, 2).reshape(OUT, IN)
    torch.testing.assert_close(groups["model.layers.0.self_attn.q_proj.weight"].dequantize(),
                               unpermuted)
    v = torch.from_numpy(gguf.quants.dequantize(v_raw, gguf.GGMLQuantizationType.Q4_0))
    torch.testing.assert_close(groups["model.layers.0.self_attn.v_proj.weight"].dequantize(), v)


def bf16_products(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The reference of a weight-only layer: bf16 inputs, fp32 accumulation."""
    return x.bfloat16().float() @ weight.t()


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_int4_kernel_and_dense_paths_multiply_by_the_groups(rows: int) -> None:
    groups = quantize_int4(torch.randn(OUT, IN) * 0.05)
    layer = Int4Linear(groups, bias=torch.randn(OUT))
    held = layer.groups()  # scales and zeros as the kernel holds them (bf16)
    torch.testing.assert_close(held.values, groups.values, rtol=0, atol=0)
    torch.testing.assert_close(held.dequantize(), groups.dequantize(), rtol=0, atol=2e-3)
    weight = held.dequantize()
    x = torch.randn(rows, IN)
    expected = x @ weight.t() + layer.bias
    torch.testing.assert_close(layer.kernel(x) + layer.bias, expected, rtol=0.02, atol=0.05)
    torch.testing.assert_close(layer.dense(x) + layer.bias, expected, rtol=1e-4, atol=1e-4)
    layer.max_kernel_rows = 0  # dense for every row count, bias included
    torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-4)


def test_quantize_int4_error_is_within_half_a_step() -> None:
    weight = torch.randn(OUT, IN)
    groups = quantize_int4(weight)
    step = groups.scales.repeat_interleave(32, dim=1)
    assert ((groups.dequantize() - weight).abs() <= step / 2 + 1e-6).all()


def test_int8_and_half_layers() -> None:
    weight, x = torch.randn(OUT, IN) * 0.05, torch.randn(5, IN)
    int8 = Int8Linear(weight)
    torch.testing.assert_close(int8.dense_weight(torch.float32), weight, rtol=0,
                               atol=float(weight.abs().max()) / 127)
    torch.testing.assert_close(int8.kernel(x), x @ weight.t(), rtol=0.02, atol=0.05)
    for dtype in (torch.bfloat16, torch.float16):
        half = HalfLinear(weight, dtype, onednn=False)
        torch.testing.assert_close(half(x), F.linear(x.to(dtype), weight.to(dtype)).float())


def test_make_linear_keeps_shapes_the_int4_kernel_cannot_take() -> None:
    assert make_linear("int4", torch.randn(100, IN), None, False) is None  # 100 rows: no block
    layer = make_linear("int4", IntGroups.cat([quantize_int4(torch.randn(64, IN))] * 2), None,
                        False)
    assert isinstance(layer, Int4Linear) and layer.out_features == 128


def test_a_kept_dense_twin_serves_big_calls() -> None:
    weight = torch.randn(OUT, IN) * 0.05
    layer = Int4Linear(quantize_int4(weight), bias=torch.ones(OUT))
    twin = torch.nn.Linear(IN, OUT, bias=False)
    twin.weight.data = weight
    layer.keep_dense_twin(twin)
    layer.max_kernel_rows = 4
    x = torch.randn(9, IN)
    torch.testing.assert_close(layer(x), x @ weight.t() + 1)  # exact: the twin's fp32 GEMM
    assert not torch.allclose(layer(x[:4]), x[:4] @ weight.t() + 1, rtol=0, atol=1e-5)


@pytest.mark.parametrize("weights", ["bfloat16", "float16", "int8", "int4"])
def test_each_weight_format_serves_a_tiny_model(weights: str, tiny_model_factory) -> None:
    path = str(tiny_model_factory("llama"))
    exact = LLM(path, device="cpu", dtype="float32", weights="float32",
                kv_cache_memory_bytes=4 * 2**20)
    llm = LLM(path, device="cpu", dtype="float32", weights=weights,
              kv_cache_memory_bytes=4 * 2**20, enable_prefix_caching=False)
    loaded = llm.engine.loaded
    report = loaded.compute_report()
    assert report["weights"] == weights and report["isa"] == detect_isa().name
    assert set(report["kernels"]) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj",
                                      "lm_head", "attention"}
    # the exact mode's float32 pool keeps prefill attention's products in fp32
    exact_kernels = exact.engine.loaded.compute_report()["kernels"]
    assert exact_kernels["attention"].endswith("prefill products in fp32 (all rows)")
    layers = [m for m in loaded.model.modules() if isinstance(m, LowPrecisionLinear)]
    assert len(layers) == 2 * 4 + 1 and all(m.dense_twin is not None for m in layers)
    if weights == "int4":  # a head not held in 4 bits by the checkpoint is kept in fp16
        assert isinstance(loaded.model.lm_head, HalfLinear)
        assert loaded.model.lm_head.dtype == torch.float16
    assert loaded.fingerprint != exact.engine.loaded.fingerprint  # its KV is its own
    prompts = [[1, 2, 3, 4, 5], list(range(10, 60)), list(range(100, 120))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert [len(o.token_ids) for o in llm.generate(prompts, params)] == [6, 6, 6]
    for layer in layers:  # every product on the kept fp32 twins: the exact mode's own numbers
        layer.max_kernel_rows = 0
    expected = [o.token_ids for o in exact.generate(prompts, params)]
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.stats().pool.num_blocks_used == 0


def test_weights_auto_picks_an_accurate_format_and_bad_pairs_fail(tiny_model_factory) -> None:
    llm = LLM(str(tiny_model_factory("llama")), device="cpu", weights="auto",
              kv_cache_memory_bytes=4 * 2**20)
    assert llm.engine.loaded.weights in ACCURATE_FORMATS
    with pytest.raises(ValueError, match="weights must be one of"):
        EngineConfig(weights="int3")
    with pytest.raises(ValueError, match="weights float32 needs dtype float32"):
        EngineConfig(weights="float32", dtype="bfloat16")
    with pytest.raises(ValueError, match="prefill_weights must be keep or dequantize"):
        EngineConfig(weights="int4", prefill_weights="sometimes")


class _TimedLayer(LowPrecisionLinear):
    """A layer whose two paths cost known times: the kernel ``kernel_ms`` per row, the dense
    path ``dense_ms`` whatever the rows; it counts its calls."""

    kernel_name = "timed"

    def __init__(self, kernel_ms: float, dense_ms: float) -> None:
        super().__init__(8, 8, None)
        self.kernel_ms, self.dense_ms = kernel_ms, dense_ms
        self.dense_twin = nn.Identity()  # named a dense twin in the report
        self.calls = 0

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        time.sleep(self.kernel_ms * x.shape[0] / 1e3)
        return x

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        time.sleep(self.dense_ms / 1e3)
        return x


def test_calibration_sweeps_every_layer_and_keeps_the_kernel_while_it_wins() -> None:
    # kernel 1 ms a row vs dense 6 ms: it wins at 1 and 4 rows, loses at 8 -> "<= 4 rows";
    # o_proj's kernel always wins (every row count), down_proj's never (0 rows).
    costs = {"qkv_proj": (1.0, 6.0), "o_proj": (0.0, 3.0), "down_proj": (20.0, 1.0)}
    blocks = nn.ModuleList(nn.ModuleDict({kind: _TimedLayer(*cost) for kind, cost in
                                          costs.items()}) for _ in range(2))
    model = nn.Module()
    model.layers = blocks
    isa = CpuIsa(("avx2",), "AVX2", bf16_gemm=False, amx=False, name="AVX2")
    choices = calibrate(model, isa, max_rows=16)
    assert {kind: c.max_kernel_rows for kind, c in choices.items()} == {
        "qkv_proj": 4, "o_proj": None, "down_proj": 0}
    assert [c.describe() for c in choices.values()] == [
        "timed <= 4 rows, else dense twin (oneDNN)", "timed (all rows)",
        "timed <= 0 rows, else dense twin (oneDNN)"]
    assert all(layer.max_kernel_rows == choices[kind].max_kernel_rows
               for block in blocks for kind, layer in block.items())
    # every layer ran in every sweep (one warming, two timed), for each path at rows 1, 4, 8, 16
    assert {layer.calls for block in blocks for layer in block.values()} == {4 * 2 * 3}
