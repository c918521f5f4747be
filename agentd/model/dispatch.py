"""Weight formats on the CPU: install them in a model, and pick kernels by measuring them here.

``--weights`` names how linear layers store their weights; ``auto`` takes the fastest format, on
this CPU, among those that passed the accuracy bar on the default model
(``ACCURATE_FORMATS``; tests/model/test_weight_accuracy.py holds the bar). Each low-precision
layer then multiplies small batches (decode rows) with its weight-only kernel and large ones
(prefill chunks) by dequantizing into a dense GEMM; the crossover is measured per layer kind on
the model's own layers at load (:func:`calibrate`), never assumed from the ISA's name.

Invariant: ``float32`` installs nothing here: the exact mode is the model as loaded (oneDNN or
MKL fp32), whatever this module measures.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from agentd.model.isa import CpuIsa
from agentd.model.llama import (
    PackedLinear,
    SharedWeightLinear,
    packing_unsupported,
    shared_parameter_ids,
)
from agentd.model.quant import IntGroups, LowPrecisionLinear, make_linear, quantize_int4

logger = logging.getLogger("agentd")

WEIGHT_FORMATS = ("float32", "bfloat16", "float16", "int8", "int4")
# Formats whose greedy continuations matched the exact mode on >= 60% of the 24 agent prompts,
# batched and alone, and whose logits stayed within the bf16-derived bound (docs/weights.md,
# "Weight formats"; AMX, then AVX2): int4 75% / 71%, 83% / 79%; float16 96% / 96% on both; bfloat16
# (50% batched on AMX, 58% on AVX2) and int8 (29%, 25% batched) miss it.
ACCURATE_FORMATS = ("int4", "float16")
CALIBRATION_ROWS = (1, 4, 8, 16, 32, 64, 128)
CALIBRATION_LAYERS = 4  # layers of a kind that pick the dequantizing path's GEMM dtype
LINEAR_KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


@dataclass
class KernelChoice:
    """How one kind of layer multiplies: ``kernel`` up to ``max_kernel_rows`` rows, else
    ``dense`` (``None``: the kernel for every row count)."""

    kernel: str
    max_kernel_rows: int | None
    dense: str
    timings_ms: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        if self.max_kernel_rows is None:
            return f"{self.kernel} (all rows)"
        return f"{self.kernel} <= {self.max_kernel_rows} rows, else {self.dense}"


@contextmanager
def _one_thread() -> Iterator[None]:
    """Time on one thread: on a busy machine a descheduled OpenMP thread stalls every parallel
    region (measured on the shared 2-core box: a 3,072 x 576 int4 GEMV 0.2 ms on one thread,
    28-40 ms on two), while the kernel-vs-dense ratio that the choice rests on scales alike."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(num_threads)


def _time_ms(fn: Callable[[], object], repeats: int = 3) -> float:
    """Best of ``repeats`` (the machine may be shared; the minimum is the kernel's own cost)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _pass_ms(layers: list[LowPrecisionLinear], path: str, rows: int, repeats: int = 2) -> float:
    """Time one ``path`` (``kernel`` or ``dense``) product through every layer of a kind."""
    x = torch.randn(rows, layers[0].in_features)
    return _time_ms(lambda: [getattr(layer, path)(x) for layer in layers], repeats)


def _pick_dense_dtype(layers: list[LowPrecisionLinear], isa: CpuIsa, max_rows: int) -> None:
    """fp32 GEMMs, or bf16 ones where the CPU has them and they measure faster on a chunk."""
    dtypes = [torch.float32] + ([torch.bfloat16] if isa.bf16_gemm else [])
    best: dict[torch.dtype, float] = {}
    for dtype in dtypes if len(dtypes) > 1 and not getattr(layers[0], "onednn", False) else ():
        for layer in layers:
            layer.dense_dtype = dtype
        best[dtype] = _pass_ms(layers, "dense", min(256, max_rows), repeats=1)
    chosen = min(best, key=best.__getitem__) if best else torch.float32
    for layer in layers:
        layer.dense_dtype = chosen


def _sweep_ms(order: list[tuple[str, LowPrecisionLinear]], paths: dict[str, str], rows: int,
              repeats: int = 2) -> dict[str, float]:
    """One product of ``rows`` rows through every low-precision layer in the model's order, each
    kind on ``paths[kind]`` (``kernel`` or ``dense``); the best of ``repeats`` sweeps after one
    that only warms, summed per kind. A whole sweep reads what a decode step reads: measured on
    a few layers instead, the fp32 twins stayed in a large L3 cache (300 MiB on this project's
    machine) and won at 8 rows, where in real steps they stream from memory and the 4-bit kernel
    is 1.2x faster (decode at batch 8, AVX2: 78.6 vs 64.7 tokens/s)."""
    inputs: dict[int, torch.Tensor] = {}
    best = {kind: float("inf") for kind in paths}
    for sweep in range(repeats + 1):
        spent = dict.fromkeys(paths, 0.0)
        for kind, layer in order:
            x = inputs.get(layer.in_features)
            if x is None:
                x = inputs[layer.in_features] = torch.randn(rows, layer.in_features)
            start = time.perf_counter()
            getattr(layer, paths[kind])(x)
            spent[kind] += time.perf_counter() - start
        if sweep:
            best = {kind: min(best[kind], spent[kind]) for kind in paths}
    return {kind: ms * 1e3 for kind, ms in best.items()}


@_one_thread()
@torch.inference_mode()
def calibrate(model: nn.Module, isa: CpuIsa, max_rows: int) -> dict[str, KernelChoice]:
    """Set each layer kind's crossover from kernel to the dense path: sweeps of the whole model
    (:func:`_sweep_ms`) at each row count of ``CALIBRATION_ROWS``, all kernels vs all dense; a
    kind keeps its kernel for every row count up to the last one before its dense path won."""
    order = [(name.rsplit(".", 1)[-1], m) for name, m in model.named_modules()
             if isinstance(m, LowPrecisionLinear) and name.rsplit(".", 1)[-1] in LINEAR_KINDS]
    by_kind = {kind: [m for k, m in order if k == kind] for kind in LINEAR_KINDS}
    by_kind = {kind: layers for kind, layers in by_kind.items() if layers}
    kinds = list(by_kind)
    for layers in by_kind.values():
        if layers[0].dense_twin is None:
            _pick_dense_dtype(layers[:CALIBRATION_LAYERS], isa, max_rows)
            for layer in layers:
                layer.dense_dtype = layers[0].dense_dtype
    timings: dict[str, dict[str, float]] = {kind: {} for kind in kinds}
    limits: dict[str, int | None] = dict.fromkeys(kinds, 0)
    open_kinds = set(kinds)
    for rows in (r for r in CALIBRATION_ROWS if r <= max_rows):
        if not open_kinds:
            break
        # kinds already decided run as they will at this row count: the dense path
        kernel = _sweep_ms(order, {k: "kernel" if k in open_kinds else "dense" for k in kinds},
                           rows)
        dense = _sweep_ms(order, dict.fromkeys(kinds, "dense"), rows)
        for kind in sorted(open_kinds):
            timings[kind][f"kernel@{rows}"] = kernel[kind]
            timings[kind][f"dense@{rows}"] = dense[kind]
            if dense[kind] < kernel[kind]:
                open_kinds.discard(kind)
            else:
                limits[kind] = rows  # the largest measured row count where the kernel won
    choices: dict[str, KernelChoice] = {}
    for kind in kinds:
        limit = None if kind in open_kinds else limits[kind]  # never lost: every row count
        layers = by_kind[kind]
        for layer in layers:
            layer.max_kernel_rows = limit
        dense_name = ("dense twin (oneDNN)" if layers[0].dense_twin is not None else
                      "dequantize + " + ("bf16 GEMM" if layers[0].dense_dtype == torch.bfloat16
                                         else "fp32 GEMM"))
        choices[kind] = KernelChoice(layers[0].kernel_name, limit, dense_name,
                                     {k: round(v, 3) for k, v in timings[kind].items()})
    return choices


def _dense_twin(linear: nn.Linear, shared: set[int], packable: bool) -> nn.Module:
    """The layer as the exact mode runs it (oneDNN-packed, or on the shared tensor of a tied
    head), without its bias (the low-precision layer adds it)."""
    bare = nn.Linear(linear.in_features, linear.out_features, bias=False, device="meta")
    bare.weight = linear.weight
    if not packable:
        return bare
    return SharedWeightLinear(bare) if id(linear.weight) in shared else PackedLinear(bare)


def install(model: nn.Module, weights: str, int4_groups: dict[str, IntGroups], isa: CpuIsa,
            keep_dense: bool) -> int:
    """Swap the model's ``nn.Linear`` layers for layers of format ``weights``; ``int4_groups``
    (fused names, e.g. ``layers.0.self_attn.qkv_proj.weight``) are used as they are where the
    format is int4; ``keep_dense`` keeps each layer's dense weight as its twin for big calls.
    Returns how many layers were swapped (a shape a kernel does not take stays as it is)."""
    slots = [(parent, name, f"{prefix}.{name}".lstrip("."))
             for prefix, parent in model.named_modules()
             for name, child in parent.named_children() if type(child) is nn.Linear]
    shared = shared_parameter_ids(model)
    packable = bool(slots) and packing_unsupported(getattr(*slots[0][:2]).weight.dtype) is None
    num_swapped = 0
    for parent, name, path in slots:
        linear = getattr(parent, name)
        source = int4_groups.get(f"{path}.weight", linear.weight.detach())
        layer_format = weights
        if weights == "int4" and path == "lm_head" and not isinstance(source, IntGroups):
            # The head's logits are what sampling reads: 4-bit groups made here from a dense
            # (or Q8_0) head moved the default model's logits by up to 4.5 (argmax agreement
            # 95%), fp16 by 0.03 (100%); a head the checkpoint holds in 4 bits stays int4.
            layer_format = "float16"
        layer = make_linear(layer_format, source, linear.bias, isa.bf16_gemm)
        if layer is None:
            continue
        if keep_dense or id(linear.weight) in shared:  # a tied head's dense weight is kept anyway
            layer.keep_dense_twin(_dense_twin(linear, shared, packable))
        setattr(parent, name, layer)
        num_swapped += 1
    return num_swapped


@_one_thread()
@torch.inference_mode()
def pick_auto(isa: CpuIsa, in_features: int, out_features: int) -> tuple[str, dict[str, float]]:
    """The fastest accurate format for one decode row on a matrix of the model's largest shape
    (its LM head: a GEMV that streams the most bytes), measured here on random weights."""
    weight = torch.randn(out_features, in_features) * 0.02
    x = torch.randn(1, in_features)
    timings: dict[str, float] = {}
    reference = nn.Linear(in_features, out_features, bias=False)
    reference.weight.data = weight
    dense = PackedLinear(reference) if torch.backends.mkldnn.is_available() else reference
    timings["float32"] = _time_ms(lambda: dense(x))
    for name in ACCURATE_FORMATS:
        source = quantize_int4(weight) if name == "int4" else weight
        layer = make_linear(name, source, None, isa.bf16_gemm)
        if layer is not None:
            timings[name] = _time_ms(functools.partial(layer.kernel, x))
    candidates = {k: v for k, v in timings.items() if k in ACCURATE_FORMATS}
    chosen = min(candidates, key=candidates.__getitem__) if candidates else "float32"
    return chosen, {k: round(v, 3) for k, v in timings.items()}
