"""The K-quant CPU kernels (kernels/cpu/kquants_*.cpp) against gguf's own dequantizer.

Every ISA's kernels are compiled here, with an ``extern "C"`` shim, into one shared library and
called through ctypes, so each ISA is checked directly (the extension's dispatcher runs only one
per machine). Dequantized rows must equal ``gguf.quants.dequantize`` bit for bit. A product must
equal the float64 dot of the gguf-dequantized weights and the dequantized activation
(``qs * d``) within 1e-5 of ``sum |w| |x|``: the kernels' integer sums are exact, so only their
per-super-block fp32 scaling and accumulation round. Rows and activations start at odd
addresses (GGUF rows inside an mmap are aligned to nothing) and fp16 scales include subnormals.
An ISA this CPU lacks is skipped with the reason. The last tests run the same types through the
extension's public API (``agentd.kernels.cpu``: its own activation quantizer, threads and
dispatch) at each ISA this CPU runs.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

import agentd.kernels

CPU_DIR = Path(agentd.kernels.__file__).parent / "cpu"
SOURCES = ["kquants_scalar.cpp", "kquants_avx2.cpp", "kquants_avx512.cpp"]
QK_K = 256
ACT_DTYPE = np.dtype([("d", "<f4"), ("qs", "i1", (QK_K,)), ("bsums", "<i2", (QK_K // 16,))])
ISAS = ["scalar", "avx2", "avx512"]
# /proc/cpuinfo flags each ISA file's target pragma needs.
ISA_FLAGS = {
    "scalar": set(),
    "avx2": {"avx2", "fma", "f16c", "bmi2"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"},
}


class KQuant(NamedTuple):
    name: str  # as spelled in the kernels' names

    qtype: GGMLQuantizationType
    block_bytes: int
    fp16_offsets: tuple[int, ...]  # byte offsets of the block's fp16 fields (d, dmin)

    @property
    def type_name(self) -> str:
        return self.qtype.name


KQUANTS = [
    KQuant("q4_K", GGMLQuantizationType.Q4_K, 144, (0, 2)),
    KQuant("q5_K", GGMLQuantizationType.Q5_K, 176, (0, 2)),
    KQuant("q6_K", GGMLQuantizationType.Q6_K, 210, (208,)),
]
_VP = ctypes.c_void_p


def _shim_source() -> str:
    lines = ['#include "ggml_blocks.h"', "using namespace agentd_cpu;"]
    for q in KQUANTS:
        for isa in ISAS:
            fn = f"vec_dot_{q.name}_{isa}"
            lines.append(f'extern "C" float kq_{fn}(int K, const void* w, const void* a) '
                         f"{{ return {fn}(K, w, a); }}")
        for fn in (f"dequant_row_{q.name}", f"dequant_row_{q.name}_avx2"):
            lines.append(f'extern "C" void kq_{fn}(int K, const void* w, float* out) '
                         f"{{ {fn}(K, w, out); }}")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++/c++) on PATH to build the K-quant kernels")
    out = tmp_path_factory.mktemp("kquants")
    (out / "shim.cpp").write_text(_shim_source())
    sources = [CPU_DIR / s for s in SOURCES] + [out / "shim.cpp"]
    flags = ["-O2", "-std=c++17", "-fPIC", "-Wall", "-Werror", f"-I{CPU_DIR}"]
    jobs = [subprocess.Popen([cxx, *flags, "-c", str(s), "-o", str(out / f"{s.stem}.o")],
                             stderr=subprocess.PIPE, text=True) for s in sources]
    errors = [err for job in jobs if (err := job.communicate()[1]) or job.returncode]
    assert not errors, "\n".join(errors)
    so = out / "kquants.so"
    subprocess.run([cxx, "-shared", *(str(out / f"{s.stem}.o") for s in sources), "-o", str(so)],
                   check=True)
    library = ctypes.CDLL(str(so))
    for q in KQUANTS:
        for isa in ISAS:
            fn = getattr(library, f"kq_vec_dot_{q.name}_{isa}")
            fn.argtypes, fn.restype = [ctypes.c_int, _VP, _VP], ctypes.c_float
        for suffix in ("", "_avx2"):
            fn = getattr(library, f"kq_dequant_row_{q.name}{suffix}")
            fn.argtypes, fn.restype = [ctypes.c_int, _VP, _VP], None
    return library


def _cpu_flags() -> set[str] | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def _require(isa: str) -> None:
    flags = _cpu_flags()
    if flags is None and isa != "scalar":
        pytest.skip(f"cannot read /proc/cpuinfo to tell whether this CPU runs {isa}")
    missing = ISA_FLAGS[isa] - (flags or set())
    if missing:
        pytest.skip(f"this CPU lacks {' '.join(sorted(missing))}: the {isa} kernels cannot run")


def _odd(data: np.ndarray) -> np.ndarray:
    """The same bytes at an odd address (a copy one byte into a fresh buffer)."""
    raw = data.reshape(-1).view(np.uint8)
    buf = np.empty(raw.size + 1, dtype=np.uint8)
    buf[1:] = raw
    return buf[1:]


def _ptr(a: np.ndarray) -> int:
    """The array's address: the caller keeps the array alive for as long as the call runs."""
    return a.ctypes.data


def random_weights(q: KQuant, rows: int, K: int, rng: np.random.Generator) -> np.ndarray:
    """Random block bytes with finite fp16 scales (a quarter of them subnormal)."""
    nb = K // QK_K
    data = rng.integers(0, 256, size=(rows, nb, q.block_bytes), dtype=np.uint8)
    for off in q.fp16_offsets:
        mag = np.where(rng.random((rows, nb)) < 0.25, 3e-6, 3e-3)
        d = (rng.standard_normal((rows, nb)) * mag).astype(np.float16)
        data[:, :, off:off + 2] = d.view(np.uint8).reshape(rows, nb, 2)
    return data.reshape(rows, nb * q.block_bytes)


def quantize_act(x: np.ndarray) -> np.ndarray:
    """One activation row as ActQ8_256 blocks: absmax / 127 scales, exact group sums."""
    blocks = x.astype(np.float32).reshape(-1, QK_K)
    d = np.abs(blocks).max(axis=1) / np.float32(127)
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    qs = np.clip(np.rint(blocks * inv[:, None]), -127, 127).astype(np.int8)
    act = np.zeros(len(blocks), dtype=ACT_DTYPE)
    act["d"], act["qs"] = d, qs
    act["bsums"] = qs.reshape(len(blocks), -1, 16).astype(np.int16).sum(axis=2)
    return act


def act_values(act: np.ndarray) -> np.ndarray:
    return (act["qs"].astype(np.float64) * act["d"].astype(np.float64)[:, None]).reshape(-1)


def check_dots(lib: ctypes.CDLL, q: KQuant, isa: str, weights: np.ndarray,
               act: np.ndarray) -> None:
    rows, row_bytes = weights.shape
    K = act.size * QK_K
    w = dequantize(weights, q.qtype).astype(np.float64)
    x = act_values(act)
    expected, scale = w @ x, np.abs(w) @ np.abs(x)
    fn = getattr(lib, f"kq_vec_dot_{q.name}_{isa}")
    rows_odd, act_odd = [_odd(weights[r]) for r in range(rows)], _odd(act)
    got = np.array([fn(K, _ptr(row), _ptr(act_odd)) for row in rows_odd])
    np.testing.assert_array_less(np.abs(got - expected), 1e-5 * scale + 1e-30)


@pytest.mark.parametrize("q", KQUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("isa", ["scalar", "avx2"])
@pytest.mark.parametrize("K", [256, 512, 4096])
def test_dequant_row_equals_gguf(lib: ctypes.CDLL, q: KQuant, isa: str, K: int) -> None:
    _require(isa)
    rng = np.random.default_rng(K + len(q.name) + 7 * ISAS.index(isa))
    weights = random_weights(q, 4, K, rng)
    expected = dequantize(weights, q.qtype)
    fn = getattr(lib, f"kq_dequant_row_{q.name}" + ("" if isa == "scalar" else "_avx2"))
    for r in range(len(weights)):
        row, out = _odd(weights[r]), np.full(K, np.nan, dtype=np.float32)
        fn(K, _ptr(row), _ptr(out))
        np.testing.assert_array_equal(out, expected[r])


@pytest.mark.parametrize("q", KQUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("K", [256, 512, 4096])
def test_vec_dot_matches_float64(lib: ctypes.CDLL, q: KQuant, isa: str, K: int) -> None:
    _require(isa)
    rng = np.random.default_rng(1000 + K + len(q.name))
    weights = random_weights(q, 8, K, rng)
    act = quantize_act(rng.standard_normal(K).astype(np.float32) * 3)
    check_dots(lib, q, isa, weights, act)


@pytest.mark.parametrize("q", KQUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("isa", ISAS)
def test_vec_dot_extremes(lib: ctypes.CDLL, q: KQuant, isa: str) -> None:
    """All-ones weight bytes (largest values, scales and minimums; Q6_K scales -1) against
    activations of -128 and 127: the widest integer sums, where a saturating or overflowing
    intermediate would show."""
    _require(isa)
    K = 512
    weights = np.full((2, K // QK_K * q.block_bytes), 0xFF, dtype=np.uint8)
    for off in q.fp16_offsets:
        for b in range(K // QK_K):
            start = b * q.block_bytes + off
            weights[:, start:start + 2] = np.array([0.5], dtype=np.float16).view(np.uint8)
    for qs in (np.full(K, -128, dtype=np.int8), np.where(np.arange(K) % 3, 127, -128)):
        act = np.zeros(K // QK_K, dtype=ACT_DTYPE)
        act["d"] = 0.01
        act["qs"] = qs.reshape(-1, QK_K)
        act["bsums"] = act["qs"].reshape(len(act), -1, 16).astype(np.int16).sum(axis=2)
        check_dots(lib, q, isa, weights, act)


@pytest.fixture
def cpu_api(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest):
    """agentd.kernels.cpu forced to the ISA named by the test's ``isa`` parameter."""
    import agentd.kernels.cpu as cpu

    if not cpu.native_available():
        pytest.skip(f"the CPU extension is unavailable: {cpu.native_unavailable_reason()}")
    isa = request.getfixturevalue("isa")
    _require(isa)
    monkeypatch.setenv("AGENTD_CPU_ISA", isa)
    assert cpu.active_isa() == isa
    return cpu


@pytest.mark.parametrize("q", KQUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("isa", ["scalar", "avx2"])
@pytest.mark.parametrize("n", [1, 3])
def test_linear_decode(cpu_api, q: KQuant, isa: str, n: int) -> None:
    """Few rows: the int8 kernels. The bound is the activations' rounding (half a step of
    absmax / 127 per element, times |w|) plus the kernels' own 1e-5 of sum |w| |x|."""
    import torch

    K, rows = 512, 37  # an odd row count: uneven shares per thread
    rng = np.random.default_rng(n + 10 * len(q.name))
    weights = random_weights(q, rows, K, rng)
    x = rng.standard_normal((n, K)).astype(np.float32)
    got = cpu_api.linear(torch.from_numpy(x), torch.from_numpy(weights), q.type_name).numpy()
    w = dequantize(weights, q.qtype).astype(np.float64)
    step = np.abs(x.reshape(n, -1, QK_K)).max(axis=2) / 127  # [n, K / 256]
    half_steps = np.repeat(step, QK_K, axis=1) / 2
    bound = np.abs(w) @ half_steps.T * 1.01 + 1e-5 * np.abs(w) @ np.abs(x).T.astype(np.float64)
    np.testing.assert_array_less(np.abs(got - (x.astype(np.float64) @ w.T)), bound.T)


@pytest.mark.parametrize("q", KQUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("isa", ["scalar", "avx2"])
def test_linear_prefill_and_rows(cpu_api, q: KQuant, isa: str, monkeypatch) -> None:
    """Many rows on dequantized tiles and a dense fp32 GEMM (no activation rounding; the
    bfloat16 and int8 prefill paths are checked in test_cpu_linear); dequantize and get_rows
    equal gguf's values exactly."""
    import torch

    monkeypatch.setattr(cpu_api, "bf16_tiles", lambda: False)
    monkeypatch.setattr(cpu_api, "prefill_on_tiles", lambda type_name, n: n >= 64)

    K, rows, n = 512, 300, 64  # 300 rows: more than one tile
    rng = np.random.default_rng(len(q.name))
    weights = random_weights(q, rows, K, rng)
    x = rng.standard_normal((n, K)).astype(np.float32)
    w = dequantize(weights, q.qtype)
    got = cpu_api.linear(torch.from_numpy(x), torch.from_numpy(weights), q.type_name).numpy()
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.T.astype(np.float64),
                               rtol=1e-4, atol=1e-4 * np.abs(got).max())
    tensor = torch.from_numpy(weights)
    np.testing.assert_array_equal(cpu_api.dequantize(tensor, q.type_name, K).numpy(), w)
    ids = torch.tensor([5, 0, 299, 5])
    np.testing.assert_array_equal(cpu_api.get_rows(tensor, q.type_name, ids, K).numpy(),
                                  w[ids.numpy()])
