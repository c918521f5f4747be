"""A tool-using agent loop against agentd with the OpenAI SDK, its system prompt pinned.

The agent pins its system prompt and tools once (``POST /v1/pins``, what ``agentd pin`` does),
then runs a conversation: each user turn is sent with the whole history; when the model calls
a tool, a simulated tool answers and the model continues. Every request prints how many prompt
tokens came from the cache and its time to first token (TTFT) — with the pin, only the new part
of each prompt is prefilled.

    agentd start &
    python examples/agents/pinned_agent.py --turns 3
"""

from __future__ import annotations

import argparse
import json
import os
import time
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
    parser.add_argument("--turns", type=int, default=3, help="user turns to run")
    parser.add_argument("--max-tokens", type=int, default=128, help="per model reply")
    parser.add_argument("--max-tool-rounds", type=int, default=2,
                        help="tool calls the agent may make per user turn")
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
    """Pin the system prompt and tools (already pinned under this name is fine)."""
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


def simulated_tool(name: str, arguments: str) -> str:
    """Stand-in tools: a deterministic, obviously made-up result."""
    return json.dumps({"tool": name, "arguments": arguments, "result": "simulated: no real "
                       "tool ran; answer from what you know and say so"})


def step(client: openai.OpenAI, model: str, messages: list[dict[str, Any]],
         tools: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    """One streamed model call: its text, tool calls, TTFT and cached tokens."""
    start = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    usage = None
    stream = client.chat.completions.create(
        model=model, messages=messages, tools=tools, max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if ttft is None and (delta.content or delta.tool_calls or chunk.choices[0].finish_reason):
            ttft = time.perf_counter() - start
        text.append(delta.content or "")
        for call in delta.tool_calls or []:
            slot = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
            slot["name"] += call.function.name or ""
            slot["arguments"] += call.function.arguments or ""
    assert usage is not None
    return {"text": "".join(text), "calls": list(calls.values()), "ttft_s": ttft,
            "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "cached_tokens": usage.prompt_tokens_details.cached_tokens}


def run_turn(client: openai.OpenAI, model: str, messages: list[dict[str, Any]],
             workload: dict[str, Any], args: argparse.Namespace, turn: int) -> None:
    for round_ in range(args.max_tool_rounds + 1):
        out = step(client, model, messages, workload["tools"], args.max_tokens)
        ttft = "-" if out["ttft_s"] is None else f"{out['ttft_s']:.3f} s"
        print(f"turn {turn} step {round_ + 1}: cached tokens {out['cached_tokens']} of "
              f"{out['prompt_tokens']} prompt tokens, TTFT {ttft}, "
              f"{out['completion_tokens']} output tokens")
        if not out["calls"] or round_ == args.max_tool_rounds:
            messages.append({"role": "assistant", "content": out["text"]})
            print(f"  assistant: {out['text'].strip()[:200]!r}")
            return
        messages.append({"role": "assistant", "content": out["text"], "tool_calls": [
            {"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in out["calls"]]})
        for call in out["calls"]:
            print(f"  tool call: {call['name']}({call['arguments'][:80]})")
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": simulated_tool(call["name"], call["arguments"])})


def main() -> None:
    args = parse_args()
    workload = load_workload(args.workload)
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0,
                           timeout=900)
    model = client.models.list().data[0].id
    ensure_pinned(args.base_url, args.api_key, args.pin_name or workload["name"], workload)
    messages: list[dict[str, Any]] = [{"role": "system", "content": workload["system"]}]
    for turn in range(1, args.turns + 1):
        user = workload["turns"][(turn - 1) % len(workload["turns"])]
        print(f"user: {user[:100]!r}")
        messages.append({"role": "user", "content": user})
        run_turn(client, model, messages, workload, args, turn)


if __name__ == "__main__":
    main()
