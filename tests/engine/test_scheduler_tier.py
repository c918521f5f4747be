"""The scheduler over a tier under the pool (a fake one, plain Python): a waiting request whose
next blocks the tier holds takes its seat and those blocks, waits out of the queue while they
load, and runs from what verified; an abort while loading frees the blocks only once the load
has landed (the loader writes into them until then)."""

from __future__ import annotations

from dataclasses import dataclass, field

from agentd.cache import BlockHash, KVCacheManager, LoadJob, hash_blocks
from agentd.engine.request import Request, RequestStatus
from agentd.engine.sampling_params import SamplingParams
from agentd.engine.scheduler import Scheduler

BLOCK_SIZE = 4


@dataclass
class FakeTier:
    """Holds ``stored`` hashes; a job (started from a step's ``loads``, as the engine does
    after the step's copies) lands when the test says, with ``good`` blocks read."""

    stored: set[BlockHash] = field(default_factory=set)
    jobs: list[LoadJob] = field(default_factory=list)
    landed: list[LoadJob] = field(default_factory=list)
    enabled: bool = True

    def count_leading(self, block_hashes) -> int:
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self.stored:
                break
            count += 1
        return count

    def take_landed(self) -> list[LoadJob]:
        landed, self.landed = self.landed, []
        return landed

    def land(self, good: int) -> None:
        job = self.jobs.pop(0)
        job.num_loaded = good
        self.landed.append(job)


def request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=4), max_output_tokens=4)


class LoadingScheduler(Scheduler):
    """Starts each step's loads on the tier, as ``LLMEngine.step`` does."""

    def schedule(self):
        out = super().schedule()
        self.tier.jobs.extend(out.loads)
        return out


def setup(num_blocks: int = 16) -> tuple[Scheduler, FakeTier, list[int]]:
    tier = FakeTier()
    kv_cache = KVCacheManager(num_blocks, BLOCK_SIZE)
    scheduler = LoadingScheduler(kv_cache, max_num_seqs=4, max_num_batched_tokens=64,
                                 max_model_len=128, tier=tier)
    prompt = list(range(100, 122))  # 22 tokens: 5 full blocks
    tier.stored.update(hash_blocks(prompt, BLOCK_SIZE)[:4])  # the tier has the first 4
    return scheduler, tier, prompt


def test_a_request_loads_what_the_tier_holds_and_computes_the_rest() -> None:
    scheduler, tier, prompt = setup()
    scheduler.add_request(request("a", prompt))
    out = scheduler.schedule()
    assert out.empty and list(scheduler.loading) == ["a"] and not scheduler.waiting
    (job,) = tier.jobs
    assert out.loads == [job]
    assert job.block_hashes == hash_blocks(prompt, BLOCK_SIZE)[:4]
    assert job.block_ids == scheduler.kv_cache.block_table("a") and job.num_pool_tokens == 0
    assert scheduler.has_unfinished()
    assert scheduler.schedule().empty  # still loading: nothing runs, nothing is admitted twice

    tier.land(good=3)  # the 4th block failed its checks: it and what follows are computed
    out = scheduler.schedule()
    assert out.admitted_ids == ["a"]
    ((row),) = out.scheduled
    assert (row.start_position, len(row.token_ids)) == (12, 10) and row.sample
    assert scheduler.requests["a"].num_cached_tokens == 12
    assert scheduler.stats.prefix_cache_hits == scheduler.stats.prefix_cache_disk_hits == 12
    pool = scheduler.kv_cache.pool
    hashes = hash_blocks(prompt, BLOCK_SIZE)
    assert [pool.get_cached(h) for h in hashes[:3]] == row.block_table[:3]  # registered
    assert pool.get_cached(hashes[3]) is None  # the failed one is not
    pool.check_integrity()


def test_an_abort_while_loading_frees_the_blocks_once_the_load_lands() -> None:
    scheduler, tier, prompt = setup()
    scheduler.add_request(request("a", prompt))
    scheduler.schedule()
    pool = scheduler.kv_cache.pool
    assert pool.num_free == 16 - 4
    assert scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED) is not None
    assert pool.num_free == 16 - 4  # the loader may still be writing into them
    tier.land(good=4)
    assert scheduler.schedule().empty
    assert pool.num_free == 16 and not scheduler.loading and not scheduler.has_unfinished()
    assert all(pool.get_cached(h) is None for h in hash_blocks(prompt, BLOCK_SIZE))
    pool.check_integrity()


def test_the_pools_own_hits_come_first_and_the_tier_continues_them() -> None:
    scheduler, tier, prompt = setup()
    kv_cache = scheduler.kv_cache
    hashes = hash_blocks(prompt, BLOCK_SIZE)
    block_ids = kv_cache.pool.allocate(2)  # the pool holds the first 2 blocks, freed but cached
    kv_cache.pool.cache_full_blocks(block_ids, hashes[:2])
    kv_cache.pool.free(block_ids)
    scheduler.add_request(request("a", prompt))
    scheduler.schedule()
    (job,) = tier.jobs
    assert job.num_pool_tokens == 8 and job.block_hashes == hashes[2:4]
    assert kv_cache.block_table("a")[:2] == block_ids
    tier.land(good=2)
    ((row),) = scheduler.schedule().scheduled
    assert row.start_position == 16
    assert scheduler.stats.prefix_cache_hits == 16 and scheduler.stats.prefix_cache_disk_hits == 8


def test_without_room_for_the_loaded_blocks_it_waits_in_the_queue() -> None:
    scheduler, tier, prompt = setup(num_blocks=3)  # 4 stored blocks do not fit in 3
    scheduler.add_request(request("a", prompt))
    out = scheduler.schedule()
    assert not scheduler.loading and not tier.jobs
    assert out.failed_ids == ["a"]  # an empty engine that cannot hold it: it never will
