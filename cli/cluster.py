"""``agentd cluster``: N agentd replicas on one machine behind SMG, the prefix-aware router.

``start`` runs each replica as ``agentd start --detach`` (its own port, state directory and
share of the cores) and ``smg launch --backend vllm --policy cache_aware`` in front of them on
``--port``; clients use the router's URL as they would one daemon's. ``status`` shows the
router and each replica's health, requests and prefix-cache hit rate; ``pin`` registers a pin on
every replica and keeps it for replicas added later (``add``); ``stop`` stops them all.

Invariants: everything the cluster is lives in one directory (``--cluster-dir``): ``cluster.json``
(the router's pid and URL, each replica's URL and state directory), ``router.log``, the
replicas' state directories (``replica-<i>``, each with its own pins, restored when that
replica restarts) and ``pins/`` (the bodies ``pin`` sent, replayed to a replica ``add`` starts).
SMG is an optional extra (``pip install 'agentd[cluster]'``); without it ``start`` fails in one
line before anything starts. Every address is loopback unless ``--host`` says otherwise.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click

from agentd.cli._client import DaemonClient, DaemonUnreachable, error_message
from agentd.cli._state import default_state_dir, pid_alive, write_atomic

ROUTER_READY_TIMEOUT_S = 120.0
POLICIES = ("cache_aware", "round_robin", "power_of_two", "random", "prefix_hash")
cluster_dir_option = click.option(
    "--cluster-dir", envvar="AGENTD_CLUSTER_DIR", show_envvar=True, default=None,
    type=click.Path(file_okay=False, path_type=Path),
    help="The cluster's directory [default: <state dir>/cluster].")


@click.group()
def command() -> None:
    """Run several agentd replicas behind SMG, a router that sends each prompt to the replica
    that holds its prefix (pip install 'agentd[cluster]')."""


@command.command()
@click.option("--replicas", default=2, show_default=True, type=click.IntRange(1, 64),
              help="How many agentd daemons to run.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the router binds.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535),
              help="The router's port; replica i listens on port + 1 + i.")
@click.option("--policy", default="cache_aware", show_default=True, type=click.Choice(POLICIES),
              help="SMG's routing policy.")
@click.option("--threads-per-replica", default=None, type=click.IntRange(min=1),
              help="Torch threads per replica [default: the cores split evenly].")
@click.option("--gpus", default=None, metavar="IDS",
              help="GPU ids to share out, e.g. 0,1,2,3: replica i sees only id i mod their "
                   "count (CUDA_VISIBLE_DEVICES) [default: the replicas see every GPU].")
@click.option("--router-args", default="", metavar="ARGS",
              help="More `smg launch` options, e.g. \"--balance-abs-threshold 4\".")
@cluster_dir_option
@click.argument("start_args", nargs=-1, type=click.UNPROCESSED)
def start(replicas: int, host: str, port: int, policy: str, threads_per_replica: int | None,
          gpus: str | None, router_args: str, cluster_dir: Path | None,
          start_args: tuple[str, ...]) -> None:
    """Start the replicas and the router. Arguments after -- go to every replica's
    `agentd start`: agentd cluster start -- --model m.gguf --kv-cache-memory 2GiB"""
    root = _root(cluster_dir)
    for flag in ("--port", "--state-dir", "--detach", "--num-threads", "--host"):
        if flag in start_args:
            raise click.ClickException(f"{flag} is set per replica by `agentd cluster start`")
    smg = smg_executable()
    if (root / "cluster.json").exists() and _alive(_read(root).get("router", {}).get("pid")):
        raise click.ClickException(f"a cluster already runs from {root}; `agentd cluster stop` "
                                   "first, or pass another --cluster-dir")
    threads = threads_per_replica or max(1, len(os.sched_getaffinity(0)) // replicas)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    gpu_ids = [g.strip() for g in gpus.split(",") if g.strip()] if gpus else []
    state: dict[str, Any] = {"replicas": [], "start_args": list(start_args), "threads": threads,
                             "policy": policy, "gpus": gpu_ids}
    for index in range(replicas):
        state["replicas"].append(_replica_entry(root, index, port + 1 + index, gpu_ids))
    _write(root, state)
    click.echo(f"starting {replicas} replica(s) with {threads} thread(s) each ...")
    router_url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
    try:
        _start_replicas(state["replicas"], state)
        for replica in state["replicas"]:
            _register_pins(root, replica["url"])
        state["router"] = _start_router(smg, root, host, port, policy,
                                        [r["url"] for r in state["replicas"]], router_url,
                                        shlex.split(router_args))
    except BaseException:  # nothing half-started is left running
        _stop_replicas(state["replicas"])
        raise
    _write(root, state)
    click.echo(f"agentd cluster ready at {router_url} ({policy}, replicas "
               f"{', '.join(r['url'] for r in state['replicas'])})")


@command.command()
@cluster_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def status(cluster_dir: Path | None, as_json: bool) -> None:
    """The router and every replica: health, requests and prefix-cache hit rate."""
    root = _root(cluster_dir)
    state = _read(root)
    router = state.get("router", {})
    report: dict[str, Any] = {"router": {**router, "running": _alive(router.get("pid"))},
                              "replicas": [_replica_report(r) for r in state["replicas"]]}
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    running = "running" if report["router"]["running"] else "NOT running"
    click.echo(f"router   {router.get('url')}  {router.get('policy', '')}  {running}")
    for r in report["replicas"]:
        rate = r.get("prefix_cache_hit_rate")
        click.echo(f"replica  {r['url']}  {r['status']:<8} requests {r.get('requests', '-'):>5}  "
                   f"hit rate {'-' if rate is None else f'{rate:.1%}'}")


@command.command()
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--name", default=None, help="Pin name [default: FILE's name without suffix].")
@click.option("--tools", "tools_file", default=None, type=click.Path(dir_okay=False,
              path_type=Path), help="JSON file with OpenAI-format tools.")
@cluster_dir_option
def pin(file: Path, name: str | None, tools_file: Path | None, cluster_dir: Path | None) -> None:
    """Pin FILE's system prompt (and tools) on every replica, and on replicas added later."""
    from agentd.cli.pin import read_text, read_tools

    root = _root(cluster_dir)
    state = _read(root)
    body: dict[str, Any] = {"name": name or file.stem, "system": read_text(file, "FILE")}
    if tools_file is not None:
        body["tools"] = read_tools(tools_file)
    pins = root / "pins"
    pins.mkdir(exist_ok=True, mode=0o700)
    write_atomic(pins / f"{body['name']}.json", json.dumps(body))
    for replica in state["replicas"]:
        info = _pin_one(replica["url"], body)
        click.echo(f"pinned {info['name']} on {replica['url']}: {info['num_tokens']} tokens")


@command.command()
@cluster_dir_option
def add(cluster_dir: Path | None) -> None:
    """Start one more replica, give it the cluster's pins, and register it with the router."""
    root = _root(cluster_dir)
    state = _read(root)
    router = state.get("router") or {}
    if not _alive(router.get("pid")):
        raise click.ClickException("the cluster's router is not running; `agentd cluster start`")
    port = max(int(r["url"].rsplit(":", 1)[1]) for r in state["replicas"]) + 1
    replica = _replica_entry(root, len(state["replicas"]), port, state.get("gpus", []))
    before = [*state["replicas"]]
    # listed before it starts, so that `stop` finds it if this command dies half way
    state["replicas"].append(replica)
    _write(root, state)
    try:
        _start_replicas([replica], state)
        _register_pins(root, replica["url"])
        response = DaemonClient(router["url"]).request("POST", "/workers",
                                                       json={"url": replica["url"]})
        if response.is_error:
            raise click.ClickException(f"the router refused {replica['url']}: "
                                       f"{error_message(response)}")
    except BaseException:  # the cluster stays as it was (as `start` leaves nothing half-started)
        _stop_replicas([replica])
        _write(root, {**state, "replicas": before})
        raise
    deadline = time.monotonic() + ROUTER_READY_TIMEOUT_S
    client = DaemonClient(router["url"])
    while _routes_to(client, [replica["url"]]) is False and time.monotonic() < deadline:
        time.sleep(0.5)  # the router health-checks it before it routes to it
    click.echo(f"replica {replica['url']} added")


@command.command()
@cluster_dir_option
def stop(cluster_dir: Path | None) -> None:
    """Stop the router, then every replica."""
    root = _root(cluster_dir)
    state = _read(root)
    pid = (state.get("router") or {}).get("pid")
    if _alive(pid):
        _terminate(pid)
    _stop_replicas(state["replicas"])
    click.echo("agentd cluster stopped")


def _stop_replicas(replicas: list[dict[str, Any]]) -> None:
    for replica in replicas:
        subprocess.run([sys.executable, "-m", "agentd.cli", "stop", "--url", replica["url"],
                        "--state-dir", replica["state_dir"]], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def smg_executable() -> str:
    """SMG's ``smg`` command, beside this Python's or on PATH."""
    beside = Path(sys.executable).with_name("smg")
    found = str(beside) if beside.exists() else shutil.which("smg")
    if found is None:
        raise click.ClickException("SMG is not installed: pip install 'agentd[cluster]' "
                                   "(or pip install smg)")
    return found


def _root(cluster_dir: Path | None) -> Path:
    return (cluster_dir or default_state_dir() / "cluster").expanduser().absolute()


def _read(root: Path) -> dict[str, Any]:
    try:
        return json.loads((root / "cluster.json").read_text())
    except FileNotFoundError:
        raise click.ClickException(f"no cluster in {root}; start one with "
                                   "`agentd cluster start`") from None


def _write(root: Path, state: dict[str, Any]) -> None:
    write_atomic(root / "cluster.json", json.dumps(state, indent=2))


def _replica_entry(root: Path, index: int, port: int, gpu_ids: list[str]) -> dict[str, Any]:
    """Replica ``index``: its URL, state directory and, with ``--gpus``, its GPU."""
    entry = {"url": f"http://127.0.0.1:{port}", "state_dir": str(root / f"replica-{index}")}
    if gpu_ids:
        entry["gpu"] = gpu_ids[index % len(gpu_ids)]
    return entry


def _start_replicas(replicas: list[dict[str, Any]], state: dict[str, Any]) -> None:
    """``agentd start --detach`` for each, all at once; each returns once its daemon is ready."""
    processes = []
    for replica in replicas:
        port = replica["url"].rsplit(":", 1)[1]
        env = dict(os.environ)
        if "gpu" in replica:
            env["CUDA_VISIBLE_DEVICES"] = replica["gpu"]
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "agentd.cli", "start", "--detach", "--port", port,
             "--state-dir", replica["state_dir"], "--num-threads", str(state["threads"]),
             *state["start_args"]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=env))
    failed = []
    for replica, process in zip(replicas, processes, strict=True):
        out, _ = process.communicate()
        if process.returncode != 0:
            failed.append(f"{replica['url']}: {out.strip().splitlines()[-1] if out else '?'}")
    if failed:
        raise click.ClickException("replicas failed to start (see their agentd.log): "
                                   + "; ".join(failed))


def _start_router(smg: str, root: Path, host: str, port: int, policy: str,
                  worker_urls: list[str], url: str, extra: list[str]) -> dict[str, Any]:
    """``smg launch`` in the background, detached; returns once it routes to every replica
    (its ``/workers`` lists each healthy and ready: SMG answers ``/v1/models`` as soon as one
    is, and a cluster whose first requests all went to one replica kept its agents there)."""
    args = [smg, "launch", "--host", host, "--port", str(port), "--backend", "vllm",
            "--policy", policy, "--worker-urls", *worker_urls,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(port + 1000),
            "--health-check-interval-secs", "2", "--health-failure-threshold", "2",
            "--health-success-threshold", "1", "--log-level", "warn",
            # SMG's own thresholds (64 requests) suit GPU replicas that batch dozens; an agent
            # fleet's replicas run a few each, and without these a burst of new agents all
            # went to one replica (8 agents on 2 CPU replicas: 7 on one, cold TTFT p50 34 s;
            # with them 20.8 s, hit rate 78% -> 76%)
            "--balance-abs-threshold", "2", "--balance-rel-threshold", "1.5", *extra]
    if key := (os.environ.get("AGENTD_API_KEY") or "").split(",")[0].strip():
        args += ["--api-key", key]  # clients' key; SMG forwards their Authorization header
    with open(root / "router.log", "ab") as log:
        process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + ROUTER_READY_TIMEOUT_S
    client = DaemonClient(url)
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise click.ClickException(f"smg exited ({process.returncode}); see {root}/router.log")
        try:
            models = client.request("GET", "/v1/models")
            if (models.status_code == 200 and models.json().get("data")
                    and _routes_to(client, worker_urls) is not False):
                return {"pid": process.pid, "url": url, "policy": policy}
        except (DaemonUnreachable, click.ClickException, ValueError):
            pass
        time.sleep(0.5)
    _terminate(process.pid)
    raise click.ClickException(f"the router did not route to every replica in "
                               f"{ROUTER_READY_TIMEOUT_S:.0f} s; "
                               f"see {root}/router.log")


def _routes_to(client: DaemonClient, worker_urls: list[str]) -> bool | None:
    """Whether the router lists every one of ``worker_urls`` healthy and ready; None where its
    ``/workers`` does not say (another SMG, or it wants an admin key)."""
    response = client.request("GET", "/workers")
    if response.status_code != 200:
        return None
    try:
        workers = response.json()["workers"]
        ready = {w["url"] for w in workers
                 if w.get("is_healthy", True) and w.get("status", "ready") == "ready"}
    except (ValueError, KeyError, TypeError):
        return None
    return set(worker_urls) <= ready


def _register_pins(root: Path, url: str) -> None:
    for path in sorted((root / "pins").glob("*.json")) if (root / "pins").exists() else []:
        _pin_one(url, json.loads(path.read_text()))


def _pin_one(url: str, body: dict[str, Any]) -> dict[str, Any]:
    from agentd.cli.pin import PIN_TIMEOUT_S

    response = DaemonClient(url, timeout_s=PIN_TIMEOUT_S).request("POST", "/v1/pins", json=body)
    if response.is_error:
        raise click.ClickException(f"could not pin {body['name']!r} on {url}: "
                                   f"{error_message(response)}")
    return response.json()


def _replica_report(replica: dict[str, Any]) -> dict[str, Any]:
    client = DaemonClient(replica["url"], timeout_s=5.0)
    try:
        health = client.health()
    except click.ClickException:
        return {**replica, "status": "down"}
    report = {**replica, "status": health.get("status", "?")}
    if health.get("status") == "ready":
        stats = client.request("GET", "/v1/stats")
        if stats.status_code == 200:
            s = stats.json()
            report.update(requests=s["num_requests_finished"],
                          prefix_cache_hit_rate=s["prefix_cache_hit_rate"],
                          num_pins=s["num_pins"])
    return report


def _alive(pid: int | None) -> bool:
    return bool(pid) and pid_alive(pid)


def _terminate(pid: int, timeout_s: float = 10.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except OSError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
