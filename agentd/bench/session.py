"""One ``agentd bench`` invocation: workloads in, per-workload results out.

Steps: find out what the server is, load and trim the workloads (with a local tokenizer:
``--tokenizer``, else the baseline model's, else the default model's), run every workload's
phases against it while sampling the daemon's memory, then run the transformers baseline when
asked.

Invariants: the pins a run creates are deleted however it ends (Ctrl-C and SIGTERM included,
SIGKILL aside); the daemon's memory is sampled only when its pid belongs to this machine (a
loopback URL, or ``--daemon-pid``); the baseline runs after the server phases, so the two never
compete for the CPU; errors a user can fix surface as ``BenchError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentd.bench.client import BenchClient, BenchError, ServerInfo, is_local
from agentd.bench.results import WorkloadResult
from agentd.bench.rss import RssSampler
from agentd.bench.runner import BenchSettings, Progress, WorkloadRunner
from agentd.bench.workload import (
    Namespace,
    Workload,
    WorkloadError,
    load_workload,
    trim_to_budget,
)


@dataclass(frozen=True)
class BenchOptions:
    url: str
    api_key: str | None
    model: str | None
    workload_paths: tuple[Path, ...]
    prompt_tokens: int | None  # None: send the workloads whole
    settings: BenchSettings
    tokenizer: str | None = None
    force_openai: bool = False
    daemon_pid: int | None = None
    baseline: str | None = None  # "hf"
    baseline_model: str | None = None
    api: str = "chat"  # the wire the requests use: chat, responses or messages
    tools_in_system: bool = False  # tools as system text: the same prompt on every server


@dataclass
class BenchRun:
    server: ServerInfo
    results: list[WorkloadResult]
    load_avg: tuple[float, float]  # 1-minute load average at the start and at the end


def load_tokenizer_for(options: BenchOptions) -> Any:
    from agentd.model.loader import ModelLoadError, load_tokenizer, resolve_model

    try:
        if options.tokenizer is not None:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(options.tokenizer)
        return load_tokenizer(resolve_model(options.baseline_model))
    except (ModelLoadError, OSError, ValueError) as exc:
        raise BenchError(f"cannot load a tokenizer to size the prompts ({exc}); pass "
                         "--tokenizer DIR (a directory with tokenizer.json)") from exc


def prepare_workloads(options: BenchOptions, tokenizer: Any) -> list[Workload]:
    try:
        workloads = [load_workload(path) for path in options.workload_paths]
    except WorkloadError as exc:
        raise BenchError(str(exc)) from exc
    if options.prompt_tokens is None:
        return workloads
    return [trim_to_budget(w, tokenizer, options.prompt_tokens) for w in workloads]


def run_bench(options: BenchOptions, progress: Progress) -> BenchRun:
    load_at_start = os.getloadavg()[0]
    try:
        server, results = asyncio.run(_run_server(options, progress))
    except asyncio.CancelledError as exc:
        raise BenchError("stopped by SIGTERM before the end; nothing reported") from exc
    if options.baseline == "hf":
        from agentd.bench.baseline_hf import run_hf_baseline

        for result in results:
            result.baseline = run_hf_baseline(options.baseline_model, result.workload,
                                              options.settings.requests,
                                              options.settings.max_tokens, progress)
    return BenchRun(server, results, (load_at_start, os.getloadavg()[0]))


async def _run_server(options: BenchOptions,
                      progress: Progress) -> tuple[ServerInfo, list[WorkloadResult]]:
    _cancel_on_sigterm()
    client = BenchClient(options.url, options.api_key, api=options.api,
                         tools_in_system=options.tools_in_system)
    try:
        server = await client.detect(options.model, options.force_openai)  # fail fast
        tokenizer = load_tokenizer_for(options)
        workloads = prepare_workloads(options, tokenizer)
        pid = options.daemon_pid
        if pid is None and server.pid is not None and is_local(server.root_url):
            pid = server.pid
        # One short request first, so that no measured request pays for the server's warm-up.
        await client.chat("warmup", server.model, [{"role": "user", "content": "Hello"}], [],
                          Namespace(), 2)
        rss = RssSampler(pid)
        rss.start()
        results = []
        try:
            for workload in workloads:
                runner = WorkloadRunner(client, server, options.settings, workload,
                                        options.prompt_tokens, tokenizer, progress, rss)
                results.append(await runner.run())
        finally:
            rss.stop()
        return server, results
    finally:
        await client.aclose()


def _cancel_on_sigterm() -> None:
    """Let SIGTERM cancel the run like Ctrl-C, so that ``finally`` blocks delete the run's pin."""
    task = asyncio.current_task()
    if task is None:
        return
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not main thread
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
