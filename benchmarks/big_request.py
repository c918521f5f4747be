"""What one huge request costs everyone else: ``/health`` latency while it is handled, and RSS.

Starts ``agentd start`` (default model unless ``--daemon-args`` says otherwise) on a free port,
sends one small request to warm it up, then a chat request whose user message is ``--mb``
megabytes of text while another client polls ``/health`` every 50 ms. Prints the big request's
status and time, the slowest ``/health`` answer during it, and the daemon's RSS before, after
and at its peak (VmHWM). Run it on two trees to compare (the machine's CPU flags and torch's
CPU capability are printed with it).

    python benchmarks/big_request.py
    python benchmarks/big_request.py --mb 10 --daemon-args "--dtype bfloat16"
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from agentd.bench.rss import read_status_bytes
from agentd.bench.spawn import SpawnedDaemon


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=10.0, help="size of the user message")
    parser.add_argument("--daemon-args", default="", help="more `agentd start` options")
    return parser.parse_args()


def poll_health(url: str, stop: threading.Event, latencies: list[float]) -> None:
    with httpx.Client(timeout=120) as http:
        while not stop.is_set():
            started = time.perf_counter()
            http.get(f"{url}/health")
            latencies.append(time.perf_counter() - started)
            time.sleep(0.05)


def mib(num_bytes: int | None) -> str:
    return "?" if num_bytes is None else f"{num_bytes / 2**20:,.0f} MiB"


def main() -> None:
    args = parse_args()
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    print(next((line for line in flags.splitlines() if line.startswith("Flags")), "Flags: ?"))
    print(f"torch CPU capability: {torch.backends.cpu.get_cpu_capability()}")
    with tempfile.TemporaryDirectory() as tmp:
        daemon = SpawnedDaemon(Path(tmp) / "state", "--log-level", "warning",
                               *shlex.split(args.daemon_args))
        daemon.start()
        try:
            assert daemon.process is not None
            pid = daemon.process.pid
            chat = f"{daemon.url}/v1/chat/completions"
            httpx.post(chat, json={"messages": [{"role": "user", "content": "hi"}],
                                   "max_tokens": 2}, timeout=120).raise_for_status()
            rss_before = read_status_bytes(pid, "VmRSS")
            hwm_before = read_status_bytes(pid, "VmHWM")
            text = "agents " * int(args.mb * 2**20 / 7)
            stop, latencies = threading.Event(), []
            poller = threading.Thread(target=poll_health, args=(daemon.url, stop, latencies))
            poller.start()
            time.sleep(0.3)
            started = time.perf_counter()
            reply = httpx.post(chat, json={"messages": [{"role": "user", "content": text}]},
                               timeout=600)
            elapsed = time.perf_counter() - started
            stop.set()
            poller.join()
            time.sleep(1.0)  # let the heap settle
            print(f"{args.mb:g} MB request: HTTP {reply.status_code} in {elapsed:.3f} s "
                  f"({reply.json().get('error', {}).get('code')})")
            print(f"/health during it: {len(latencies)} polls, slowest "
                  f"{1000 * max(latencies):.0f} ms")
            print(f"daemon RSS before {mib(rss_before)}, after "
                  f"{mib(read_status_bytes(pid, 'VmRSS'))}; peak (VmHWM) before "
                  f"{mib(hwm_before)}, after {mib(read_status_bytes(pid, 'VmHWM'))}")
        finally:
            daemon.stop()


if __name__ == "__main__":
    main()
