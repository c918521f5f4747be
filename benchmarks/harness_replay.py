"""Replays the coding agents' recorded traffic against a server: per-request TTFT, prompt and
cached tokens, and a short request's TTFT while a long prompt prefills.

    python benchmarks/harness_replay.py --target agentd=http://127.0.0.1:8000 \
        [--target llama=http://127.0.0.1:8080] [--sessions benchmarks/sessions/*.jsonl.gz] \
        [--max-output-tokens 32] [--probe-tokens 16000] [--json out.json]

The sessions (``benchmarks/sessions/``) were recorded from the real clients (Claude Code,
Codex CLI, opencode) against agentd through ``agentd.bench.record``: every generation request,
in order, with the headers that name its client and session. A replay sends each as recorded
(the model renamed to the served one, the output capped at ``--max-output-tokens`` so that the
replay measures prompts, not the model's verbosity) and reads the usage each reply reports.
Requests on a wire the target does not serve (a 404) are counted, not failed.

The probe: a short request (opencode's title request, ~600 tokens) alone, then again while a
long prompt (``--probe-tokens``, opencode's main request padded with Claude Code's tool schemas)
prefills, sent one after another (``--probe-gap`` seconds apart) from 2 s into the prefill to
its end, so the long prompt is shallow for the first and deep for the last; each gets a fresh
first line, so nothing of either is cached. Their TTFT during the prefill over the TTFT alone
(median and worst) is the figure the scheduler is judged by (within 2x). ``--no-replay`` runs
the probe only.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agentd.bench.machine import cpu_line
from agentd.bench.record import read_records, sse_events, usage_of

GENERATION = ("/v1/messages", "/v1/responses", "/v1/chat/completions")
SESSIONS = sorted((Path(__file__).parent / "sessions").glob("*.jsonl.gz"))
DELTAS = {"content_block_delta", "response.output_text.delta",
          "response.function_call_arguments.delta", "response.custom_tool_call_input.delta"}


@dataclass
class Row:
    session: str
    index: int
    path: str
    status: int
    turn: int = 1
    prompt: int = 0
    cached: int = 0
    ttft_s: float = 0.0
    total_s: float = 0.0


@dataclass
class Target:
    name: str
    url: str
    model: str = ""
    rows: list[Row] = field(default_factory=list)
    probe: dict[str, float] = field(default_factory=dict)


def served_model(client: httpx.Client, url: str) -> str:
    return client.get(f"{url}/v1/models").json()["data"][0]["id"]


def capped(body: dict[str, Any], path: str, model: str, cap: int) -> dict[str, Any]:
    body = copy.deepcopy(body)
    body["model"] = model
    name = {"/v1/messages": "max_tokens", "/v1/responses": "max_output_tokens"}.get(
        path, "max_tokens")
    body.pop("max_completion_tokens", None)
    body[name] = min(body.get(name) or cap, cap)
    return body


def first_delta(event: dict[str, Any]) -> bool:
    if event.get("type") in DELTAS:
        return True
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"):
            return True
    return False


def send(client: httpx.Client, url: str, path: str, body: dict[str, Any],
         headers: dict[str, str]) -> tuple[int, float, float, list[dict[str, Any]]]:
    """(status, TTFT, total seconds, the reply's events); TTFT is the first generated delta of
    a stream, or the whole reply of a non-streamed request."""
    start = time.perf_counter()
    events: list[dict[str, Any]] = []
    ttft = None
    with client.stream("POST", url + path, json=body, headers=headers) as response:
        if not body.get("stream"):
            raw = response.read()
            total = time.perf_counter() - start
            try:
                events = [json.loads(raw)]
            except ValueError:
                events = []
            return response.status_code, total, total, events
        for event in sse_events(response.iter_lines()):
            if ttft is None and first_delta(event):
                ttft = time.perf_counter() - start
            events.append(event)
        total = time.perf_counter() - start
        return response.status_code, ttft if ttft is not None else total, total, events


def replay(client: httpx.Client, target: Target, session: Path, cap: int) -> None:
    records, turns, turn = [], [], 0
    for r in read_records(session):
        # agentd launch asks GET /v1/models once a turn: the recorded turns start there
        turn += r["method"] == "GET" and r["path"] == "/v1/models"
        if r["method"] == "POST" and r["path"] in GENERATION and r.get("body"):
            records.append(r)
            turns.append(max(turn, 1))
    for i, record in enumerate(records):
        body = capped(record["body"], record["path"], target.model, cap)
        headers = {k: v for k, v in record.get("headers", {}).items()
                   if k != "content-encoding"}  # the body is sent as plain JSON
        status, ttft, total, events = send(client, target.url, record["path"], body, headers)
        usage = usage_of(events) if status < 400 else None
        row = Row(session.name.split(".")[0], i + 1, record["path"], status, turns[i],
                  usage.prompt_tokens if usage else 0, usage.cached_tokens if usage else 0,
                  ttft, total)
        target.rows.append(row)
        print(f"  {target.name:>8} {row.session:>8} #{row.index:<3} {row.path:<22} {status} "
              f"prompt {row.prompt:>6} cached {row.cached:>6} "
              f"({row.cached / max(row.prompt, 1):6.1%}) TTFT {ttft:7.2f} s", flush=True)


def probe_bodies(sessions: list[Path], tokens: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(short, long) chat bodies from the opencode session, the long padded with Claude Code's
    tool schemas to about ``tokens`` tokens (3.3 characters a token, measured on these)."""
    chat = [r for s in sessions for r in read_records(s)
            if r["path"] == "/v1/chat/completions" and r.get("body")]
    short = min(chat, key=lambda r: len(json.dumps(r["body"])))["body"]
    long = max(chat, key=lambda r: len(json.dumps(r["body"])))["body"]
    tools = [r["body"].get("tools") for s in sessions for r in read_records(s)
             if r["path"] == "/v1/messages" and r.get("body") and r["body"].get("tools")]
    padding = json.dumps(tools[0] if tools else long.get("tools"), indent=1)
    while len(padding) < 3.3 * tokens:
        padding += padding
    long = copy.deepcopy(long)
    have = len(json.dumps(long["messages"])) + len(json.dumps(long.get("tools") or []))
    long["messages"].insert(1, {"role": "user", "content": "Reference:\n" + padding[
        :max(0, int(3.3 * tokens) - have)]})
    return short, long


def fresh(body: dict[str, Any], model: str, cap: int) -> dict[str, Any]:
    """``body`` with a unique first line (nothing of it cached), streamed, capped."""
    body = capped(body, "/v1/chat/completions", model, cap)
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    first = body["messages"][0]
    text = first["content"] if isinstance(first["content"], str) else json.dumps(first["content"])
    body["messages"][0] = {**first, "content": f"Run {uuid.uuid4().hex}.\n{text}"}
    return body


def probe(client: httpx.Client, target: Target, sessions: list[Path], tokens: int,
          gap: float) -> None:
    short, long = probe_bodies(sessions, tokens)
    path = "/v1/chat/completions"
    alone = []
    for _ in range(3):
        status, ttft, _, events = send(client, target.url, path, fresh(short, target.model, 1), {})
        if status != 200:
            print(f"  {target.name}: the probe's short request got {status}; no probe")
            return
        alone.append(ttft)
    short_usage = usage_of(events)
    print(f"    short request alone: TTFT {', '.join(f'{t:.2f}' for t in alone)} s", flush=True)
    result: dict[str, Any] = {}

    def run_long() -> None:
        status, ttft, _, events = send(client, target.url, path, fresh(long, target.model, 1), {})
        usage = usage_of(events)
        result.update(status=status, ttft=ttft, prompt=usage.prompt_tokens if usage else 0)

    thread = threading.Thread(target=run_long)
    started = time.perf_counter()
    thread.start()
    time.sleep(2.0)  # the long prompt is admitted and prefilling
    during: list[tuple[float, float]] = []  # (sent at, TTFT): one after another, at every depth
    while thread.is_alive():
        sent = time.perf_counter() - started
        _, ttft, _, _ = send(client, target.url, path, fresh(short, target.model, 1), {})
        if thread.is_alive():  # answered while the long one still prefilled
            during.append((sent, ttft))
            print(f"    short request sent {sent:6.1f} s into the long prefill: TTFT "
                  f"{ttft:.2f} s", flush=True)
        time.sleep(gap)
    thread.join()
    solo = statistics.median(alone)
    ttfts = [t for _, t in during] or [0.0]
    target.probe = {"short_prompt": short_usage.prompt_tokens if short_usage else 0,
                    "long_prompt": result.get("prompt", 0),
                    "solo_ttft_s": solo, "during_ttft_s": statistics.median(ttfts),
                    "during_max_s": max(ttfts), "during_n": len(during),
                    "long_ttft_s": result.get("ttft", 0.0),
                    "ratio": statistics.median(ttfts) / solo, "ratio_max": max(ttfts) / solo,
                    "long_wall_s": time.perf_counter() - started}
    p = target.probe
    print(f"  {target.name}: short request ({p['short_prompt']} tokens) TTFT alone "
          f"{p['solo_ttft_s']:.2f} s; during a {p['long_prompt']}-token prefill ({p['during_n']} "
          f"sent) median {p['during_ttft_s']:.2f} s = {p['ratio']:.2f}x, max "
          f"{p['during_max_s']:.2f} s = {p['ratio_max']:.2f}x (the long prompt's TTFT "
          f"{p['long_ttft_s']:.1f} s)", flush=True)


def summary(target: Target) -> dict[str, Any]:
    """Per session: its first prompt's TTFT, and the cached fractions and TTFTs of turn 2 on (a
    session recorded without turns counts every request after the first)."""
    out = {}
    for name in sorted({r.session for r in target.rows}):
        rows = [r for r in target.rows if r.session == name]
        served = [r for r in rows if r.status < 400 and r.prompt]
        multi = any(r.turn > 1 for r in served)
        later = [r for r in served if r.turn > 1] if multi else served[1:]
        fractions = [r.cached / r.prompt for r in later]
        out[name] = {
            "requests": len(rows), "refused": sum(r.status >= 400 for r in rows),
            "first_prompt": max((r.prompt for r in served if r.turn == 1), default=0),
            "first_ttft_s": max((r.ttft_s for r in served if r.turn == 1), default=0.0),
            "later_min_cached": min(fractions) if fractions else None,
            "later_mean_cached": statistics.mean(fractions) if fractions else None,
            "later_median_ttft_s": statistics.median(r.ttft_s for r in later) if later else None,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", required=True, metavar="NAME=URL")
    parser.add_argument("--sessions", nargs="*", type=Path, default=SESSIONS)
    parser.add_argument("--max-output-tokens", type=int, default=32)
    parser.add_argument("--probe-tokens", type=int, default=16000)
    parser.add_argument("--no-probe", action="store_true")
    parser.add_argument("--no-replay", action="store_true", help="the probe only")
    parser.add_argument("--probe-gap", type=float, default=10.0,
                        help="seconds between the probe's short requests")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    print(cpu_line())
    targets = [Target(*spec.split("=", 1)) for spec in args.target]
    with httpx.Client(timeout=httpx.Timeout(3600.0, connect=10.0)) as client:
        for target in targets:
            target.model = served_model(client, target.url)
            print(f"{target.name}: {target.url}, model {target.model}")
            for session in [] if args.no_replay else args.sessions:
                replay(client, target, session, args.max_output_tokens)
            if not args.no_probe:
                probe(client, target, args.sessions, args.probe_tokens, args.probe_gap)
    report = {t.name: {"url": t.url, "model": t.model, "sessions": summary(t), "probe": t.probe,
                       "rows": [r.__dict__ for r in t.rows]} for t in targets}
    print()
    print(f"{'target':>8} {'session':>8} {'reqs':>4} {'first prompt':>12} {'first TTFT':>10} "
          f"{'2+ cached min':>13} {'mean':>6} {'2+ TTFT p50':>11}")
    for target in targets:
        for name, s in report[target.name]["sessions"].items():
            low, mean = s["later_min_cached"], s["later_mean_cached"]
            print(f"{target.name:>8} {name:>8} {s['requests']:>4} {s['first_prompt']:>12} "
                  f"{s['first_ttft_s']:>9.1f}s {low if low is None else f'{low:.1%}':>13} "
                  f"{mean if mean is None else f'{mean:.1%}':>6} "
                  f"{s['later_median_ttft_s'] or 0:>10.2f}s")
        if target.probe:
            print(f"{target.name:>8} probe: short TTFT during a {target.probe['long_prompt']}-"
                  f"token prefill / alone = {target.probe['ratio']:.2f}x median, "
                  f"{target.probe['ratio_max']:.2f}x max")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
