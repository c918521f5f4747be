"""The KV pool's dtype and size, and the context length it allows, decided once at start.

Invariants: ``max_model_len`` never exceeds the model's own context nor what the pool holds; a
context shorter than the model's that the operator did not ask for carries a ``cap_reason`` with
its numbers (model context, bytes per token, budget), which the engine logs and reports in its
stats: a cap is never silent. With ``--kv-cache-memory`` unset the pool holds ``max_model_len``
tokens for each of ``max_num_seqs`` sequences, within ``RAM_FRACTION`` of the memory free at
start, and never less than one ``max_model_len`` sequence when that fits the budget.
``plan_pool`` applies the rule to a loaded model (``load_timed`` loads it and says how much of
its weights is not resident yet, which the budget leaves room for). A pool set by
``--kv-cache-memory`` never needs more than the device has free at start (``check_pool_fits``,
with :mod:`.free_memory`'s figure, less the weights not yet resident): one that does is refused,
with both figures and the option to change, before anything is allocated for it. The auto-sized
pool is within its budget by construction, whatever ``--max-model-len`` and ``--max-num-seqs``
ask (an explicit ``--max-model-len`` that does not fit is an error).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from agentd.engine.free_memory import FreeMemory, MemoryProbe, proc_status_bytes
from agentd.kernels import kv_quant
from agentd.kernels.kv_quant import dtype_name

if TYPE_CHECKING:
    from agentd.config import EngineConfig
    from agentd.model.build import LoadedModel
    from agentd.model.llama import ModelDims

logger = logging.getLogger("agentd")

# q8_0: int8 values with an fp16 scale per 32 (agentd.kernels.kv_quant), stored as int8 bytes
KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
             "q8_0": kv_quant.Q8_DTYPE}
# Why half of what is free: the pool is a ceiling, not a charge (it is allocated lazily zeroed:
# a block costs RSS once written), but once the prefix cache fills it, it is resident. The rest
# is for what the daemon needs besides (a 2,048-token step's activations, pin snapshot buffers,
# the page cache of memory-mapped weights) and for the agents themselves, which run on the same
# host with their tools; vLLM may take 0.9 of a GPU because that device is its alone.
RAM_FRACTION = 0.5
FALLBACK_BUDGET_BYTES = 384 * 2**20  # where free memory cannot be read (no /proc/meminfo)

def resolve_kv_dtype(name: str, dtype: torch.dtype, weights: str,
                     device: torch.device) -> torch.dtype:
    """The pool's dtype. ``auto``: float32 in the exact mode (float32 activations and weights,
    so the model's outputs equal transformers'), the activations' dtype when they are narrower
    (bfloat16 on CUDA by default, ``--dtype bfloat16``), else float16: with low-precision weights
    (a GGUF's blocks, int4, int8, bf16/fp16 linears) the outputs already differ from the exact
    mode's and fp16 keys and values (10 mantissa bits) hold half the bytes per token."""
    if name == "q8_0" and device.type != "cpu":
        raise ValueError("--kv-cache-dtype q8_0 runs on the CPU only (agentd's C++ attention); "
                         f"on {device.type} use float16 or bfloat16")
    if name != "auto":
        return KV_DTYPES[name]
    if dtype != torch.float32 or device.type == "cuda":
        return dtype
    return torch.float32 if weights == "float32" else torch.float16


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of the storages behind a module's parameters and buffers, each storage once (a
    memory-mapped file that many weights view is counted once, whole); a oneDNN-packed weight
    counts its elements."""
    seen: dict[int, int] = {}
    opaque = 0
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.device.type == "meta":
            continue
        if tensor.is_mkldnn:  # a weight packed for oneDNN (bf16 CPUs) has no storage to share
            opaque += tensor.numel() * tensor.element_size()
            continue
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values()) + opaque


def format_bytes(num_bytes: int) -> str:
    if num_bytes >= 2**40:
        return f"{num_bytes / 2**40:,.1f} TiB"
    if num_bytes >= 2**30:
        return f"{num_bytes / 2**30:.1f} GiB"
    return f"{num_bytes / 2**20:,.0f} MiB"


@dataclass(frozen=True)
class KVPlan:
    """The pool and context chosen at start; ``/v1/stats`` reports it as ``kv_cache``."""

    dtype: str
    block_size: int
    num_blocks: int
    num_tokens: int  # the pool's: num_blocks * block_size
    num_bytes: int  # the pool's, all layers (virtual until written: see runner.lazy_zeros)
    bytes_per_token: int  # all layers' keys and values of one token
    model_len: int  # the model's own context (max_position_embeddings, or its sliding window)
    max_model_len: int
    max_num_seqs: int
    budget_bytes: int | None  # the auto budget; None when --kv-cache-memory set the pool
    free_bytes: int | None  # the free memory the budget came from
    cap_reason: str | None  # why max_model_len is below model_len, if it is and was not asked

    @classmethod
    def of(cls, req: KVRequest, num_blocks: int, max_model_len: int, budget_bytes: int | None,
           free_bytes: int | None, cap_reason: str | None) -> KVPlan:
        bytes_per_token = req.bytes_per_block // req.block_size
        return cls(req.dtype, req.block_size, num_blocks, num_blocks * req.block_size,
                   num_blocks * req.bytes_per_block, bytes_per_token, req.model_len,
                   max_model_len, req.max_num_seqs, budget_bytes, free_bytes, cap_reason)

    def describe(self) -> str:
        """One line: the pool, and the context with its cap reason."""
        source = "--kv-cache-memory" if self.budget_bytes is None else \
            f"budget {format_bytes(self.budget_bytes)}"
        line = (f"kv cache {self.dtype}: {self.num_tokens:,} tokens in {self.num_blocks} blocks "
                f"({format_bytes(self.num_bytes)}, {self.bytes_per_token:,} bytes a token; "
                f"{source}), {self.num_tokens // self.max_model_len} sequences at full context; "
                f"context {self.max_model_len:,} tokens")
        return line + (f" (capped: {self.cap_reason})" if self.cap_reason else "")


@dataclass(frozen=True)
class KVRequest:
    """What the sizing needs to know: the model's shape facts and the operator's settings."""

    dtype: str
    block_size: int
    bytes_per_block: int
    model_len: int
    max_num_seqs: int
    max_model_len: int | None  # --max-model-len, if given
    memory_bytes: int | None  # --kv-cache-memory, if given


def plan_kv_cache(req: KVRequest, free_bytes: int | None, weights_unresident_bytes: int = 0
                  ) -> KVPlan:
    """Size the pool. Raises ValueError (saying what to change) when fewer than two blocks fit
    or an explicit ``--max-model-len`` does not."""
    if req.max_model_len is not None and req.max_model_len > req.model_len:
        raise ValueError(f"max_model_len {req.max_model_len} exceeds the model's context "
                         f"({req.model_len} tokens); lower --max-model-len")
    if req.memory_bytes is not None:
        return _plan_explicit(req)
    budget = FALLBACK_BUDGET_BYTES if free_bytes is None else \
        int(max(free_bytes - weights_unresident_bytes, 0) * RAM_FRACTION)
    bytes_per_token = req.bytes_per_block // req.block_size
    want_len = req.max_model_len or req.model_len
    seq_blocks = -(-want_len // req.block_size)
    budget_blocks = budget // req.bytes_per_block
    num_blocks = min(seq_blocks * req.max_num_seqs, budget_blocks)
    where = ("free memory unknown: a fixed budget of " + format_bytes(budget)) if \
        free_bytes is None else (
        f"{RAM_FRACTION:g} of the {format_bytes(free_bytes)} free at start"
        + (f" less {format_bytes(weights_unresident_bytes)} of weights not yet resident"
           if weights_unresident_bytes else "") + f": {format_bytes(budget)}")
    if num_blocks < 2:
        raise ValueError(f"the KV budget ({where}) holds fewer than 2 blocks of "
                         f"{req.bytes_per_block} bytes; free memory or set --kv-cache-memory")
    cap_reason = None
    max_model_len = want_len
    if budget_blocks < seq_blocks:
        needed = seq_blocks * req.bytes_per_block
        if req.max_model_len is not None:
            raise ValueError(
                f"max_model_len {req.max_model_len} needs {format_bytes(needed)} of KV "
                f"({bytes_per_token:,} bytes a token in {req.dtype}), more than the budget "
                f"({where}); lower --max-model-len, pick a narrower --kv-cache-dtype, or set "
                "--kv-cache-memory")
        max_model_len = num_blocks * req.block_size
        cap_reason = (f"the model's context of {req.model_len:,} tokens needs "
                      f"{format_bytes(needed)} of KV at {bytes_per_token:,} bytes a token "
                      f"({req.dtype}), more than the budget ({where}); --kv-cache-memory or a "
                      "narrower --kv-cache-dtype gives it more")
    return KVPlan.of(req, num_blocks, max_model_len, budget, free_bytes, cap_reason)


def _plan_explicit(req: KVRequest) -> KVPlan:
    """``--kv-cache-memory`` sets the pool; the context is what the model and pool allow."""
    memory = req.memory_bytes or 0
    num_blocks = memory // req.bytes_per_block
    if num_blocks < 2:
        raise ValueError(f"kv cache memory of {memory} bytes holds fewer than 2 blocks of "
                         f"{req.bytes_per_block} bytes; raise --kv-cache-memory")
    capacity = num_blocks * req.block_size
    bytes_per_token = req.bytes_per_block // req.block_size
    if req.max_model_len is not None and req.max_model_len > capacity:
        raise ValueError(
            f"max_model_len {req.max_model_len} exceeds what this model and pool allow "
            f"({min(capacity, req.model_len)} tokens: model limit {req.model_len}, pool "
            f"{capacity}); raise --kv-cache-memory or lower --max-model-len")
    cap_reason = None
    max_model_len = req.max_model_len or min(req.model_len, capacity)
    if req.max_model_len is None and capacity < req.model_len:
        cap_reason = (f"the pool of --kv-cache-memory {format_bytes(memory)} holds "
                      f"{capacity:,} tokens at {bytes_per_token:,} bytes a token ({req.dtype}), "
                      f"fewer than the model's context of {req.model_len:,}")
    return KVPlan.of(req, num_blocks, max_model_len, None, None, cap_reason)


def kv_fingerprint(model_fingerprint: str, activation_dtype: torch.dtype,
                   kv_dtype: torch.dtype) -> str:
    """The key of the pool's content (block hashes, pin snapshots): the model's fingerprint, and
    the KV dtype when it is not the activations' (a snapshot of fp16 keys is not fp32 keys)."""
    if kv_dtype == activation_dtype:
        return model_fingerprint  # as before KV dtypes existed: older snapshots still match
    blob = f"{model_fingerprint}+kv-{dtype_name(kv_dtype)}".encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def model_len(dims: ModelDims) -> int:
    """The longest context the model attends over (full attention equals a sliding window up
    to the window's length, not past it)."""
    if dims.sliding_window is not None:
        return min(dims.max_position_embeddings, dims.sliding_window)
    return dims.max_position_embeddings


def check_pool_fits(plan: KVPlan, free: FreeMemory | None,
                    weights_unresident_bytes: int = 0) -> None:
    """Refuse a pool set by ``--kv-cache-memory`` that needs more than the device has free.

    Args:
        plan: the pool planned (an auto-sized one, within its budget, always fits).
        free: the device's free memory at start and its source (None: unknown, no check).
        weights_unresident_bytes: weights not in RAM yet, which take their share once read.

    Raises:
        ValueError: one line: what the pool needs, what the machine has, what to change.
    """
    if plan.budget_bytes is not None or free is None:
        return
    room = free.num_bytes - weights_unresident_bytes
    if plan.num_bytes <= room:
        return
    unresident = (f" less {format_bytes(weights_unresident_bytes)} of weights not yet resident"
                  if weights_unresident_bytes else "")
    raise ValueError(
        f"--kv-cache-memory asks for a KV pool of {format_bytes(plan.num_bytes)} "
        f"({plan.num_blocks:,} blocks), more than this machine can hold: "
        f"{format_bytes(free.num_bytes)} free ({free.source}){unresident}; lower "
        f"--kv-cache-memory to at most {format_bytes(max(room, 0))}, or leave it unset to size "
        "the pool from the free memory")


def plan_pool(config: EngineConfig, loaded: LoadedModel, kv_dtype: torch.dtype,
              kv_bytes_per_block: int, memory_probe: MemoryProbe, unresident: int) -> KVPlan:
    """The KV pool's size for ``loaded``: from ``--kv-cache-memory`` (refused when the device
    cannot hold it), else from the free memory (``unresident``: what ``load_timed`` found of
    the weights not yet in RAM; address space already holds them)."""
    free = memory_probe(loaded.device)
    if free is not None and free.mapped_included:
        unresident = 0
    plan = plan_kv_cache(KVRequest(
        dtype_name(kv_dtype), config.block_size, kv_bytes_per_block,
        model_len(loaded.model.dims), config.max_num_seqs, config.max_model_len,
        config.kv_cache_memory_bytes), None if free is None else free.num_bytes, unresident)
    check_pool_fits(plan, free, unresident)
    return plan


def log_plan(plan: KVPlan, backend_name: str) -> None:
    if plan.cap_reason is not None:
        logger.warning("max_model_len %d, below the model's %d: %s", plan.max_model_len,
                       plan.model_len, plan.cap_reason)
    logger.info("%s; attention backend %s", plan.describe(), backend_name)


def load_timed(config: EngineConfig) -> tuple[LoadedModel, float, int]:
    """Load the model; also how long it took and, on the CPU, how many of its weights' bytes
    are not in anonymous memory (memory-mapped, or never touched): ``MemAvailable`` counts those
    as free, yet they take memory once decode reads them. (A GPU's free memory already excludes
    the weights on it.)"""
    anon_before = proc_status_bytes("RssAnon") or 0
    start = time.perf_counter()
    from agentd.model.build import load_model  # the model's code, only when loading one

    loaded = load_model(config)
    load_s = time.perf_counter() - start
    if loaded.device.type != "cpu":
        return loaded, load_s, 0
    grown = max((proc_status_bytes("RssAnon") or 0) - anon_before, 0)
    return loaded, load_s, max(tensor_bytes(loaded.model) - grown, 0)
