"""``agentd start``: run the daemon in the foreground, or ``--detach`` it into the background.

Invariants: every engine knob is an option with an ``AGENTD_*`` environment variable, and the
defaults are ``EngineConfig``'s own; a bad value, a port in use or a missing model fails with one
line and a non-zero status *before* the model loads; the pid file and daemon.json exist exactly
while a daemon started with that state directory runs. torch is imported only by the process that
serves (never by ``--help`` or by the parent of a detached daemon).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import click

from agentd.cli._daemon import bind_listener, detach, display_url
from agentd.cli._state import StatePaths, state_dir_option
from agentd.config import (
    EngineConfig,
    KVEventsConfig,
    SpeculativeConfig,
    parse_duration,
    parse_size,
)
from agentd.model.default_model import DEFAULT_MODEL_NAME

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
# The default model's context when `agentd start` serves it: Claude Code's first prompt is ~23k
# tokens, Codex's ~14k, opencode's ~8k (recorded, docs/agents.md); the model was trained on 8,192.
DEFAULT_MODEL_CONTEXT = 32768
_SPEC = SpeculativeConfig()
# the names SpeculativeConfig's errors use, each the option of that name
_SPEC_OPTION_NAMES = ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                      "speculative_max_num_seqs")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# EngineConfig field -> the option that sets it, for error messages.
_OPTION_OF = {"kv_cache_memory_bytes": "--kv-cache-memory",
              "enable_prefix_caching": "--no-prefix-caching",
              "kv_disk_budget_bytes": "--kv-disk-budget"}


def _option(name: str, **kwargs: Any) -> Any:
    envvar = "AGENTD_" + name.lstrip("-").replace("-", "_").upper()
    return click.option(name, envvar=envvar, show_envvar=True, **kwargs)


@click.command(context_settings={"show_default": True})
@_option("--model", default=None,
         help="Model directory, .gguf file or hub id [default: SmolLM2-135M-Instruct].")
@_option("--tokenizer", default=None, help="Tokenizer directory, if not the model's own.")
@_option("--host", default="127.0.0.1", help="Address to listen on.")
@_option("--port", default=8000, type=click.IntRange(1, 65535), help="Port to listen on.")
@click.option("--detach", is_flag=True,
              help="Run in the background (pid and log in the state dir); return once ready.")
@state_dir_option
@_option("--kv-cache-memory", default=None,
         help="KV block pool size, e.g. 512MiB or 8GiB [default: room for --max-model-len "
              "tokens for each of --max-num-seqs requests, within half the memory free at "
              "start; a context that does not fit even once is capped, and the log says why]. "
              "The pool costs memory only as it fills.")
@_option("--kv-cache-dtype", default=_DEFAULTS["kv_cache_dtype"],
         type=click.Choice(["auto", "float32", "float16", "bfloat16", "q8_0"]),
         help="What the KV pool stores; attention math stays fp32. auto: float32 in the exact "
              "mode (float32 --dtype and --weights), the activations' dtype when narrower "
              "(CUDA), float16 with low-precision weights (half the bytes per token). q8_0: "
              "int8 with a scale per 32 values, 0.53x float16's bytes (CPU only).")
@_option("--block-size", default=_DEFAULTS["block_size"], type=int,
         help="Tokens per KV block (8, 16, 32, 64 or 128).")
@_option("--max-num-seqs", default=_DEFAULTS["max_num_seqs"], type=int,
         help="Most requests in one running batch.")
@_option("--long-prefill-chunk", default=_DEFAULTS["long_prefill_chunk"], type=int,
         help="The most prompt tokens one request runs in a step, a row deep in a long "
              "prompt counted with its attention (so a step lasts about as long at 16k tokens "
              "as at the start). Shortest remaining prompt first: a request that arrives while "
              "a prompt of tens of thousands of tokens prefills (a title, a sub-agent's probe) "
              "waits for the step in flight, not the whole prefill.")
@_option("--max-num-batched-tokens", default=_DEFAULTS["max_num_batched_tokens"], type=int,
         help="Token budget of one engine step (prefill chunks + decodes).")
@_option("--max-model-len", default=None, type=int,
         help="Context length [default: the model's, unless the KV pool cannot hold it; for "
              f"the default model {DEFAULT_MODEL_CONTEXT:,}, stretched from its 8,192 with YaRN "
              "so that coding agents' prompts fit]. Past the model's own, its RoPE is stretched "
              "with YaRN (one warning says what that costs).")
@_option("--max-pinned-fraction", default=_DEFAULTS["max_pinned_fraction"], type=float,
         help="Most of the pool that pins and retained prefixes (cache control) may hold "
              "together; pins come first.")
@_option("--device", default=_DEFAULTS["device"], metavar="auto|cpu|cuda[:N]",
         help="Where the model runs.")
@_option("--dtype", default=_DEFAULTS["dtype"],
         type=click.Choice(["auto", "float32", "float16", "bfloat16"]),
         help="Activations and attention (and the weights unless --weights, the KV cache "
              "unless --kv-cache-dtype). auto: "
              "float32 on CPU (exact against transformers), bfloat16 on CUDA. bfloat16 on CPUs "
              "with AVX512-BF16 or AMX: faster (prefill ~2x on a 2-core AMD EPYC), half the KV "
              "memory per token.")
@_option("--weights", default=_DEFAULTS["weights"],
         type=click.Choice(["gguf", "auto", "float32", "bfloat16", "float16", "int8", "int4"]),
         help="How linear layers store their weights, apart from --dtype (CPU). gguf: a .gguf's "
              "own blocks, memory-mapped, through agentd's CPU kernels (no fp32 copy; the "
              "default for the default model, a Q4_1 file, and for a .gguf passed with "
              "--model). float32: the weights converted to fp32 once; with --dtype auto or "
              "float32 the exact mode (same tokens as transformers, decode ~4x slower on an "
              "AVX2 CPU). int4: a GGUF's 4-bit groups as they are; auto: the fastest format "
              "here that passed the accuracy bar (docs/weights.md, Weight formats). [default: "
              "gguf for a GGUF on the CPU, else the same as --dtype]")
@_option("--prefill-weights", default=_DEFAULTS["prefill_weights"],
         type=click.Choice(["keep", "dequantize"]),
         help="With low-precision --weights, how prefill chunks and other big steps multiply: "
              "keep a dense fp32 twin of each layer (fastest; the fp32 bytes again) or "
              "dequantize per step (least memory, slower prefill).")
@_option("--attention-backend", default=_DEFAULTS["attention_backend"],
         type=click.Choice(["auto", "torch", "cpu", "triton"]),
         help="Attention kernels: triton on CUDA; on the CPU agentd's C++ decode attention "
              "(cpu), or torch's references (torch).")
@_option("--cpu-linear", default=_DEFAULTS["cpu_linear"],
         type=click.Choice(["onednn", "torch"]),
         help="CPU matmuls: oneDNN with packed weights, or torch's F.linear.")
@_option("--speculative", default=_SPEC.method, type=click.Choice(["ngram", "off"]),
         help="Prompt-lookup speculative decoding: draft tokens from the request's own prompt "
              "and output, verified in one forward; greedy output is unchanged. Drafts only "
              "while few requests run (--speculative-max-num-seqs).")
@_option("--num-speculative-tokens", default=_SPEC.num_tokens, type=int,
         help="Most draft tokens per request per step.")
@_option("--prompt-lookup-max", default=_SPEC.ngram_max, type=int,
         help="Longest n-gram of the last tokens looked up in the context.")
@_option("--prompt-lookup-min", default=_SPEC.ngram_min, type=int,
         help="Shortest n-gram that may make a draft.")
@_option("--speculative-max-num-seqs", default=_SPEC.max_num_seqs, type=int,
         help="Draft only while at most this many requests run (more: compute-bound).")
@_option("--no-prefix-caching", is_flag=True, help="Turn prefix (KV) caching off.")
@_option("--kv-disk-dir", default=None,
         help="The KV disk tier: every computed prompt block is written here too, and read back "
              "instead of recomputed once the pool has evicted it, across restarts [default: "
              "<state dir>/kv-store].")
@_option("--kv-disk-budget", default=None,
         help="Most bytes the KV disk tier holds, e.g. 20GiB; least recently used blocks leave "
              "first [default: a quarter of the disk space free at start, at most 100GiB].")
@_option("--no-kv-disk", is_flag=True,
         help="Turn the KV disk tier off: prompt blocks stay in the pool only (pins' KV still "
              "persists in the state dir's kv-store/).")
@_option("--no-jump-forward", is_flag=True,
         help="Decode every token of a constrained output, even where the grammar allows only "
              "one continuation (by default such text is appended without a step each).")
@_option("--mlock", is_flag=True,
         help="Lock a GGUF's memory-mapped weights in RAM (read in at start), so memory "
              "pressure never pages them out and a request never waits for them to be read "
              "back from disk. Needs a locked-memory limit (ulimit -l) above the file's size; "
              "if it is lower, the log says so and the weights stay mapped as without it.")
@_option("--seed", default=_DEFAULTS["seed"], type=int, help="Seed for requests without one.")
@_option("--num-threads", default=None, type=int,
         help="CPU threads for torch [default: all cores]. Every daemon takes this many: "
              "with several daemons on one host, give each its share (e.g. 4 each of 8 "
              "cores), or they slow each other down. `agentd status` shows it.")
@_option("--kv-events", default=None, metavar="ENDPOINT",
         help="Publish vLLM's KV-event stream (ZMQ PUB, topic kv@HOST:PORT@MODEL, msgpack "
              "BlockStored/BlockRemoved/AllBlocksCleared) on this endpoint, e.g. "
              "tcp://127.0.0.1:5557, for routers that score replicas by the blocks they hold. "
              "Needs pyzmq: pip install 'agentd[cluster]'.")
@_option("--kv-events-replay", default=None, metavar="ENDPOINT",
         help="A ZMQ ROUTER endpoint where a subscriber that missed batches asks for them again "
              "by sequence number (vLLM's replay protocol).")
@_option("--api-key", multiple=True,
         help="Require 'Authorization: Bearer KEY' on /v1, /admin and /metrics. Repeat it "
              "(or separate keys with commas) for several keys; each key is then a tenant "
              "with its own prefix cache and pins unless --shared-cache.")
@_option("--shared-cache", is_flag=True,
         help="With several API keys, let them share cached prefixes and pins (each key's "
              "stored responses stay its own).")
@_option("--admin-key", multiple=True,
         help="A key for the operator (repeat or comma-separate for several): with several "
              "--api-key tenants only admin keys reach /admin, /v1/stats, /metrics and every "
              "tenant's pins; an admin key's own pins and requests use the shared cache.")
@_option("--metrics-public", is_flag=True,
         help="Serve /metrics without a key even when keys are set.")
@_option("--max-queue", default=256, type=click.IntRange(min=0),
         help="Requests that may wait beyond a full batch; past that, 503 with Retry-After.")
@_option("--max-request-body", default="16MiB", help="Largest request body accepted (413).")
@_option("--read-timeout", default="30s",
         help="How long a client may take to send a request's headers, and then its body, "
              "before it gets a 408 and is disconnected.")
@_option("--allowed-hosts", multiple=True,
         help="More names the Host header may carry (repeat or comma-separate; '*.example.com', "
              "'*' for any). Loopback names and the --host address always work; others are "
              "refused (403), a guard against DNS rebinding.")
@_option("--cors-origin", multiple=True,
         help="Origin (e.g. http://localhost:3000) whose web pages may call the API; repeat or "
              "comma-separate [default: none].")
@_option("--response-store-size", default=1024, type=click.IntRange(min=0),
         help="Responses kept per API key for GET /v1/responses/{id} and previous_response_id "
              "(the oldest go first; 0 keeps none).")
@_option("--response-store-ttl", default="1h",
         help="How long a stored response is kept after its last use.")
@_option("--max-output-tokens", default=4096, type=click.IntRange(min=1),
         help="The output cap of a request that sets none (Codex sets none): a model that never "
              "writes its end token stops here instead of filling the context. A cap a request "
              "does set, and this one, are clamped to the room its prompt leaves.")
@_option("--shutdown-grace", default="10s",
         help="How long in-flight requests may run on after a stop before they are aborted.")
@click.option("--log-file", hidden=True, default=None,
              help="Where a detached daemon's output goes (set by --detach; for daemon.json).")
@_option("--log-level", default="info",
         type=click.Choice(["debug", "info", "warning", "error"]), help="Log verbosity.")
def command(**params: Any) -> None:
    """Start the daemon (foreground unless --detach; logs go to stderr).

    Every option can also be set with the environment variable shown beside it.
    """
    config = engine_config(params)
    settings = server_settings(params, StatePaths.of(params["state_dir"]).root)
    check_model(params["model"])
    host, port = params["host"], params["port"]
    sock = bind_listener(host, port)  # first: "port in use" is the usual reason to fail
    paths = StatePaths.of(params["state_dir"])
    if (pid := paths.live_pid()) is not None and pid != os.getpid():
        sock.close()
        raise click.ClickException(
            f"an agentd daemon (pid {pid}) already uses the state dir {paths.root}; stop it "
            "with `agentd stop` or pass another --state-dir"
        )
    url = display_url(host, port)
    if params["detach"]:
        sock.close()  # the daemon binds it again
        detach([*_child_args(params), "--log-file", str(paths.log_file)],
               ",".join(api_keys(params)) or None, paths, url,
               admin_key=",".join(api_keys(params, "admin_key")) or None)
        _echo_startup(url, (api_keys(params, "admin_key") or api_keys(params) or (None,))[0])
        return
    _setup_logging(params["log_level"])
    paths.write_pid(os.getpid())
    paths.write_daemon_info({"url": url, "pid": os.getpid(), "started": time.time(),
                             "model": config.model or DEFAULT_MODEL_NAME,
                             "log": params["log_file"]})
    try:
        from agentd.server.serve import exit_process, serve

        status = serve(config, settings, sock, log_level=params["log_level"])
    finally:
        paths.remove_if_owned(os.getpid())
    exit_process(status)  # at once if stopped while loading: the load ends with the process


def _echo_startup(url: str, key: str | None) -> None:
    """A detached daemon's load time, memory, context and KV pool, as ``agentd status`` shows
    them (a foreground daemon logs the same in its ready line)."""
    from agentd.cli._client import DaemonClient
    from agentd.cli.status import startup_rows

    try:
        response = DaemonClient(url, api_key=key or "").request("GET", "/v1/stats")
    except click.ClickException:
        return
    if response.is_success:
        for name, value in startup_rows(response.json()):
            click.echo(f"  {name}: {value}")


def engine_config(params: dict[str, Any]) -> EngineConfig:
    """Build the engine config; a bad value is one line naming the option."""
    try:
        return EngineConfig(
            model=params["model"], tokenizer=params["tokenizer"], device=params["device"],
            dtype=params["dtype"], weights=params["weights"],
            prefill_weights=params["prefill_weights"], block_size=params["block_size"],
            kv_cache_memory_bytes=None if params["kv_cache_memory"] is None else
            parse_size(params["kv_cache_memory"]),
            kv_cache_dtype=params["kv_cache_dtype"],
            max_num_seqs=params["max_num_seqs"],
            max_num_batched_tokens=params["max_num_batched_tokens"],
            long_prefill_chunk=params["long_prefill_chunk"],
            max_model_len=params["max_model_len"],
            min_context=DEFAULT_MODEL_CONTEXT if params["model"] is None else None,
            enable_prefix_caching=not params["no_prefix_caching"],
            jump_forward=not params["no_jump_forward"],
            max_pinned_fraction=params["max_pinned_fraction"],
            attention_backend=params["attention_backend"], cpu_linear=params["cpu_linear"],
            seed=params["seed"],
            num_threads=params["num_threads"],
            mlock=params["mlock"],
            kv_events=_kv_events(params),
            kv_disk_dir=_kv_disk_dir(params),
            kv_disk_budget_bytes=None if params["kv_disk_budget"] is None else
            parse_size(params["kv_disk_budget"]),
            speculative=SpeculativeConfig(
                method=params["speculative"], num_tokens=params["num_speculative_tokens"],
                ngram_max=params["prompt_lookup_max"], ngram_min=params["prompt_lookup_min"],
                max_num_seqs=params["speculative_max_num_seqs"]),
        )
    except ValueError as exc:
        raise click.ClickException(
            f"{_option_names(str(exc))} (see `agentd start --help`)"
        ) from None


def _kv_disk_dir(params: dict[str, Any]) -> str | None:
    if params["no_kv_disk"]:
        return None
    if params["kv_disk_dir"] is not None:
        return str(Path(params["kv_disk_dir"]).expanduser().absolute())
    return str(StatePaths.of(params["state_dir"]).root / "kv-store")


def _kv_events(params: dict[str, Any]) -> KVEventsConfig | None:
    if params["kv_events"] is None:
        if params["kv_events_replay"] is not None:
            raise ValueError("--kv-events-replay needs --kv-events")
        return None
    return KVEventsConfig(params["kv_events"], params["kv_events_replay"],
                          replica_id=f"{params['host']}:{params['port']}")


def server_settings(params: dict[str, Any], state_dir: Path | None = None) -> Any:
    from agentd.server.settings import ServerSettings

    try:
        return ServerSettings(
            api_keys=api_keys(params),
            admin_keys=api_keys(params, "admin_key"),
            metrics_public=params["metrics_public"],
            max_queue=params["max_queue"],
            shared_cache=params["shared_cache"],
            max_request_body_bytes=parse_size(params["max_request_body"]),
            shutdown_grace_s=parse_duration(params["shutdown_grace"]),
            state_dir=state_dir,
            bind_host=params["host"],
            allowed_hosts=_list(params["allowed_hosts"]),
            cors_origins=_list(params["cors_origin"]),
            read_timeout_s=parse_duration(params["read_timeout"]),
            response_store_size=params["response_store_size"],
            response_store_ttl_s=parse_duration(params["response_store_ttl"]),
            max_output_tokens=params["max_output_tokens"],
        )
    except ValueError as exc:
        raise click.ClickException(f"{exc} (see `agentd start --help`)") from None


def api_keys(params: dict[str, Any], option: str = "api_key") -> tuple[str, ...]:
    """Every key given, whether repeated or comma-separated (``AGENTD_API_KEY=k1,k2`` too)."""
    return _list(params[option])


def _list(values: tuple[str, ...] | None) -> tuple[str, ...]:
    """A repeatable option's values, each of which may be a comma-separated list."""
    return tuple(item.strip() for value in values or () for item in value.split(",")
                 if item.strip())


def _option_names(message: str) -> str:
    for field in [*_DEFAULTS, *_SPEC_OPTION_NAMES, "kv_events_replay"]:
        option = _OPTION_OF.get(field, "--" + field.replace("_", "-"))
        message = re.sub(rf"\b{field}\b", option, message)
    return message


def check_model(model: str | None) -> None:
    """Fail now, in one line, for a local model path that cannot be a model."""
    if model is None:
        return
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return
    if path.exists() or not _HUB_ID.fullmatch(model):
        from agentd.model.loader import ModelLoadError, resolve_model

        try:
            resolve_model(model, progress=False)
        except ModelLoadError as exc:
            raise click.ClickException(str(exc)) from None


def _child_args(params: dict[str, Any]) -> list[str]:
    """The options of a detached daemon: this command's, without --detach or the API and admin
    keys (they travel in the environment, out of `ps`)."""
    args: list[str] = []
    for param in command.params:
        name = param.name
        if name in ("detach", "api_key", "admin_key", "log_file") or \
                not isinstance(param, click.Option):
            continue
        value = params[name]
        if name == "state_dir":
            value = str(StatePaths.of(value).root)
        elif name == "model" and value is not None and Path(value).expanduser().exists():
            value = str(Path(value).expanduser().absolute())
        if param.is_flag:
            args += [param.opts[0]] if value else []
        elif value is not None:
            args += [param.opts[0], str(value)]
    return args


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
