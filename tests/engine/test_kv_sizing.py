"""The KV pool's size and the context it allows, without ``--kv-cache-memory``.

The rule (``agentd.engine.kv_sizing``): room for ``max_model_len`` tokens for each of
``max_num_seqs`` sequences within half the free memory (less the weights not yet resident); at least
one whole sequence when that fits; when even one does not, the context is capped to what fits,
logged with its numbers and reported in the stats; an explicit ``--max-model-len`` that does not fit
is an error that says what to change; ``--kv-cache-memory`` sets the pool as before, unless the
machine cannot hold it (then it is refused with both figures, before anything is allocated). The
free memory is injected (a fake ``MemAvailable``), and the pool costs RSS only as it is written.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from agentd.config import EngineConfig
from agentd.engine.free_memory import FreeMemory
from agentd.engine.kv_sizing import (
    FALLBACK_BUDGET_BYTES,
    KVRequest,
    check_pool_fits,
    plan_kv_cache,
)
from agentd.engine.llm_engine import LLMEngine
from agentd.llm import LLM

TiB, GiB, MiB = 2**40, 2**30, 2**20
# The default model (SmolLM2-135M) in the exact mode: 30 layers x K/V x 3 heads x 64 x fp32.
SMOLLM_TOKEN_BYTES = 30 * 2 * 3 * 64 * 4  # 46,080
# Llama-3.1-8B with a fp16 pool: 32 layers x K/V x 8 heads x 128 x 2 bytes.
LLAMA8B_TOKEN_BYTES = 32 * 2 * 8 * 128 * 2  # 131,072
TINY_TOKEN_BYTES = 2 * 2 * 2 * 16 * 4  # the tiny llama: 512


def request(token_bytes: int, model_len: int, *, max_num_seqs: int = 32,
            max_model_len: int | None = None, memory_bytes: int | None = None,
            dtype: str = "float32") -> KVRequest:
    return KVRequest(dtype, 16, 16 * token_bytes, model_len, max_num_seqs, max_model_len,
                     memory_bytes)


def test_the_pool_holds_every_sequence_at_full_context_when_that_fits() -> None:
    plan = plan_kv_cache(request(SMOLLM_TOKEN_BYTES, 8192), free_bytes=64 * GiB)
    assert (plan.num_tokens, plan.max_model_len, plan.cap_reason) == (32 * 8192, 8192, None)
    assert plan.num_bytes == 32 * 8192 * SMOLLM_TOKEN_BYTES  # 11.25 GiB, of a 32 GiB budget
    assert plan.budget_bytes == 32 * GiB


def test_the_budget_caps_the_pool_but_never_below_one_whole_sequence() -> None:
    plan = plan_kv_cache(request(SMOLLM_TOKEN_BYTES, 8192), free_bytes=8 * GiB)
    assert plan.num_blocks == 4 * GiB // (16 * SMOLLM_TOKEN_BYTES)  # 5,825 blocks: 11 sequences
    assert (plan.max_model_len, plan.cap_reason) == (8192, None)
    one = plan_kv_cache(request(SMOLLM_TOKEN_BYTES, 8192), free_bytes=760 * MiB)
    assert one.num_tokens >= 8192 and one.max_model_len == 8192  # one sequence, and it fits


def test_a_context_that_does_not_fit_once_is_capped_with_its_numbers() -> None:
    # An 8B model's 128K context in fp16 is 16 GiB of KV; on a 24 GiB machine with its 4.6 GiB
    # of memory-mapped Q4 weights not yet read, the budget is half of the rest.
    plan = plan_kv_cache(request(LLAMA8B_TOKEN_BYTES, 131072, dtype="float16"),
                         free_bytes=23 * GiB, weights_unresident_bytes=int(4.6 * GiB))
    assert plan.budget_bytes == (23 * GiB - int(4.6 * GiB)) // 2
    assert plan.num_blocks == plan.budget_bytes // (16 * LLAMA8B_TOKEN_BYTES)
    assert plan.max_model_len == plan.num_tokens == 75360
    for figure in ("131,072 tokens", "16.0 GiB", "131,072 bytes a token (float16)",
                   "0.5 of the 23.0 GiB free", "less 4.6 GiB of weights not yet resident",
                   "9.2 GiB", "--kv-cache-memory"):
        assert figure in plan.cap_reason, plan.cap_reason


def test_an_explicit_max_model_len_over_the_budget_is_an_error_that_says_what_to_change() -> None:
    with pytest.raises(ValueError, match=r"max_model_len 131072 needs 16.0 GiB of KV .* lower "
                                         r"--max-model-len, pick a narrower --kv-cache-dtype, "
                                         r"or set --kv-cache-memory"):
        plan_kv_cache(request(LLAMA8B_TOKEN_BYTES, 131072, max_model_len=131072,
                              dtype="float16"), free_bytes=23 * GiB)
    fits = plan_kv_cache(request(LLAMA8B_TOKEN_BYTES, 131072, max_model_len=32768,
                                 dtype="float16"), free_bytes=23 * GiB)
    assert (fits.max_model_len, fits.cap_reason) == (32768, None)
    assert fits.num_tokens == fits.budget_bytes // (16 * LLAMA8B_TOKEN_BYTES) * 16  # 2 seqs+
    with pytest.raises(ValueError, match="exceeds the model's context"):
        plan_kv_cache(request(TINY_TOKEN_BYTES, 4096, max_model_len=5000), free_bytes=GiB)


def test_an_explicit_kv_cache_memory_sets_the_pool() -> None:
    plan = plan_kv_cache(request(SMOLLM_TOKEN_BYTES, 8192, memory_bytes=384 * MiB), None)
    assert (plan.num_tokens, plan.max_model_len, plan.budget_bytes) == (8736, 8192, None)
    small = plan_kv_cache(request(SMOLLM_TOKEN_BYTES, 8192, memory_bytes=64 * MiB), None)
    assert small.max_model_len == small.num_tokens == 1456
    assert "--kv-cache-memory 64 MiB holds 1,456 tokens" in small.cap_reason
    with pytest.raises(ValueError, match="raise --kv-cache-memory or lower --max-model-len"):
        plan_kv_cache(request(SMOLLM_TOKEN_BYTES, 8192, memory_bytes=64 * MiB,
                              max_model_len=2048), None)


def test_an_explicit_pool_larger_than_the_machine_is_refused_with_both_figures() -> None:
    huge = plan_kv_cache(request(SMOLLM_TOKEN_BYTES, 8192, memory_bytes=TiB), None)
    with pytest.raises(ValueError) as refused:
        check_pool_fits(huge, FreeMemory(20 * GiB, "MemAvailable"))
    message = str(refused.value)
    assert "\n" not in message
    for figure in ("--kv-cache-memory asks for a KV pool of 1024.0 GiB", "1,491,308 blocks",
                   "20.0 GiB free (MemAvailable)", "lower --kv-cache-memory to at most 20.0 GiB",
                   "leave it unset"):
        assert figure in message, message
    # weights that are mapped but not read yet take their share once decode reads them
    plan = plan_kv_cache(request(LLAMA8B_TOKEN_BYTES, 131072, memory_bytes=16 * GiB,
                                 dtype="float16"), None)
    check_pool_fits(plan, FreeMemory(20 * GiB, "MemAvailable"))
    with pytest.raises(ValueError, match=r"20.0 GiB free \(free memory of cuda:0\) less 4.6 GiB "
                                         r"of weights not yet resident; lower --kv-cache-memory "
                                         r"to at most 15.4 GiB"):
        check_pool_fits(plan, FreeMemory(20 * GiB, "free memory of cuda:0"), int(4.6 * GiB))
    check_pool_fits(huge, None)  # unknown: nothing to check against
    auto = plan_kv_cache(request(SMOLLM_TOKEN_BYTES, 8192), free_bytes=GiB)
    check_pool_fits(auto, FreeMemory(GiB, "MemAvailable"))  # within its budget by construction


def test_unknown_free_memory_falls_back_to_a_fixed_budget_and_says_so() -> None:
    plan = plan_kv_cache(request(SMOLLM_TOKEN_BYTES, 8192), free_bytes=None)
    assert plan.budget_bytes == FALLBACK_BUDGET_BYTES and plan.num_tokens == 8736
    tiny = plan_kv_cache(request(SMOLLM_TOKEN_BYTES, 32768), free_bytes=None)
    assert "free memory unknown" in tiny.cap_reason


@pytest.fixture(scope="module")
def tiny(tiny_model_factory) -> LLM:
    return LLM(str(tiny_model_factory("llama")), device="cpu", kv_cache_memory_bytes=2 * MiB)


def probe(free_bytes: int | None, source: str = "MemAvailable"):
    """A memory probe that says ``free_bytes`` are free, from ``source``."""
    return lambda device: None if free_bytes is None else FreeMemory(free_bytes, source)


def engine_with(tiny: LLM, free_bytes: int | None, **config) -> LLMEngine:
    config = EngineConfig(model=tiny.engine.config.model, device="cpu", **config)
    return LLMEngine(config, loaded=tiny.engine.loaded, memory_probe=probe(free_bytes))


def test_the_engine_logs_a_capped_context_and_reports_it(tiny, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="agentd"):
        engine = engine_with(tiny, free_bytes=2 * MiB)  # a 1 MiB budget: 2,048 tiny tokens
    assert engine.max_model_len == engine.scheduler.max_model_len == 2048
    kv = engine.stats().kv_cache
    assert (kv.model_len, kv.max_model_len, kv.num_tokens, kv.dtype) == (4096, 2048, 2048,
                                                                        "float32")
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    message = warning.getMessage()
    assert "max_model_len 2048, below the model's 4096" in message
    assert "4,096 tokens" in message and "512 bytes a token" in message and "1 MiB" in message
    assert message.endswith(kv.cap_reason)
    with pytest.raises(ValueError, match="lower --max-model-len"):
        engine_with(tiny, free_bytes=2 * MiB, max_model_len=4096)


def test_the_engine_sizes_for_every_sequence_and_keeps_an_explicit_pool(tiny) -> None:
    engine = engine_with(tiny, free_bytes=GiB, max_num_seqs=4)
    kv = engine.stats().kv_cache
    assert (engine.num_blocks, kv.num_tokens, engine.max_model_len) == (4 * 256, 4 * 4096, 4096)
    assert kv.cap_reason is None and kv.budget_bytes == GiB // 2

    config = EngineConfig(model=tiny.engine.config.model, device="cpu",
                          kv_cache_memory_bytes=64 * 16 * TINY_TOKEN_BYTES)
    for free_bytes in (GiB, 64 * 16 * TINY_TOKEN_BYTES, None):  # the figure only bounds it
        explicit = LLMEngine(config, loaded=tiny.engine.loaded,
                             memory_probe=probe(free_bytes))
        assert explicit.num_blocks == 64 and explicit.stats().kv_cache.budget_bytes is None
        assert explicit.max_model_len == 1024 and "--kv-cache-memory" in \
            explicit.stats().kv_cache.cap_reason


def test_the_engine_refuses_a_pool_the_machine_cannot_hold_before_building_it(tiny) -> None:
    """The sizes of the issue: 100 GiB and 1 TiB asked on a machine with 20 GiB free."""
    for size in (100 * GiB, TiB):
        config = EngineConfig(model=tiny.engine.config.model, device="cpu",
                              kv_cache_memory_bytes=size)
        with pytest.raises(ValueError, match=r"--kv-cache-memory asks for a KV pool of "
                                             r"(100.0 GiB|1.0 TiB) .* 20.0 GiB free "
                                             r"\(MemAvailable\); lower --kv-cache-memory"):
            LLMEngine(config, loaded=tiny.engine.loaded, memory_probe=probe(20 * GiB))


_POOL_RSS = """
import sys, torch
from agentd.engine.kv_sizing import proc_status_bytes
from agentd.engine.model_runner import lazy_zeros
dtype = getattr(torch, sys.argv[1])
before = proc_status_bytes("VmRSS")
pool = lazy_zeros((2, 4096, 16, 8, 128), dtype, torch.device("cpu"))  # 256 or 512 MiB
assert pool.dtype == dtype and pool.shape == (2, 4096, 16, 8, 128)
pool[:, 7] = 1.5  # two blocks' keys and values: 128 or 256 KiB
grown = proc_status_bytes("VmRSS") - before
assert pool[:, 6].abs().sum() == 0 and pool[1, 7, 3, 2, 100] == 1.5
print(grown, pool.nbytes)
"""


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_large_pool_costs_rss_only_where_written(dtype: str) -> None:
    """In a fresh process, as a daemon allocates its pool at start: a test worker's heap, after
    other tests, may hand calloc a reused chunk it must zero (the whole pool resident)."""
    done = subprocess.run([sys.executable, "-c", _POOL_RSS, dtype], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    grown, nbytes = (int(v) for v in done.stdout.split())
    assert grown < 32 * MiB, f"{grown / MiB:.0f} MiB resident of a {nbytes / MiB:.0f} MiB pool"
