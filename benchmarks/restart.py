"""What a restart costs a pinned prefix: its KV read from the block store vs recomputed.

Starts ``agentd start`` on a free port with a fresh state dir (plus ``--daemon-args``), pins a
workload's prefix (system prompt + tools), then ``kill -9``s the daemon and starts it again
twice: with the pin's KV in the store (``kv-store/``), then with the store deleted (the daemon
then recomputes the pin: a cold prefill of the prefix, what a restart without it costs). For
each start it prints the time to ready, the daemon's own ``pin_restore`` report (where the pin
came from, how long that took) and the TTFT of the first request after it. Everything else
(cold/warm TTFT, pressure, throughput) is ``agentd bench``.

    python benchmarks/restart.py
    python benchmarks/restart.py --workload research --daemon-args "--dtype bfloat16"
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import shutil
import tempfile
from pathlib import Path

import httpx

from agentd.bench.client import BenchClient, RequestResult
from agentd.bench.spawn import SpawnedDaemon
from agentd.bench.workload import Namespace, Workload, load_workload, packaged_path

PIN_NAME = "bench-restart"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="coding",
                        help="coding, research, support, or a workload JSON file")
    parser.add_argument("--daemon-args", default="--kv-cache-memory 1GiB",
                        help="`agentd start` options [default: a pool whose pin budget holds "
                             "any packaged workload's prefix]")
    return parser.parse_args()


def workload_path(name: str) -> Path:
    path = Path(name)
    return path if path.exists() else packaged_path(name.removesuffix("_agent") + "_agent")


async def pin(url: str, workload: Workload) -> dict:
    client = BenchClient(url, None)
    try:
        described = await client.create_pin(PIN_NAME, workload.system, workload.tools)
    finally:
        await client.aclose()
    if isinstance(described, str):
        raise SystemExit(described)
    return described


async def first_request(url: str, workload: Workload) -> RequestResult:
    client = BenchClient(url, None)
    try:
        model = (await client.detect(None, False)).model
        messages = [{"role": "system", "content": workload.system},
                    {"role": "user", "content": "First question after the restart."}]
        return await client.chat("first request", model, messages, workload.tools,
                                 Namespace(), max_tokens=1)
    finally:
        await client.aclose()


def main() -> None:
    args = parse_args()
    workload = load_workload(workload_path(args.workload))
    with tempfile.TemporaryDirectory(prefix="agentd-restart-") as tmp:
        # --no-kv-disk: the pin's own records (pinned) or its recompute, no tier's copies
        daemon = SpawnedDaemon(Path(tmp) / "state", "--log-level", "warning", "--no-kv-disk",
                               *shlex.split(args.daemon_args), ready_timeout_s=900)
        try:
            daemon.start()
            described = asyncio.run(pin(daemon.url, workload))
            print(f"workload {workload.name}: pinned {described.get('num_tokens')} tokens as "
                  f"{PIN_NAME!r}")
            print(f"{'restart after kill -9':30} {'ready s':>8} {'pin from':>12} "
                  f"{'restore s':>10} {'first TTFT s':>13} {'cached':>7}")
            for label, drop_store in (("pin's KV in the store", False),
                                      ("store deleted", True)):
                daemon.kill()
                if drop_store:
                    shutil.rmtree(daemon.state_dir / "kv-store", ignore_errors=True)
                ready_s = daemon.start()
                report = httpx.get(f"{daemon.url}/v1/stats", timeout=60).json()["pin_restore"]
                entry = next(e for e in report if e["name"] == PIN_NAME)
                first = asyncio.run(first_request(daemon.url, workload))
                ttft = f"{first.ttft_s:.3f}" if first.ttft_s is not None else "-"
                print(f"{label:30} {ready_s:8.2f} "
                      f"{entry.get('source', entry.get('error', '?')):>12} "
                      f"{entry['elapsed_s']:10.3f} {ttft:>13} {first.cached_tokens!s:>7}")
        finally:
            daemon.stop()


if __name__ == "__main__":
    main()
