"""Cache-busters between a client's own prompts (agentd/pins/near_miss.py, agentd/server/
prompt_history.py), on the real SmolLM2 tokenizer and chat template: Claude Code's billing
header, a per-request id, a timestamp at the end of the system prompt — and no report for what
is not one (a conversation going on, another user turn, another key or tenant)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from agentd.chat import render_chat
from agentd.pins.near_miss import CLAUDE_CODE_FIX, CLAUDE_CODE_HEADER, find_span
from agentd.server.prompt_history import MAX_GROUPS, PromptHistory

RULES = ("You are an interactive CLI tool that helps users with software engineering tasks. "
         "Use the instructions below and the tools available to you to assist the user. "
         "Never guess a file's contents; read it first. Keep answers short. ") * 4


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


def ids(tokenizer, system: str, *turns: str) -> list[int]:
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return render_chat(tokenizer, messages, None, None).prompt_token_ids


def billing(cch: str) -> str:
    return (f"x-anthropic-billing-header: cc_version=2.0.14.a1b; cc_entrypoint=cli; cch={cch};"
            f"\n{RULES}")


def test_claude_codes_billing_hash_is_named_with_its_fix(tokenizer) -> None:
    history = PromptHistory(tokenizer)
    assert history.observe(None, None, ids(tokenizer, billing("8f3a1"), "Fix the bug")) is None
    miss = history.observe(None, None, ids(tokenizer, billing("c02d9"), "Fix the bug"))
    assert miss is not None
    assert (miss.cause, miss.fix) == (CLAUDE_CODE_HEADER, CLAUDE_CODE_FIX)
    assert "c02d9" in miss.new_span + miss.before and "8f3a1" in miss.old_span + miss.before
    # everything after the hash was equal and had to be computed again
    assert miss.num_tokens_lost > len(tokenizer(RULES).input_ids) - 8
    assert miss.at_token < 40
    report = history.report()
    assert report["total"] == 1
    assert report["top"] == [{"key": None, "owner": None, "cause": CLAUDE_CODE_HEADER,
                              "count": 1}]


def test_a_per_request_id_at_the_start_of_the_system_prompt(tokenizer) -> None:
    history = PromptHistory(tokenizer)
    history.observe("t1", "agent", ids(tokenizer, f"Request 3f9a2b1c77. {RULES}", "hi"))
    miss = history.observe("t1", "agent", ids(tokenizer, f"Request 09be44d1e2. {RULES}", "hi"))
    assert miss is not None and miss.key == "agent" and miss.owner == "t1"
    assert miss.cause == "a per-request hash or id at the start of the prompt (its first line)"
    assert miss.fix is None


def test_a_timestamp_at_the_end_of_the_system_prompt_costs_the_conversation(tokenizer) -> None:
    history = PromptHistory(tokenizer)
    turn = "Please read src/main.py and tell me what the function parse_args does, in detail."
    history.observe(None, "conv-1", ids(tokenizer, f"{RULES}\nNow: 2026-12-01 10:31:07", turn))
    miss = history.observe(None, "conv-1", ids(
        tokenizer, f"{RULES}\nNow: 2026-12-01 10:32:44", turn, "It parses flags.", "Thanks"))
    assert miss is not None
    assert miss.cause == ("a date or time at the end of a message (the system prompt's, if it "
                          "is the first)")
    assert miss.num_tokens_lost >= 32


def test_what_is_not_a_cache_buster_is_not_reported(tokenizer) -> None:
    history = PromptHistory(tokenizer)
    first = ids(tokenizer, RULES, "What does main.py do?")
    assert history.observe(None, "k", first) is None
    # the conversation goes on: it extends the earlier prompt
    assert history.observe(None, "k", ids(tokenizer, RULES, "What does main.py do?",
                                          "It runs.", "And util.py?")) is None
    # another conversation of the same agent: only the user's turn differs
    assert history.observe(None, "k", ids(tokenizer, RULES, "Summarise README.md")) is None
    # another key, another tenant: never compared
    other = ids(tokenizer, billing("00000"), "x")
    assert history.observe(None, "other-key", other) is None
    assert history.observe("tenant-b", "k", ids(tokenizer, billing("11111"), "x")) is None
    assert history.report()["total"] == 0


def test_history_stays_bounded(tokenizer) -> None:
    history = PromptHistory(tokenizer)
    for i in range(MAX_GROUPS + 20):
        history.observe(None, f"key-{i}", [1, 2, 3, i])
    assert len(history._groups) == MAX_GROUPS


def test_find_span_needs_a_long_equal_run_after_the_span() -> None:
    old = list(range(100, 200))
    new = old[:10] + [1, 2, 3] + old[12:]
    span = find_span(new, old, 10)
    assert span is not None and (span.new_end, span.old_end) == (13, 12)
    assert span.num_equal_after == 88
    assert find_span(new[:40], old[:40], 10) is None  # 27 equal tokens after it: too few
