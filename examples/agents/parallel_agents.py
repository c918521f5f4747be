"""N agents in parallel sharing one pinned system prompt, against agentd with the OpenAI SDK.

Every agent sends the same long prefix (system prompt + tools) with its own user turn, all at
once. The script runs the same N requests twice and prints each request's cached tokens and
time to first token (TTFT), then the aggregate:

- with the pin: the prefix is pinned (``POST /v1/pins``), so every request prefills only its
  own turn;
- without it: each request carries its own ``cache_salt`` (a vLLM extension agentd supports),
  which puts it in a cache namespace nothing has filled, so it prefills the whole prefix — what
  every request would cost with no prefix cache.

    agentd start &
    python examples/agents/parallel_agents.py --agents 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid
from importlib import resources
from typing import Any

import httpx
import openai


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    url = os.environ.get("AGENTD_URL", "http://127.0.0.1:8000").rstrip("/")
    parser.add_argument("--base-url", default=url if url.endswith("/v1") else url + "/v1",
                        help="OpenAI base URL of agentd [default: $AGENTD_URL/v1]")
    parser.add_argument("--workload", default="research",
                        help="research, coding, support, or a workload JSON file")
    parser.add_argument("--agents", type=int, default=4, help="agents running at once")
    parser.add_argument("--max-tokens", type=int, default=16, help="per reply")
    parser.add_argument("--pin-name", default=None, help="[default: the workload's name]")
    parser.add_argument("--api-key", default=os.environ.get("AGENTD_API_KEY", "unused"))
    return parser.parse_args()


def load_workload(name: str) -> dict[str, Any]:
    if os.path.exists(name):
        with open(name) as f:
            return json.load(f)
    stem = name if name.endswith("_agent") else f"{name}_agent"
    return json.loads(resources.files("agentd.workloads").joinpath(f"{stem}.json").read_text())


def ensure_pinned(base_url: str, api_key: str, name: str, workload: dict[str, Any]) -> None:
    reply = httpx.post(f"{base_url}/pins", timeout=900, headers={"Authorization":
                                                                  f"Bearer {api_key}"},
                       json={"name": name, "system": workload["system"],
                             "tools": workload["tools"]})
    if reply.status_code == 409 and reply.json()["error"]["code"] == "pin_exists":
        print(f"pin {name!r} is already there")
        return
    if reply.is_error:
        raise SystemExit(f"could not pin: {reply.json()['error']['message']}")
    info = reply.json()
    print(f"pinned {name!r}: {info['num_tokens']} tokens in {info['num_blocks']} blocks, "
          f"prefilled in {info['prefill_s']:.2f} s")


async def one_agent(client: openai.AsyncOpenAI, model: str, workload: dict[str, Any],
                    turn: str, max_tokens: int, salt: str | None) -> dict[str, Any]:
    """One agent's request, streamed: its TTFT and cached prompt tokens."""
    start = time.perf_counter()
    ttft: float | None = None
    usage = None
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": workload["system"]},
                               {"role": "user", "content": turn}],
        tools=workload["tools"], max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"cache_salt": salt} if salt else None)
    async for chunk in stream:
        usage = chunk.usage or usage
        if ttft is None and chunk.choices and (
                chunk.choices[0].delta.content or chunk.choices[0].delta.tool_calls
                or chunk.choices[0].finish_reason):
            ttft = time.perf_counter() - start
    assert usage is not None
    return {"ttft_s": ttft if ttft is not None else time.perf_counter() - start,
            "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.prompt_tokens_details.cached_tokens}


async def run_phase(client: openai.AsyncOpenAI, model: str, workload: dict[str, Any],
                    args: argparse.Namespace, label: str, salted: bool) -> list[dict[str, Any]]:
    turns = [workload["turns"][i % len(workload["turns"])] for i in range(args.agents)]
    started = time.perf_counter()
    results = await asyncio.gather(*(
        one_agent(client, model, workload, turn, args.max_tokens,
                  uuid.uuid4().hex if salted else None) for turn in turns))
    wall_s = time.perf_counter() - started
    print(f"\n{label}: {args.agents} agents at once, {wall_s:.2f} s in all")
    for i, r in enumerate(results):
        print(f"  agent {i}: cached tokens {r['cached_tokens']} of {r['prompt_tokens']} prompt "
              f"tokens, TTFT {r['ttft_s']:.3f} s")
    return results


def summary(label: str, results: list[dict[str, Any]]) -> str:
    ttfts = [r["ttft_s"] for r in results]
    cached = sum(r["cached_tokens"] for r in results)
    prompt = sum(r["prompt_tokens"] for r in results)
    return (f"{label:<12} TTFT mean {statistics.mean(ttfts):7.3f} s, "
            f"median {statistics.median(ttfts):7.3f} s, max {max(ttfts):7.3f} s; "
            f"cached tokens {cached} of {prompt} ({100 * cached / prompt:.0f}%)")


async def main_async(args: argparse.Namespace) -> None:
    workload = load_workload(args.workload)
    async with openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key,
                                  max_retries=0, timeout=900) as client:
        model = (await client.models.list()).data[0].id
        ensure_pinned(args.base_url, args.api_key, args.pin_name or workload["name"], workload)
        pinned = await run_phase(client, model, workload, args, "with the pin", salted=False)
        cold = await run_phase(client, model, workload, args,
                               "without it (a fresh cache_salt per request)", salted=True)
    with_mean = statistics.mean(r["ttft_s"] for r in pinned)
    without_mean = statistics.mean(r["ttft_s"] for r in cold)
    print("\naggregate TTFT")
    print(summary("with pin", pinned))
    print(summary("without pin", cold))
    print(f"the pin makes the mean TTFT {without_mean / with_mean:.1f}x lower")


def main() -> None:
    asyncio.run(main_async(parse_args()))


if __name__ == "__main__":
    main()
