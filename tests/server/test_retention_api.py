"""Retention on the chat wire (OpenAI ``prompt_cache_retention`` / ``prompt_cache_options``):
usage reports what a request wrote and read, /v1/stats and /metrics show the retained prefixes,
bad TTLs are 400s that change nothing, and ``prewarm`` (``max_tokens: 0``) makes the next
request a hit; a cache-buster between two requests of one ``prompt_cache_key`` is reported with
its cause, span and fix. Each test retains a prompt of its own on one module-wide tiny engine."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from typing import Any

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from agentd.cli.stats import render
from agentd.engine.request import EngineRequest, RetentionRequest
from agentd.pins.near_miss import CLAUDE_CODE_FIX, CLAUDE_CODE_HEADER
from agentd.server.wires.cache_control import cache_usage
from agentd.server.wires.chat_plan import plan_chat
from agentd.server.wires.chat_types import ChatCompletionRequest
from agentd.server.wires.plan import prewarm, prewarm_params

SYSTEM = ("You are a careful research assistant. Cite sources, say what you do not know, and "
          "answer in short paragraphs. ") * 8


def body(system: str, user: str = "Hello", **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": user}],
            "max_tokens": 2, "temperature": 0, **fields}


def unique_system() -> str:
    return f"Session {uuid.uuid4().hex}. {SYSTEM}"


def held(stats: dict[str, Any]) -> list[tuple]:
    return sorted((r["num_tokens"], r["ttl"], r["hits"]) for r in stats["retained"])


def retained(client) -> list[dict[str, Any]]:
    return client.get("/v1/stats").json()["retained"]


def test_a_retained_prompt_reports_writes_then_reads(client) -> None:
    system = unique_system()
    first = client.post("/v1/chat/completions", json=body(system, prompt_cache_retention="24h"))
    assert first.status_code == 200, first.text
    usage = first.json()["usage"]
    num_prompt = usage["prompt_tokens"]
    details = usage["prompt_tokens_details"]
    assert details["cached_tokens"] < 16  # only the template's shared first tokens, if any
    # what it computed and now holds: its whole blocks, less what it read
    assert details["cache_write_tokens"] == num_prompt // 16 * 16 - details["cached_tokens"]
    entry = retained(client)[0]  # the most recently used first
    assert (entry["num_tokens"], entry["hits"]) == (num_prompt // 16 * 16, 0)
    assert entry["ttl"] == 86400.0 and 86000 < entry["ttl_left_s"] <= 86400
    ends_with = entry["ends_with"]
    # the conversation goes on: its prompt holds the whole retained one
    turn = body(system, prompt_cache_retention="24h")
    turn["messages"] += [{"role": "assistant", "content": "Hi."},
                         {"role": "user", "content": "Another question"}]
    second = client.post("/v1/chat/completions", json=turn)
    usage = second.json()["usage"]
    details = usage["prompt_tokens_details"]
    assert details["cached_tokens"] >= num_prompt // 16 * 16  # read
    assert details["cache_write_tokens"] == (usage["prompt_tokens"] // 16 * 16
                                             - details["cached_tokens"])
    [entry] = [r for r in retained(client) if r["ends_with"] == ends_with and
               r["num_tokens"] == num_prompt // 16 * 16]
    assert entry["hits"] == 1 and entry["tokens_served"] > 0
    # without a retention field the usage carries no cache_write_tokens at all
    plain = client.post("/v1/chat/completions", json=body(system, "Third"))
    assert "cache_write_tokens" not in plain.json()["usage"]["prompt_tokens_details"]


def test_prompt_cache_options_retain_for_their_ttl_and_metrics_show_it(client) -> None:
    reply = client.post("/v1/chat/completions", json=body(
        unique_system(), prompt_cache_key="agent-7",
        prompt_cache_options={"mode": "implicit", "ttl": "30m"}))
    assert reply.status_code == 200, reply.text
    assert any(r["ttl"] == 1800.0 for r in retained(client))
    explicit = client.post("/v1/chat/completions", json=body(
        unique_system(), prompt_cache_options={"mode": "explicit"}))
    # explicit mode without breakpoints (chat has none) retains nothing, as at OpenAI
    assert "cache_write_tokens" not in explicit.json()["usage"]["prompt_tokens_details"]
    stats = client.get("/v1/stats").json()
    assert stats["num_retained"] == len(stats["retained"]) >= 1
    # retained prefixes that share blocks (a system prompt and a turn after it) count them once
    assert 0 < stats["num_blocks_retained"] <= sum(r["num_blocks"] for r in stats["retained"])
    metrics = {s.name: s.value for f in text_string_to_metric_families(client.get("/metrics").text)
               for s in f.samples}
    assert metrics["agentd:retained_prefixes"] == stats["num_retained"]
    assert metrics["agentd:retained_blocks"] == stats["num_blocks_retained"]
    assert 0 < metrics["agentd:retained_min_ttl_left_seconds"] <= 86400
    console = Console(record=True, width=200)
    console.print(render(stats))
    text = console.export_text()
    assert f"retained prefixes ({stats['num_retained']})" in text
    assert f"{stats['num_blocks_retained']} retained" in text and " 30m " in text


@pytest.mark.parametrize(("fields", "param"), [
    ({"prompt_cache_retention": "1h"}, "prompt_cache_retention"),
    ({"prompt_cache_retention": "in-memory"}, "prompt_cache_retention"),
    ({"prompt_cache_retention": 24}, "prompt_cache_retention"),
    ({"prompt_cache_options": {"ttl": "5m"}}, "prompt_cache_options.ttl"),
    ({"prompt_cache_options": {"ttl": "24h"}}, "prompt_cache_options.ttl"),
    ({"prompt_cache_options": {"mode": "sometimes"}}, "prompt_cache_options.mode"),
    ({"prompt_cache_options": {"ttl": "30m"}, "prompt_cache_retention": "24h"},
     "prompt_cache_retention"),
])
def test_bad_ttls_are_400s_that_change_nothing(client, fields, param) -> None:
    before = client.get("/v1/stats").json()
    reply = client.post("/v1/chat/completions", json=body(unique_system(), **fields))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    after = client.get("/v1/stats").json()
    assert held(after) == held(before)
    assert after["prompt_tokens_total"] == before["prompt_tokens_total"]


def test_prewarm_retains_without_generating_and_the_next_request_hits(client) -> None:
    engine = client.app.state.agentd.require_engine()
    request = body(unique_system())
    plan = plan_chat(msgspec.convert(request, ChatCompletionRequest), engine, engine.model_name, 0)
    ids = plan.prompt_token_ids
    warm = EngineRequest(ids, prewarm_params(), f"prewarm-{uuid.uuid4().hex}",
                         retention=RetentionRequest(len(ids) - 4, 300.0))

    async def started_prewarm():  # a pre-warm plan, as ``wires.plan.start`` submits it
        return await prewarm(engine.add_request(warm))

    last = asyncio.run(started_prewarm())
    assert (last.num_output_tokens, last.text, last.token_ids) == (0, "", [])
    num_whole = (len(ids) - 4) // 16 * 16
    assert last.num_retained_tokens == num_whole and last.num_cached_tokens < 16
    usage = cache_usage(last, replace(plan, request=replace(
        plan.request, retention=RetentionRequest(len(ids) - 4, 300.0))))
    assert (usage.read, usage.creation) == (last.num_cached_tokens, num_whole - usage.read)
    entry = engine.pin_summary().retained[0]  # the most recently used first
    assert (entry.num_tokens, entry.ttl_s, entry.num_hits) == (num_whole, 300.0, 0)
    reply = client.post("/v1/chat/completions", json=request)
    details = reply.json()["usage"]["prompt_tokens_details"]
    assert details["cached_tokens"] >= num_whole  # the next request is a hit
    assert [r.num_hits for r in engine.pin_summary().retained
            if r.created_s == entry.created_s] == [1]


def test_a_cache_buster_is_reported_by_prompt_cache_key(client, poll) -> None:
    def billed(cch: str) -> dict[str, Any]:
        system = f"x-anthropic-billing-header: cc_version=2.0.14; cch={cch};\n{SYSTEM}"
        return body(system, "Fix the failing test", prompt_cache_key="cc-session")

    for cch in ("4be01", "9a7c3"):
        assert client.post("/v1/chat/completions", json=billed(cch)).status_code == 200
    stats = poll(lambda: client.get("/v1/stats").json(),
                 lambda s: s["prompt_near_misses"]["total"] >= 1)
    near = stats["prompt_near_misses"]
    assert near["top"] == [{"key": "cc-session", "owner": None, "cause": CLAUDE_CODE_HEADER,
                            "count": 1}]
    [miss] = near["recent"]
    assert (miss["new_span"], miss["old_span"], miss["fix"]) == ("9a7c3", "4be01",
                                                                  CLAUDE_CODE_FIX)
    assert miss["num_tokens_lost"] > 100
    console = Console(record=True, width=200)
    console.print(render(stats))
    text = console.export_text()
    assert "cc-session" in text and "CLAUDE_CODE_ATTRIBUTION_HEADER=0" in text
    assert "⟦9a7c3⟧ vs ⟦4be01⟧" in text
