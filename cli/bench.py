"""``agentd bench``: the agent-workload benchmark against agentd or any OpenAI-compatible server.

Invariants: this module imports only click and the standard library at the top (the benchmark
itself, rich, transformers and matplotlib load when the command runs); every user error — a bad
option, nothing listening, matplotlib missing for ``--plot`` — is one ``Error:`` line that says
what to do, raised before any request is sent where it can be checked up front.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import click

from agentd.cli._client import DEFAULT_URL, URL_ENVVAR

QUICK = {"requests": 2, "cold_requests": 2, "pressure_misses": 1, "conversations": 1}


def _concurrency(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of positive integers, "
                                 "e.g. 1,8,32")
    return levels


@click.command()
@click.option("--url", envvar=URL_ENVVAR, show_envvar=True, default=DEFAULT_URL,
              show_default=True, help="Server to measure: agentd, or any OpenAI base URL "
              "(with or without /v1).")
@click.option("--api-key", envvar=["AGENTD_API_KEY", "OPENAI_API_KEY"], default=None,
              help="Bearer key [env: AGENTD_API_KEY, OPENAI_API_KEY].")
@click.option("--model", default=None, help="Model name to request [default: the first of "
              "GET /v1/models].")
@click.option("--workload", "workloads", multiple=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Workload JSON (repeatable) [default: the packaged coding agent].")
@click.option("--all-workloads", is_flag=True,
              help="The four packaged workloads: coding, research, support and code-editing "
              "agents.")
@click.option("--requests", type=click.IntRange(1), default=None,
              help="Requests per warm phase; throughput at C sends max(C, N) "
              "[default: 16; 2 with --quick].")
@click.option("--concurrency", default="1,8,32", show_default=True, callback=_concurrency,
              help="Concurrency levels of the throughput phases.")
@click.option("--max-tokens", type=click.IntRange(1), default=32, show_default=True,
              help="Output tokens per request (greedy; EOS ignored where the server allows).")
@click.option("--prompt-tokens", type=click.IntRange(64), default=2100, show_default=True,
              help="Trim each workload to about this many prompt tokens per request: tools to "
              "~1/4 of it, the system text to the rest.")
@click.option("--full-prompts", is_flag=True, help="Send the workloads untrimmed.")
@click.option("--no-pin", is_flag=True, help="Skip the pinned phases.")
@click.option("--pressure/--no-pressure", default=True, show_default=True,
              help="Measure TTFT after pushing more tokens than the KV pool holds.")
@click.option("--pressure-tokens", type=click.IntRange(1), default=None,
              help="KV pool size to overflow, in tokens [default: from agentd's /v1/stats; "
              "needed for the pressure phase on other servers].")
@click.option("--cold-requests", type=click.IntRange(1), default=None,
              help="Cold requests (each prefills its whole prompt) [default: 3; 2 with "
              "--quick].")
@click.option("--empty-cache/--no-empty-cache", default=True, show_default=True,
              help="End with a throughput phase on prompts no cache holds (C cold prefills "
              "at once).")
@click.option("--conversations", type=click.IntRange(0), default=None,
              help="Multi-turn conversations to replay per workload [default: all].")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write every figure and the raw per-request data as JSON here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Draw TTFT hit/miss distributions and throughput vs concurrency (PNG); "
              "needs matplotlib: pip install 'agentd[plot]'.")
@click.option("--baseline", type=click.Choice(["hf"]), default=None,
              help="Also run the same prompts through transformers generate, sequentially, "
              "in this process.")
@click.option("--baseline-model", default=None,
              help="Model of the baseline (directory, .gguf or hub id) [default: agentd's "
              "default model].")
@click.option("--tokenizer", default=None, help="Tokenizer directory used to size the prompts "
              "[default: the baseline model's, else agentd's default model's].")
@click.option("--daemon-pid", type=int, default=None,
              help="Pid whose peak RSS to report, when the server does not tell its own.")
@click.option("--api", type=click.Choice(["chat", "responses", "messages"]), default="chat",
              show_default=True, help="The wire the requests use: chat completions, the "
              "Responses API (/v1/responses) or the Anthropic Messages API (/v1/messages).")
@click.option("--tools-in-system", is_flag=True,
              help="Send the tools as text at the head of the system message (agentd's tools "
              "block) instead of a tools field, so that servers whose chat template drops tools "
              "read the same prompt tokens as agentd: for comparing servers.")
@click.option("--openai-compatible", is_flag=True,
              help="Treat the server as a generic OpenAI server even if it is agentd (no pins, "
              "no cache salts, no /v1/stats).")
@click.option("--quick", is_flag=True, help="Tiny request counts: a smoke test, not a "
              "measurement.")
@click.pass_context
def command(ctx: click.Context, **opts: Any) -> None:
    """Measure TTFT (cold, warm, pinned, under cache pressure), throughput at several
    concurrencies, prefix-cache hit rate and peak memory on agent workloads.

    Works against agentd ($AGENTD_URL) and, without the pinned phases, against any other
    OpenAI-compatible server, so the two can be compared. Long: each cold request prefills the
    whole prompt; use --quick for a first try.
    """
    if opts["full_prompts"] and _given(ctx, "prompt_tokens"):
        raise click.UsageError("--prompt-tokens and --full-prompts exclude each other")
    if opts["plot_path"] is not None and not has_module("matplotlib"):
        raise click.ClickException("--plot needs matplotlib: pip install 'agentd[plot]'")
    from agentd.bench.client import BenchError
    from agentd.bench.progress import RichProgress
    from agentd.bench.session import run_bench

    options = _bench_options(opts)
    try:
        with RichProgress() as progress:
            run = run_bench(options, progress)
    except BenchError as exc:
        raise click.ClickException(str(exc)) from exc
    _report(run, options, opts)


def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _given(ctx: click.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def _bench_options(opts: dict[str, Any]) -> Any:
    from agentd.bench.runner import BenchSettings
    from agentd.bench.session import BenchOptions
    from agentd.bench.workload import PACKAGED, packaged_path

    paths = list(opts["workloads"])
    if opts["all_workloads"] or not paths:
        names = PACKAGED if opts["all_workloads"] else PACKAGED[:1]
        paths = [packaged_path(name) for name in names] + paths
    counts: dict[str, Any] = dict(QUICK) if opts["quick"] else {}
    if opts["requests"] is not None:
        counts["requests"] = opts["requests"]
    if opts["conversations"] is not None:
        counts["conversations"] = opts["conversations"]
    if opts["cold_requests"] is not None:
        counts["cold_requests"] = opts["cold_requests"]
    settings = BenchSettings(concurrency=opts["concurrency"], max_tokens=opts["max_tokens"],
                             pin=not opts["no_pin"], pressure=opts["pressure"],
                             pressure_tokens=opts["pressure_tokens"],
                             empty_cache=opts["empty_cache"], **counts)
    return BenchOptions(
        url=opts["url"], api_key=opts["api_key"], model=opts["model"],
        workload_paths=tuple(paths),
        prompt_tokens=None if opts["full_prompts"] else opts["prompt_tokens"],
        settings=settings, tokenizer=opts["tokenizer"], force_openai=opts["openai_compatible"],
        daemon_pid=opts["daemon_pid"], baseline=opts["baseline"],
        baseline_model=opts["baseline_model"], api=opts["api"],
        tools_in_system=opts["tools_in_system"],
    )


def _report(run: Any, options: Any, opts: dict[str, Any]) -> None:
    import dataclasses

    from rich.console import Console

    from agentd.bench.report import print_report
    from agentd.bench.results import to_json

    print_report(Console(), run.server, run.results, options.settings.cold_requests,
                 run.load_avg)
    settings = {**dataclasses.asdict(options.settings), "prompt_budget": options.prompt_tokens,
                "baseline": options.baseline, "load_avg_1m": list(run.load_avg),
                "cpu_count": os.cpu_count()}
    if opts["json_path"] is not None:
        opts["json_path"].write_text(json.dumps(to_json(run.server, run.results, settings),
                                                indent=2))
        click.echo(f"wrote {opts['json_path']}")
    if opts["plot_path"] is not None:
        from agentd.bench.plot import plot_data, write_plot

        write_plot(opts["plot_path"], plot_data(run.results),
                   f"agentd bench: {run.server.kind} at {run.server.root_url}, {run.server.model}")
        click.echo(f"wrote {opts['plot_path']}")
