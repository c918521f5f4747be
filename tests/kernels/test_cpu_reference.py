"""The NumPy references and the torch fallback of ``agentd.kernels.cpu`` against gguf's own
dequantizer (an independent oracle), and the activation quantizer's defining properties.

Blocks are random bytes with finite fp16 fields drawn from every finite fp16 (subnormals
included), so each bit of every layout is exercised; dequantized values must agree bit for bit.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from agentd.kernels.cpu import _fallback, reference
from agentd.kernels.cpu.block_formats import ACT_Q8_32, ACT_Q8_256, GGML_TYPES

TYPES = list(GGML_TYPES)


def _k_for(type_name: str) -> int:
    return 512 if GGML_TYPES[type_name].block_weights == 256 else 160


@pytest.mark.parametrize("type_name", TYPES)
def test_reference_dequantize_equals_gguf(type_name: str) -> None:
    rng = np.random.default_rng(GGML_TYPES[type_name].type_id)
    K = _k_for(type_name)
    raw = reference.random_blocks(rng, type_name, 9, K, wild=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gguf's fp16 products overflow on wild scales
        want = gguf_dequantize(raw, GGMLQuantizationType[type_name]).reshape(9, K)
    got = reference.dequantize(raw, type_name, K)
    assert got.dtype == np.float32 and got.shape == (9, K)
    np.testing.assert_array_equal(got, want.astype(np.float32))


@pytest.mark.parametrize("type_name", TYPES)
def test_torch_fallback_dequantize_equals_reference(type_name: str) -> None:
    rng = np.random.default_rng(100 + GGML_TYPES[type_name].type_id)
    K = _k_for(type_name)
    raw = reference.random_blocks(rng, type_name, 5, K, wild=True)
    got = _fallback.dequantize(torch.from_numpy(raw), type_name, K)
    want = reference.dequantize(raw, type_name, K)
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy().view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("kind", [ACT_Q8_32, ACT_Q8_256])
def test_quantize_act_rounds_each_block_to_its_absmax_scale(kind: int) -> None:
    qk = 32 if kind == ACT_Q8_32 else 256
    rng = np.random.default_rng(kind)
    x = (rng.standard_normal((3, 2 * qk)) * np.float32(4)).astype(np.float32)
    x[1, :qk] = 0  # an all-zero block: d = 0, qs = 0
    blocks = reference.quantize_act(x, kind)
    d = blocks["d"]
    amax = np.abs(x).reshape(3, 2, qk).max(-1)
    np.testing.assert_array_equal(d, (amax / np.float32(127)).astype(np.float32))
    assert np.abs(blocks["qs"]).max() == 127 and d[1, 0] == 0 and not blocks["qs"][1, 0].any()
    err = np.abs(reference.dequantize_act(blocks) - x).reshape(3, 2, qk)
    assert np.all(err <= d[..., None] * np.float32(0.5 + 1e-5))
    qs = blocks["qs"].astype(np.int64)
    if kind == ACT_Q8_32:
        np.testing.assert_allclose(blocks["s"], d * qs.sum(-1), rtol=1e-6)
    else:
        np.testing.assert_array_equal(blocks["bsums"], qs.reshape(3, 2, 16, 16).sum(-1))


def test_quantize_act_marks_a_non_finite_block_nan() -> None:
    x = np.ones((1, 64), np.float32)
    x[0, 40] = np.inf
    blocks = reference.quantize_act(x, ACT_Q8_32)
    assert blocks["d"][0, 0] == np.float32(1 / 127) and np.isnan(blocks["d"][0, 1])
    assert not blocks["qs"][0, 1].any()


def test_reference_linear_is_x_times_dequantized_weight() -> None:
    rng = np.random.default_rng(7)
    raw = reference.random_blocks(rng, "Q8_0", 3, 64)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    w = reference.dequantize(raw, "Q8_0", 64).astype(np.float64)
    np.testing.assert_allclose(reference.reference_linear(x, raw, "Q8_0"), x @ w.T, rtol=1e-12)
