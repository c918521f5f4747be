"""How long a pin registration stalls running requests: its KV snapshot written on the engine
thread (before) vs gathered there and written from a worker thread (after: today's path, into
the block store's pinned segments), measured side by side.

One process, the default model: 8 requests decode without pause (c=8 load) while a workload's
prefix (system prompt + tools; its KV already cached, as when an operator pins a prompt agents
already send) is pinned, snapshotted to a fresh state dir and unpinned, alternating the two
snapshot paths for ``--rounds`` rounds (before: ``torch.save`` + fsync inside one engine-thread
call, as the code did until 93e2196; after: ``PinService``'s path). For each registration it
records every engine step's end and prints the longest gap between consecutive step ends (what
a running request waits for its next token) next to the median step, and the time the engine
thread itself spent on the snapshot (before: gather + torch.save + fsync; after: the gather
alone). torch runs on ``--threads`` threads (1 by default: on a shared 2-core machine, OpenMP's
spin-waiting across two threads makes steps erratic).

    python benchmarks/pin_stall.py [--workload research] [--rounds 5] [--kv-cache-memory 1GiB]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from agentd.bench.workload import load_workload, packaged_path
from agentd.cache import PinKey
from agentd.chat import render_chat
from agentd.config import EngineConfig, parse_size
from agentd.engine.async_engine import AsyncEngine
from agentd.engine.request import EngineRequest
from agentd.engine.sampling_params import SamplingParams
from agentd.pins.service import PinService, PinSpec
from agentd.pins.stored_kv import write_pin_kv

NUM_STREAMS = 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="research", help="coding, research or support")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args()


def cpu_report() -> str:
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    line = next((x for x in flags.splitlines() if x.startswith("Flags:")), "Flags: ?")
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni")
    have = [f for f in wanted if f" {f}" in line]
    return (f"lscpu flags (of interest): {' '.join(have)}; "
            f"torch cpu capability: {torch.backends.cpu.get_cpu_capability()}; "
            f"torch threads: {torch.get_num_threads()}")


class StepClock:
    """Records when each engine step ends (wraps the engine's ``step`` on its own thread)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.ends: list[float] = []
        step = engine.engine.step

        def timed():
            deltas = step()
            self.ends.append(time.perf_counter())
            return deltas

        engine.engine.step = timed

    def longest_gap_s(self, start: float, end: float) -> float:
        """The longest time between step ends from ``start`` to the first step end after
        ``end`` (a stall at the very end of the window counts in full)."""
        inside = [t for t in self.ends if start <= t <= end]
        after = [t for t in self.ends if t > end][:1]
        points = [start, *inside, *after]
        return max(b - a for a, b in zip(points, points[1:], strict=False))


async def keep_decoding(engine: AsyncEngine, index: int, stop: asyncio.Event) -> None:
    while not stop.is_set():
        prompt = engine.tokenizer(f"Count from {index} to a thousand, one per line:").input_ids
        params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
        async for _ in engine.add_request(EngineRequest(prompt, params)):
            if stop.is_set():
                break


def timed(fn):
    """``fn`` wrapped to return (its result, the seconds it took)."""
    def run(*args):
        start = time.perf_counter()
        result = fn(*args)
        return result, time.perf_counter() - start
    return run


def torch_save_like_before(payload: dict, path: Path) -> None:
    """What ``PinManager.save_snapshot`` did before (93e2196), on the engine thread."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


async def register(service: PinService, spec: PinSpec,
                   on_engine_thread: bool) -> tuple[float, float]:
    """Pin, snapshot and unpin; returns the engine-thread seconds the snapshot took and when
    the pin was registered (its snapshot started)."""
    await service.add(spec, persist=False)
    pinned_at = time.perf_counter()
    key = PinKey(spec.owner, spec.name)
    path, state_dir = service._snapshot_path(key), service.state_dir
    assert path is not None and state_dir is not None
    if on_engine_thread:  # the old path: gather, torch.save and fsync in one engine call
        _, engine_s = await service.engine.call(timed(lambda e: torch_save_like_before(
            e.gather_pin_snapshot(key), path)))
    else:  # what PinService._store_kv does: a buffer made here, the gather there, the records
        # written into the block store's pinned segments here
        shape, dtype = await service.engine.call(lambda e: e.pin_snapshot_shape(key))
        buffer = await asyncio.to_thread(torch.zeros, shape, dtype=dtype)
        payload, engine_s = await service.engine.call(timed(
            lambda e: e.gather_pin_snapshot(key, buffer)))
        pin = await service.engine.get_pin(key)
        keys = service.engine.pin_record_keys(pin.all_token_ids, pin.cache_salt)
        store = await asyncio.to_thread(service.engine.pin_store, state_dir)
        await asyncio.to_thread(write_pin_kv, store, keys, payload)
    await service.remove(key)
    return engine_s, pinned_at


async def run(args: argparse.Namespace) -> None:
    workload = load_workload(packaged_path(args.workload.removesuffix("_agent") + "_agent"))
    config = EngineConfig(kv_cache_memory_bytes=parse_size(args.kv_cache_memory),
                          num_threads=args.threads)
    engine = AsyncEngine.from_config(config)
    engine.start()
    state_dir = Path(tempfile.mkdtemp(prefix="agentd-pin-stall-"))
    try:
        service = PinService(engine, state_dir)
        prefix = render_chat(engine.tokenizer, [{"role": "system", "content": workload.system},
                                                {"role": "user", "content": "hi"}],
                             workload.tools, None).prompt_token_ids
        async for _ in engine.add_request(EngineRequest(prefix, SamplingParams(max_tokens=1))):
            pass  # the prefix is cached, as agents already send it
        clock = StepClock(engine)
        stop = asyncio.Event()
        streams = [asyncio.create_task(keep_decoding(engine, i, stop))
                   for i in range(NUM_STREAMS)]
        await asyncio.sleep(3.0)  # all 8 decoding
        results: dict[str, list[float]] = {"engine thread (before)": [], "worker (after)": []}
        engine_s: dict[str, list[float]] = {label: [] for label in results}
        snapshot_gaps: dict[str, list[float]] = {label: [] for label in results}
        for round_index in range(args.rounds):
            order = list(results) if round_index % 2 == 0 else list(reversed(results))
            for label in order:
                spec = PinSpec(f"stall-{round_index}", workload.system, workload.tools)
                start = time.perf_counter()
                seconds, pinned_at = await register(service, spec, label.startswith("engine"))
                engine_s[label].append(seconds)
                end = time.perf_counter()
                await asyncio.sleep(1.0)  # steady decoding between registrations
                results[label].append(clock.longest_gap_s(start, end))
                snapshot_gaps[label].append(clock.longest_gap_s(pinned_at, end))
        steady = [b - a for a, b in zip(clock.ends, clock.ends[1:], strict=False)]
        stop.set()
        await asyncio.gather(*streams)
        info = (await service.list(everyone=True), engine.stats())
        print(cpu_report())
        print(f"workload {args.workload}: {len(prefix)} prompt tokens; {NUM_STREAMS} requests "
              f"decoding; pool {args.kv_cache_memory}; pins left {len(info[0])}")
        print(f"median engine step over the run: {statistics.median(steady) * 1e3:.1f} ms")
        for label, gaps in results.items():
            print(f"snapshot written on the {label}:")
            for what, values in (("longest step gap during the registration", gaps),
                                 ("... from the snapshot's start on", snapshot_gaps[label]),
                                 ("engine-thread time of the snapshot", engine_s[label])):
                shown = ", ".join(f"{v * 1e3:.0f}" for v in values)
                print(f"  {what:42s} median {statistics.median(values) * 1e3:6.0f} ms  "
                      f"({shown})")
        for what, table in (("longest step gap", results), ("... from the snapshot on",
                                                             snapshot_gaps),
                            ("engine-thread time", engine_s)):
            before, after = (statistics.median(v) for v in table.values())
            print(f"{what}: after / before = {after / before:.2f}")
    finally:
        engine.shutdown()
        shutil.rmtree(state_dir, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(run(parse_args()))
