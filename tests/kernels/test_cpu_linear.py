"""``agentd.kernels.cpu.linear`` / ``linear_multi`` against the float64 reference product on
every type, ragged shapes and batch sizes, on every ISA path this CPU runs.

Tolerances, derived: the int8 kernels multiply the activations as quantized, so against
``reference_linear`` of the *dequantized* int8 activations they differ only by fp32 rounding of
the per-block scaling and accumulation (1e-5 of sum |w| |x|, with K <= 1536 that is over 100x
the expected error). Against the exact fp32 product the quantization adds at most half a step
per activation, sum_i |w_i| * d_block(i) / 2 (d = absmax / 127), which is bounded separately.
The tile path (batches of TILE_MIN_BATCH rows or more) and the torch path multiply exactly
dequantized weights by fp32 activations, so they meet the fp32 bound against the exact product.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import agentd.kernels.cpu as cpu
from agentd.kernels.cpu import reference
from agentd.kernels.cpu.block_formats import ACT_BLOCK, ACT_KIND, GGML_TYPES

# (rows, K) per block size: ragged row counts; K = 160 is no multiple of 256.
SHAPES = {32: [(1, 160), (7, 512), (33, 160), (100, 96)],
          256: [(1, 256), (7, 1536), (33, 512), (100, 256)],
          1: [(1, 160), (7, 200), (33, 8), (100, 77)]}
BATCHES = [1, 2, 7, 16, cpu.TILE_MIN_BATCH]
FP32_RTOL = 1e-5




def _quantized_x(x: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray]:
    """The activations an int8 product multiplies, and each one's quantization step."""
    kind = ACT_KIND[type_name]
    if kind is None:
        return x, np.zeros_like(x)
    blocks = reference.quantize_act(x, kind)
    step = np.repeat(blocks["d"], ACT_BLOCK[kind], axis=1)
    return reference.dequantize_act(blocks), step


BF16_REL = 2.0**-7  # weights, activations and outputs each rounded by <= 2^-9 relative


def _mode(type_name: str, n: int, isa: str) -> str:
    """How cpu.linear multiplies n rows: "int8" kernels, "bf16" or "fp32" tiles and GEMM."""
    if isa != "torch" and type_name != "F32" and not cpu.prefill_on_tiles(type_name, n):
        return "int8"
    bf16 = cpu.bf16_tiles() and type_name != "F32" and n >= cpu.TILE_MIN_BATCH
    return "bf16" if bf16 else "fp32"


def _check(got: np.ndarray, x: np.ndarray, raw: np.ndarray, type_name: str, mode: str) -> None:
    w_abs = np.abs(reference.dequantize(raw, type_name, x.shape[1]).astype(np.float64))
    exact = reference.reference_linear(x, raw, type_name)
    if mode == "bf16":
        np.testing.assert_array_less(np.abs(got - exact),
                                     BF16_REL * (np.abs(x) @ w_abs.T) + 1e-30)
    elif mode == "int8":
        xq, step = _quantized_x(x, type_name)
        as_quantized = reference.reference_linear(xq, raw, type_name)
        np.testing.assert_array_less(np.abs(got - as_quantized),
                                     FP32_RTOL * (np.abs(xq) @ w_abs.T) + 1e-30)
        bound = 0.5 * step @ w_abs.T * (1 + 1e-4) + FP32_RTOL * (np.abs(x) @ w_abs.T)
        np.testing.assert_array_less(np.abs(got - exact), bound + 1e-30)
    else:
        np.testing.assert_array_less(np.abs(got - exact),
                                     FP32_RTOL * (np.abs(x) @ w_abs.T) + 1e-30)


@pytest.mark.parametrize("type_name", list(GGML_TYPES))
def test_linear_matches_reference(type_name: str, isa: str) -> None:
    native = cpu._native()
    if isa != "torch" and type_name != "F32" and type_name not in native.types:
        pytest.skip(f"no native {type_name} kernels in this build: {native.left_out}")
    rng = np.random.default_rng(GGML_TYPES[type_name].type_id)
    for rows, K in SHAPES[GGML_TYPES[type_name].block_weights]:
        raw = reference.random_blocks(rng, type_name, rows, K)
        for n in BATCHES if isa != "torch" else BATCHES[::4]:  # one torch path for every n
            x = rng.standard_normal((n, K)).astype(np.float32)
            got = cpu.linear(torch.from_numpy(x), torch.from_numpy(raw), type_name)
            assert got.shape == (n, rows) and got.dtype == torch.float32
            _check(got.numpy().astype(np.float64), x, raw, type_name, _mode(type_name, n, isa))


@pytest.mark.parametrize("bf16", [True, False])
def test_prefill_batches_on_either_gemm(bf16: bool, isa: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill-sized batches (past the 64-row activation blocks of the int8 kernels) whether
    this CPU has bfloat16 GEMMs or not: the K-quants stay on int8 kernels without them."""
    if bf16 and not cpu.bf16_tiles():
        pytest.skip("oneDNN has no bfloat16 GEMM on this CPU (AVX2 only): the bf16 tiles "
                    "never run here")
    monkeypatch.setattr(cpu, "bf16_tiles", lambda: bf16)
    rng = np.random.default_rng(5)
    for type_name in ("Q4_K", "Q6_K", "Q8_0"):
        raw = reference.random_blocks(rng, type_name, 37, 512)
        x = rng.standard_normal((cpu.TILE_MIN_BATCH * 2 + 3, 512)).astype(np.float32)
        got = cpu.linear(torch.from_numpy(x), torch.from_numpy(raw), type_name)
        mode = _mode(type_name, x.shape[0], isa)
        assert mode == ("bf16" if bf16 else "int8" if type_name in cpu.K_QUANTS and isa != "torch"
                        else "fp32")
        _check(got.numpy().astype(np.float64), x, raw, type_name, mode)


def test_linear_multi_equals_its_parts_side_by_side(isa: str) -> None:
    rng = np.random.default_rng(11)
    parts = [(torch.from_numpy(reference.random_blocks(rng, t, rows, 512)), t)
             for t, rows in [("Q4_K", 64), ("Q6_K", 32), ("Q8_0", 7), ("F16", 5), ("F32", 3)]]
    for n in (1, 5, cpu.TILE_MIN_BATCH):
        x = torch.from_numpy(rng.standard_normal((n, 512)).astype(np.float32))
        fused = cpu.linear_multi(x, parts)
        separate = torch.cat([cpu.linear(x, w, t) for w, t in parts], dim=1)
        # The same quantized activations and kernels; only GEMM blocking may differ.
        torch.testing.assert_close(fused, separate, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16"])
def test_a_row_does_not_depend_on_the_batch_it_shares(type_name: str, isa: str) -> None:
    """Decode batches go through column kernels (several activation rows per weight row):
    each row's result must be the one it gets alone, bit for bit."""
    if isa == "torch":
        pytest.skip("the torch path is a dense GEMM, whose blocking depends on the batch")
    rng = np.random.default_rng(9)
    raw = torch.from_numpy(reference.random_blocks(rng, type_name, 33, 512 + 256))
    x = torch.from_numpy(rng.standard_normal((cpu.TILE_MIN_BATCH - 1, 768)).astype(np.float32))
    batch = cpu.linear(x, raw, type_name)
    for j in (0, 3, 4, 6, x.shape[0] - 1):
        torch.testing.assert_close(batch[j], cpu.linear(x[j:j + 1], raw, type_name)[0], rtol=0,
                                   atol=0)


def test_linear_writes_into_out(isa: str) -> None:
    rng = np.random.default_rng(5)
    raw = torch.from_numpy(reference.random_blocks(rng, "Q4_1", 9, 64))
    x = torch.from_numpy(rng.standard_normal((3, 64)).astype(np.float32))
    out = torch.full((3, 9), float("nan"))
    assert cpu.linear(x, raw, "Q4_1", out=out) is out
    torch.testing.assert_close(out, cpu.linear(x, raw, "Q4_1"), rtol=0, atol=0)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "F16", "BF16"])
def test_bfloat16_tiles_are_the_fp32_values_rounded(type_name: str, isa: str) -> None:
    """Prefill tiles for bfloat16 GEMMs: each value is the exact dequantized one rounded to
    nearest even, as ``Tensor.to(torch.bfloat16)`` rounds it."""
    rng = np.random.default_rng(3)
    K = 512
    raw = torch.from_numpy(reference.random_blocks(rng, type_name, 9, K))
    tile = torch.empty(9, K, dtype=torch.bfloat16)
    cpu._dequantize_into(raw, type_name, K, isa, tile)
    exact = cpu.dequantize(raw, type_name, K)
    assert torch.equal(tile.view(torch.int16), exact.to(torch.bfloat16).view(torch.int16))
