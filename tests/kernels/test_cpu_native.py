"""The C++ extension of ``agentd.kernels.cpu`` against the NumPy references, on every ISA path
this CPU runs (``AGENTD_CPU_ISA`` lowers the path): dequantized rows and quantized activation
blocks bit for bit, rows read through an mmap-like odd offset; and the behaviour around the
build: the forced-ISA switch, the torch path when no compiler exists, errors that name the fix.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import agentd.kernels.cpu as cpu
from agentd.kernels.cpu import _build, reference
from agentd.kernels.cpu.block_formats import ACT_Q8_32, ACT_Q8_256, GGML_TYPES

NATIVE_ISAS = ["avx512_vnni", "avx2", "scalar"]




@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU")
def test_the_kernels_run_on_torchs_threads() -> None:
    # at::parallel_for is inline: without OpenMP in the build it ran every product and
    # attention call on the calling thread, whatever torch.set_num_threads said
    module = cpu._native().module
    if module is None:
        pytest.skip(cpu.native_unavailable_reason() or "no native kernels")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert module.parallel_for_threads(64) == 2
        torch.set_num_threads(1)
        assert module.parallel_for_threads(64) == 1
    finally:
        torch.set_num_threads(threads)


def test_self_check_passes_on_every_native_isa(isa: str) -> None:
    if isa == "torch":
        pytest.skip("the self-check compares C++ kernel sets")
    assert cpu._native().module.self_check(cpu.ISAS.index(isa)) == ""


def _odd_offset(raw: np.ndarray) -> torch.Tensor:
    """The rows as a view starting one byte into a buffer, as GGUF rows inside an mmap may."""
    buf = torch.zeros(raw.size + 1, dtype=torch.uint8)
    buf[1:] = torch.from_numpy(raw.reshape(-1))
    return buf[1:].view(raw.shape)


@pytest.mark.parametrize("type_name", list(GGML_TYPES))
def test_dequantize_equals_reference(type_name: str, isa: str) -> None:
    K = {256: 512, 32: 160, 1: 164}[GGML_TYPES[type_name].block_weights]  # 164: SIMD tails
    raw = reference.random_blocks(np.random.default_rng(3), type_name, 7, K, wild=True)
    got = cpu.dequantize(_odd_offset(raw), type_name, K)
    want = reference.dequantize(raw, type_name, K)
    np.testing.assert_array_equal(got.numpy(), want)  # values (a zero's sign may differ)
    ids = torch.tensor([6, 0, 3, 3])
    rows = cpu.get_rows(_odd_offset(raw), type_name, ids, K)
    np.testing.assert_array_equal(rows.numpy(), want[ids.numpy()])


@pytest.mark.parametrize("kind", [ACT_Q8_32, ACT_Q8_256])
def test_quantize_act_equals_reference(kind: int, isa: str) -> None:
    if isa == "torch":
        pytest.skip("the torch path multiplies fp32 activations, it quantizes nothing")
    rng = np.random.default_rng(kind)
    x = (rng.standard_normal((5, 768)) * 3).astype(np.float32)
    x[1, :256] = 0                   # a zero block
    x[2, 300] = np.nan               # a non-finite block: d = NaN, qs = 0
    x[3, :256] *= np.float32(1e-35)  # below the 1e-30 floor: zeros
    x[4] = np.round(x[4] * 8) / 8    # values on the grid, where ties to even matter
    got = cpu._native().module.quantize_act(torch.from_numpy(x), kind, cpu.ISAS.index(isa))
    want = reference.quantize_act(x, kind)
    np.testing.assert_array_equal(got.numpy().reshape(-1), want.view(np.uint8).reshape(-1))


def test_isa_env_only_lowers_and_rejects_unknown_names(monkeypatch: pytest.MonkeyPatch) -> None:
    best = cpu.available_isas()[-1]
    monkeypatch.setenv(cpu.ISA_ENV, "avx512_vnni")
    assert cpu.active_isa() == best
    monkeypatch.setenv(cpu.ISA_ENV, "torch")
    assert cpu.active_isa() == "torch"
    cpu.set_isa("scalar" if best != "torch" else "torch")  # set_isa wins over the environment
    assert cpu.active_isa() != "torch" or best == "torch"
    cpu.set_isa(None)
    monkeypatch.setenv(cpu.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="AGENTD_CPU_ISA='sse9'"):
        cpu.active_isa()
    monkeypatch.delenv(cpu.ISA_ENV)
    assert cpu.active_isa() == best
    with pytest.raises(ValueError, match="not 'sse9'"):
        cpu.set_isa("sse9")


def test_no_compiler_falls_back_to_torch_with_one_warning(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("AGENTD_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(cpu.ISA_ENV, raising=False)
    loaded = _build.load()
    assert loaded.module is None and loaded.reason.startswith("no C++ compiler")
    with caplog.at_level(logging.WARNING, logger="agentd.kernels.cpu"):
        monkeypatch.setattr(cpu, "_state", cpu._resolve(loaded))
    monkeypatch.setattr(cpu, "_env_choice", None)  # choose again, from the null extension
    assert [r.getMessage() for r in caplog.records] == [
        "no C++ compiler (c++/g++ on PATH): GGUF products run on torch's kernels, dequantizing "
        "every weight per call, ~50x slower to decode; install g++"]
    assert cpu.active_isa() == "torch" and not cpu.native_available()
    raw = reference.random_blocks(np.random.default_rng(0), "Q4_0", 3, 64)
    x = np.ones((2, 64), np.float32)
    np.testing.assert_allclose(cpu.linear(torch.from_numpy(x), torch.from_numpy(raw), "Q4_0"),
                               reference.reference_linear(x, raw, "Q4_0"), rtol=1e-5)


def test_bad_shapes_say_what_is_expected() -> None:
    w = torch.zeros(4, 18 * 5, dtype=torch.uint8)  # K = 160 of Q4_0
    with pytest.raises(ValueError, match="rows hold 90 bytes; K = 128 needs 72"):
        cpu.linear(torch.zeros(1, 128), w, "Q4_0")
    with pytest.raises(ValueError, match="whole blocks of 32 weights, got K = 150"):
        cpu.dequantize(w, "Q4_0", 150)
    with pytest.raises(ValueError, match="contiguous float32"):
        cpu.linear(torch.zeros(1, 160, dtype=torch.float64), w, "Q4_0")
    with pytest.raises(ValueError, match="unsupported ggml type 'Q2_K'"):
        cpu.linear(torch.zeros(1, 256), w, "Q2_K")
