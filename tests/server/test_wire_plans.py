"""What the wires put on the plan for the retention work: the number of prompt tokens up to the
last cache breakpoint (Anthropic ``cache_control`` on a tool, a system block or a message block,
or at the top level; OpenAI ``prompt_cache_breakpoint`` with ``prompt_cache_options``) and its
TTL — a prefix of the prompt's own token ids that ends where the marked block ends — and the
bounded, per-tenant store of responses."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest

from agentd.server.response_store import ResponseStore, StoredResponse
from agentd.server.wires.messages_plan import plan_messages
from agentd.server.wires.messages_types import MessagesRequest
from agentd.server.wires.responses_plan import plan_responses
from agentd.server.wires.responses_types import ResponsesRequest

TOOL = {"name": "get_weather", "description": "Weather.", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}}}
HOUR = {"type": "ephemeral", "ttl": "1h"}


def messages_plan(engine: Any, **body: Any) -> Any:
    body = {"model": "m", "max_tokens": 4, **body}
    return plan_messages(msgspec.convert(body, MessagesRequest), engine, "m", 0).plan


def split(engine: Any, plan: Any) -> tuple[str, str]:
    """The prompt's text before and after the retained prefix."""
    ids, num = plan.prompt_token_ids, plan.retention.num_tokens
    assert 0 < num <= len(ids)
    return engine.tokenizer.decode(ids[:num]), engine.tokenizer.decode(ids[num:])


def test_anthropic_breakpoints(tiny) -> None:
    _, engine = tiny
    user = {"role": "user", "content": [{"type": "text", "text": "First part."},
                                        {"type": "text", "text": "Second part."}]}
    plain = messages_plan(engine, system="Be brief.", messages=[user], tools=[TOOL])
    assert plain.retention is None
    on_system = messages_plan(engine, system=[{"type": "text", "text": "Be brief.",
                                               "cache_control": HOUR}],
                              messages=[user], tools=[TOOL])
    before, after = split(engine, on_system)
    assert before.endswith("Be brief.<|im_end|>\n") and "First part." in after
    assert on_system.retention.ttl_s == 3600
    on_tool = messages_plan(engine, system="Be brief.", messages=[user],
                            tools=[{**TOOL, "cache_control": {"type": "ephemeral"}}])
    before, after = split(engine, on_tool)
    assert '"get_weather"' in before and "Be brief." in after
    assert on_tool.retention.ttl_s == 300  # Anthropic's default, 5m
    marked = {**user, "content": [{**user["content"][0], "cache_control": HOUR},
                                  user["content"][1]]}
    on_block = messages_plan(engine, system="Be brief.", messages=[marked], tools=[TOOL])
    before, after = split(engine, on_block)
    assert "First part." in before and "Second part." in after
    # the last mark wins; the top-level one is the whole prompt
    both = messages_plan(engine, system=[{"type": "text", "text": "Be brief.",
                                          "cache_control": HOUR}], messages=[marked])
    last = messages_plan(engine, system=[{"type": "text", "text": "Be brief."}],
                         messages=[marked])
    assert both.retention == last.retention and "First part." in split(engine, both)[0]
    whole = messages_plan(engine, system="Be brief.", messages=[user], cache_control=HOUR)
    assert whole.retention.num_tokens == len(whole.prompt_token_ids)


def responses_plan(engine: Any, **body: Any) -> Any:
    request = msgspec.convert({"model": "m", **body}, ResponsesRequest)
    return plan_responses(request, engine, "m", 0, None, keep=False).plan


def test_openai_breakpoints_and_lifetimes(tiny) -> None:
    _, engine = tiny
    mark = {"mode": "explicit", "ttl": "12h"}
    items = [{"role": "user", "content": [
        {"type": "input_text", "text": "Shared context.", "prompt_cache_breakpoint": mark},
        {"type": "input_text", "text": "The question."}]}]
    explicit = responses_plan(engine, instructions="Be brief.", input=items,
                              prompt_cache_options={"mode": "explicit", "ttl": "12h"})
    before, after = split(engine, explicit)
    assert "Shared context." in before and "The question." in after
    assert explicit.retention.ttl_s == 12 * 3600
    implicit = responses_plan(engine, input=items, prompt_cache_options={"ttl": "30m"})
    assert implicit.retention.num_tokens == len(implicit.prompt_token_ids)
    assert implicit.retention.ttl_s == 1800
    mark_only = responses_plan(engine, instructions="Be brief.", input=items)  # alone: kept
    assert mark_only.retention == explicit.retention
    day = responses_plan(engine, input="hi", prompt_cache_retention="24h")
    assert day.retention.ttl_s == 86400
    assert day.retention.num_tokens == len(day.prompt_token_ids)
    assert responses_plan(engine, input="hi", prompt_cache_retention="in_memory").retention \
        is None
    assert responses_plan(engine, input="hi").retention is None


def test_response_store_is_bounded_per_tenant_and_releases_tails() -> None:
    released: list[str] = []
    store = ResponseStore(max_size=2, ttl_s=0.5, release=released.extend)

    def put(tenant: str | None, name: str) -> None:
        store.put(tenant, name, StoredResponse(None, [1, 2], f"req-{name}", None))

    put("a", "r1")
    put("a", "r2")
    put("b", "r1")  # another tenant's id space
    assert store.get("a", "r1") is not None  # now the most recently used of a
    put("a", "r3")
    assert released == ["req-r2"] and store.get("a", "r2") is None
    assert store.get("b", "r2") is None and store.get("b", "r1") is not None
    assert store.delete("a", "r1") and not store.delete("a", "r1")
    assert released == ["req-r2", "req-r1"]
    time.sleep(0.6)
    assert store.get("a", "r3") is None  # expired after its TTL unused
    assert sorted(released) == ["req-r1", "req-r2", "req-r3"]
    store.clear()
    assert sorted(released) == ["req-r1", "req-r1", "req-r2", "req-r3"] and len(store) == 0


@pytest.mark.parametrize("max_tokens", [0])
def test_max_tokens_zero_is_accepted_for_the_prewarm(tiny, max_tokens: int) -> None:
    _, engine = tiny
    request = msgspec.convert({"model": "m", "max_tokens": max_tokens, "messages": [
        {"role": "user", "content": "hi"}]}, MessagesRequest)
    job = plan_messages(request, engine, "m", 0)
    assert job.prewarm and job.plan.params.max_tokens == 1
