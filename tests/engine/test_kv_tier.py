"""The disk tier under a real engine (a tiny random llama, fp32, the exact mode): blocks evicted
from the pool come back from disk with the bytes they were computed with (so the same logits and
greedy tokens as recomputing them), also after a restart; another tenant's blocks never serve;
a block whose bytes changed on disk is recomputed, never served."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch

from agentd.engine.llm_engine import LLMEngine
from agentd.engine.request import EngineRequest
from agentd.engine.sampling_params import SamplingParams
from agentd.llm import engine_config

BLOCK_SIZE = 16
POOL_BLOCKS = 48  # 8 KiB a block of the tiny llama's fp32 KV
PROMPT_LEN = 200  # 12 whole blocks, the last token always computed
NUM_CACHED = PROMPT_LEN // BLOCK_SIZE * BLOCK_SIZE
MAX_TOKENS = 8


def make_engine(model: Path, disk: Path | None, block_bytes: int = 8192,
                **engine_args) -> LLMEngine:
    config = engine_config(str(model), kv_cache_memory_bytes=POOL_BLOCKS * block_bytes,
                           dtype="float32", speculative="off",
                           kv_disk_dir=None if disk is None else str(disk), **engine_args)
    return LLMEngine(config)


def run(engine: LLMEngine, prompt: list[int], salt: str | None = None,
        session: str | None = None) -> tuple[list[int], int]:
    """Greedy tokens and cached prompt tokens of one request run alone."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    request_id = engine.add_request(EngineRequest(prompt, params, cache_salt=salt,
                                                  session=session))
    tokens: list[int] = []
    cached = None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            assert delta.request_id == request_id
            tokens += delta.token_ids
            cached = delta.num_cached_tokens if cached is None else cached
    return tokens, cached


def prompts(seed: int, count: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(length)] for _ in range(count)]


def evict(engine: LLMEngine, prompt: list[int]) -> None:
    """Run unrelated prompts until none of ``prompt``'s blocks is left in the pool."""
    for filler in prompts(99, 4, 600):
        run(engine, filler)
    assert engine.kv_cache.find_cached_prefix(prompt).num_tokens == 0


def stored(engine: LLMEngine, num_blocks: int) -> None:
    """Wait for the writer thread to have stored ``num_blocks`` blocks."""
    deadline = time.monotonic() + 30
    while (stats := engine.disk.stats()).num_blocks < num_blocks or stats.write_queue_blocks:
        assert time.monotonic() < deadline, stats
        time.sleep(0.01)


def pool_kv(engine: LLMEngine, prompt: list[int]) -> list[torch.Tensor]:
    """The KV of ``prompt``'s cached blocks, layer by layer, in chain order."""
    hit = engine.kv_cache.find_cached_prefix(prompt)
    assert hit.num_tokens == NUM_CACHED
    index = torch.tensor(hit.block_ids)
    return [layer.index_select(0, index) for layer in engine.runner.kv_caches]


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def reference(model: Path) -> tuple[LLMEngine, list[int], list[int]]:
    """An engine without the tier, its greedy tokens for the prompt, the prompt."""
    engine = make_engine(model, None)
    (prompt,) = prompts(1, 1, PROMPT_LEN)
    tokens, cached = run(engine, prompt)
    assert cached == 0
    return engine, prompt, tokens


def test_an_evicted_prefix_comes_back_from_disk_exactly(model, reference, tmp_path) -> None:
    ref_engine, prompt, expected = reference
    engine = make_engine(model, tmp_path / "kv")
    assert run(engine, prompt) == (expected, 0)
    stored(engine, NUM_CACHED // BLOCK_SIZE)
    evict(engine, prompt)
    assert run(engine, prompt) == (expected, NUM_CACHED)
    stats = engine.stats()
    assert stats.scheduler.prefix_cache_disk_hits == NUM_CACHED
    assert stats.kv_disk.num_blocks_read == NUM_CACHED // BLOCK_SIZE
    for loaded, computed in zip(pool_kv(engine, prompt), pool_kv(ref_engine, prompt),
                                strict=True):
        assert torch.equal(loaded, computed)  # the bytes it was computed with: same logits
    engine.kv_cache.pool.check_integrity()
    engine.close()


def test_an_evicted_q8_prefix_comes_back_from_disk_byte_for_byte(tiny_model_factory,
                                                                 tmp_path) -> None:
    """A q8_0 pool (tiny qwen3: one KV head of 32, 34 bytes a head row): its blocks' bytes go to
    disk and come back as they were, the greedy tokens those of the blocks computed."""
    qwen3 = tiny_model_factory("qwen3")
    (prompt,) = prompts(1, 1, PROMPT_LEN)
    ref_engine = make_engine(qwen3, None, 2 * 2 * BLOCK_SIZE * 34, kv_cache_dtype="q8_0")
    expected, _ = run(ref_engine, prompt)
    engine = make_engine(qwen3, tmp_path / "kv", 2 * 2 * BLOCK_SIZE * 34, kv_cache_dtype="q8_0")
    assert engine.runner.kv_caches[0].dtype == torch.int8
    assert run(engine, prompt) == (expected, 0)
    stored(engine, NUM_CACHED // BLOCK_SIZE)
    evict(engine, prompt)
    assert run(engine, prompt) == (expected, NUM_CACHED)
    assert engine.stats().scheduler.prefix_cache_disk_hits == NUM_CACHED
    for loaded, computed in zip(pool_kv(engine, prompt), pool_kv(ref_engine, prompt),
                                strict=True):
        assert torch.equal(loaded, computed)
    engine.close()


def test_blocks_outlive_a_restart_and_serve_their_tenant_only(model, reference,
                                                              tmp_path) -> None:
    _, prompt, expected = reference
    first = make_engine(model, tmp_path / "kv")
    assert run(first, prompt, salt="tenant-a") == (expected, 0)
    stored(first, NUM_CACHED // BLOCK_SIZE)
    first.close()  # a restart: a new engine on the same directory
    second = make_engine(model, tmp_path / "kv")
    assert second.stats().kv_disk.num_blocks == NUM_CACHED // BLOCK_SIZE
    assert run(second, prompt, salt="tenant-b")[1] == 0  # another tenant's chain
    assert run(second, prompt)[1] == 0  # nor without a salt
    assert run(second, prompt, salt="tenant-a") == (expected, NUM_CACHED)
    second.close()


def test_a_block_changed_on_disk_is_recomputed_not_served(model, reference, tmp_path) -> None:
    _, prompt, expected = reference
    first = make_engine(model, tmp_path / "kv")
    run(first, prompt)
    stored(first, NUM_CACHED // BLOCK_SIZE)
    first.close()
    (segment,) = (tmp_path / "kv").glob("*/*.seg")
    data = bytearray(segment.read_bytes())
    record = len(data) // (NUM_CACHED // BLOCK_SIZE)
    data[5 * record + 100] ^= 0x10  # inside the 6th block's KV
    segment.write_bytes(data)
    second = make_engine(model, tmp_path / "kv")
    assert run(second, prompt) == (expected, 5 * BLOCK_SIZE)  # 5 loaded, the rest computed
    assert second.stats().kv_disk.num_blocks_rejected == 1
    second.close()


def test_the_engine_never_waits_on_the_disk(model, reference, tmp_path) -> None:
    """A writer stuck on the disk: the engine serves on and drops what its queue cannot hold.
    A loader stuck on the disk: its request waits, another runs to its end meanwhile."""
    _, prompt, expected = reference
    engine = make_engine(model, tmp_path / "kv")
    disk = engine.disk
    run(engine, prompt)
    stored(engine, NUM_CACHED // BLOCK_SIZE)
    evict(engine, prompt)

    gate = threading.Event()
    put, read_into = disk.store.put, disk.store.read_into
    disk.store.put = lambda *args: gate.wait() and put(*args)
    disk.store.read_into = lambda *args: gate.wait() and read_into(*args)
    disk.max_queue_bytes = 40 * disk.store.block_bytes
    dropped = disk.num_writes_dropped
    for other in prompts(7, 3, 300):  # the writer is stuck: the queue fills, then drops
        run(engine, other)
    assert disk.num_writes_dropped > dropped and disk.stats().write_queue_blocks <= 40

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    waiting = engine.add_request(EngineRequest(prompt, params))
    (other,) = prompts(8, 1, 40)
    running = engine.add_request(EngineRequest(other, params))
    finished: set[str] = set()
    for _ in range(100):  # the loader is stuck on the first block: the other request ends
        finished.update(d.request_id for d in engine.step() if d.finish_reason)
        if running in finished:
            break
    assert finished == {running} and list(engine.scheduler.loading) == [waiting]
    gate.set()
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens += delta.token_ids
            cached = delta.num_cached_tokens
    assert tokens == expected and cached == NUM_CACHED
    engine.close()


def test_a_write_dropped_on_a_full_queue_is_made_when_the_pool_evicts_the_block(
        model, reference, tmp_path) -> None:
    """The writer stuck and the queue full while the prompt is computed: all its blocks' writes
    are dropped. Once the queue has room, the pool's eviction of those blocks stages them again,
    so the prompt still comes back from disk, with the tokens it was computed with."""
    _, prompt, expected = reference
    engine = make_engine(model, tmp_path / "kv")
    disk = engine.disk
    gate = threading.Event()
    put = disk.store.put
    disk.store.put = lambda *args: gate.wait() and put(*args)
    queue_bytes, disk.max_queue_bytes = disk.max_queue_bytes, 2 * disk.store.block_bytes
    assert run(engine, prompt) == (expected, 0)
    assert disk.num_writes_dropped == NUM_CACHED // BLOCK_SIZE and disk.num_writes_retried == 0
    gate.set()
    disk.max_queue_bytes = queue_bytes
    stored(engine, 0)
    assert disk.store.count_leading(engine.kv_cache.find_cached_prefix(prompt).block_hashes) == 0
    evict(engine, prompt)  # the pool gives the prompt's blocks to other prompts
    assert disk.num_writes_retried == NUM_CACHED // BLOCK_SIZE
    stored(engine, NUM_CACHED // BLOCK_SIZE)
    assert run(engine, prompt) == (expected, NUM_CACHED)
    assert engine.stats().scheduler.prefix_cache_disk_hits == NUM_CACHED
    engine.kv_cache.pool.check_integrity()
    engine.close()


def test_a_load_into_blocks_moved_out_of_a_cached_prefix_corrupts_neither(model, tmp_path) -> None:
    """After a restart, A loads from disk and stays cached; B shares A's first 3 blocks, so its
    table grows into A's cached blocks, whose KV the pool moves elsewhere (a copy before the
    step) while B's blocks load into them. Every copy runs before the load starts: A and B both
    answer as computed, from pool and disk, and nothing fails its checks."""
    reference = make_engine(model, None)
    shared, tail_a, tail_b = prompts(3, 3, 150)
    prompt_a, prompt_b = shared[:48] + tail_a, shared[:48] + tail_b
    expected = {name: run(reference, p)[0] for name, p in (("a", prompt_a), ("b", prompt_b))}
    first = make_engine(model, tmp_path / "kv")
    run(first, prompt_a), run(first, prompt_b)
    stored(first, 2 * (len(prompt_a) // BLOCK_SIZE) - 3)
    first.close()

    engine = make_engine(model, tmp_path / "kv")
    order: list[str] = []
    copy_kv, load = engine.runner.copy_kv, engine.disk.load
    engine.runner.copy_kv = lambda copies: (order.extend("copy" for _ in copies),
                                            copy_kv(copies))[1]
    engine.disk.load = lambda job: (order.append("load"), load(job))[1]
    assert run(engine, prompt_a) == (expected["a"], len(prompt_a) // BLOCK_SIZE * BLOCK_SIZE)
    order.clear()
    assert run(engine, prompt_b) == (expected["b"], len(prompt_b) // BLOCK_SIZE * BLOCK_SIZE)
    # the step that started B's load moved A's blocks out of its way, and copied them first
    assert "load" in order and "copy" in order[:order.index("load")], order
    assert run(engine, prompt_a) == (expected["a"], len(prompt_a) // BLOCK_SIZE * BLOCK_SIZE)
    assert engine.stats().kv_disk.num_blocks_rejected == 0
    engine.kv_cache.pool.check_integrity()
    engine.close()


def test_a_sessions_prefix_is_kept_on_disk_the_part_it_found_in_the_pool_too(
        model, reference, tmp_path) -> None:
    """An anonymous request computes the prompt: its blocks are stored anonymous. A named
    session then extends it: the blocks it computes are stored kept, and so are the ones it
    found in the pool (written again from the pool, once its step's copies ran); read back
    after they left the pool, they hold the bytes they were computed with."""
    ref_engine, prompt, expected = reference
    engine = make_engine(model, tmp_path / "kv")
    store = engine.disk.store
    run(engine, prompt)
    stored(engine, NUM_CACHED // BLOCK_SIZE)
    hashes = engine.kv_cache.find_cached_prefix(prompt).block_hashes[:NUM_CACHED // BLOCK_SIZE]
    assert not any(store.holds(h, keep=True) for h in hashes)
    assert engine.stats().kv_disk.kept_bytes == 0

    longer = prompt + prompts(5, 1, 64)[0]
    run(engine, longer, session="claude-cli:session-1")
    num_blocks = (len(longer) - 1) // BLOCK_SIZE
    stored(engine, num_blocks)
    chain = engine.kv_cache.find_cached_prefix(longer).block_hashes[:num_blocks]
    assert chain[:len(hashes)] == hashes
    assert all(store.holds(h, keep=True) for h in chain)
    assert engine.stats().kv_disk.kept_bytes == num_blocks * store.record_bytes

    evict(engine, prompt)
    assert run(engine, prompt, session="claude-cli:session-1") == (expected, NUM_CACHED)
    assert engine.stats().kv_disk.num_blocks_read == NUM_CACHED // BLOCK_SIZE
    for loaded, computed in zip(pool_kv(engine, prompt), pool_kv(ref_engine, prompt),
                                strict=True):
        assert torch.equal(loaded, computed)
    engine.close()


def test_a_retained_prefix_is_kept_on_disk(model, reference, tmp_path) -> None:
    """A prefix a request asked to hold (cache control) is stored kept, as a session's is: on
    disk it outlives anonymous prefixes' churn for at least its TTL."""
    from agentd.engine.request import RetentionRequest

    _, prompt, _ = reference
    engine = make_engine(model, tmp_path / "kv")
    store = engine.disk.store
    run(engine, prompt)
    num_blocks = NUM_CACHED // BLOCK_SIZE
    stored(engine, num_blocks)
    hashes = engine.kv_cache.find_cached_prefix(prompt).block_hashes[:num_blocks]
    assert not any(store.holds(h, keep=True) for h in hashes)
    held = engine.retain(prompt, RetentionRequest(NUM_CACHED, 300.0))
    assert held is not None and held.num_tokens == NUM_CACHED
    stored(engine, num_blocks)
    deadline = time.monotonic() + 30
    while not all(store.holds(h, keep=True) for h in hashes):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert engine.stats().kv_disk.kept_bytes == num_blocks * store.record_bytes
    engine.close()
