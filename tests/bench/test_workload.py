"""Workload trimming and request building for ``agentd bench``, with the default model's real
tokenizer: the budget is met to within one block, tools stay valid leading tools, a workload
under the budget is sent whole, and requests carry distinct turns and namespace-specific
prefixes."""

from __future__ import annotations

import json

import pytest

from agentd.bench.workload import (
    PACKAGED,
    Namespace,
    Prompts,
    load_workload,
    median_turn,
    packaged_path,
    prompt_len,
    trim_to_budget,
)

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.parametrize("name", PACKAGED)
@pytest.mark.parametrize("budget", [2100, 1200, 700])
def test_trim_meets_the_budget_within_a_block(tokenizer, name: str, budget: int) -> None:
    workload = load_workload(packaged_path(name))
    turn = median_turn(workload, tokenizer)
    full_len = prompt_len(tokenizer, workload.system, workload.tools, turn)
    trimmed = trim_to_budget(workload, tokenizer, budget)
    length = prompt_len(tokenizer, trimmed.system, trimmed.tools, turn)
    if full_len <= budget:
        assert trimmed == workload
        return
    assert length <= budget
    if trimmed.system != workload.system:
        assert budget - BLOCK_SIZE <= length
    else:  # the system text fits whole: then tools are added while they fit
        k = len(trimmed.tools)
        assert k == len(workload.tools) or prompt_len(
            tokenizer, trimmed.system, workload.tools[: k + 1], turn) > budget
    assert workload.system.startswith(trimmed.system)
    assert 1 <= len(trimmed.tools) <= len(workload.tools)
    assert trimmed.tools == workload.tools[: len(trimmed.tools)]
    assert json.loads(json.dumps(trimmed.tools)) == trimmed.tools
    assert all(t["type"] == "function" and t["function"]["name"] for t in trimmed.tools)
    assert (trimmed.num_tools_total, trimmed.turns) == (len(workload.tools), workload.turns)


def test_coding_agent_default_budget_keeps_two_tools_and_cuts_at_words(tokenizer) -> None:
    workload = load_workload(packaged_path("coding_agent"))
    trimmed = trim_to_budget(workload, tokenizer, 2100)
    # 308 + 266 schema tokens is nearest to a quarter of the budget (525)
    assert [t["function"]["name"] for t in trimmed.tools] == ["read_file", "write_file"]
    assert not trimmed.system.endswith(" ")
    assert len(trimmed.system) < len(workload.system)


def test_turns_never_repeat_and_namespaces_change_the_prefix() -> None:
    workload = load_workload(packaged_path("research_agent"))
    prompts = Prompts(workload)
    turns = [prompts.next_turn() for _ in range(len(workload.turns) + 5)]
    assert len(set(turns)) == len(turns)
    plain = prompts.single_turn(Namespace())
    salted = prompts.single_turn(Namespace(salt="s"))
    a, b = prompts.single_turn(Namespace(nonce="a")), prompts.single_turn(Namespace(nonce="b"))
    assert plain[0][0] == salted[0][0] and plain[1] == salted[1] == workload.tools
    assert a[0][0]["content"] != b[0][0]["content"] != plain[0][0]["content"]
    assert a[1][0] != b[1][0] and a[1][1:] == workload.tools[1:]
    assert workload.tools[0]["function"]["description"].startswith("Search")  # not mutated


def test_conversation_steps_end_where_the_model_speaks() -> None:
    workload = load_workload(packaged_path("coding_agent"))
    conversation = workload.conversations[0]
    steps = Prompts(workload).conversation_steps(0, Namespace())
    assert steps[-1][0][1:] == conversation
    for messages, _ in steps[:-1]:
        next_message = conversation[len(messages) - 1]
        assert next_message["role"] == "assistant"
        assert messages[0]["role"] == "system"


def test_bad_workload_files_name_the_problem(tmp_path) -> None:
    from agentd.bench.workload import WorkloadError

    bad = tmp_path / "bad.json"
    bad.write_text('{"system": "x", "turns": []}')
    with pytest.raises(WorkloadError, match="turns"):
        load_workload(bad)
    bad.write_text("{")
    with pytest.raises(WorkloadError, match="not valid JSON"):
        load_workload(bad)


@pytest.mark.parametrize("with_system", [True, False])
def test_tools_in_system_is_the_prompt_agentd_renders_from_tools(tokenizer, with_system) -> None:
    """--tools-in-system: the tools as system text give the same prompt tokens as the tools field
    gives agentd (SmolLM2's template has no tools), and the caller's messages stay as they were."""
    from agentd.bench.wires import tools_as_text
    from agentd.chat import render_chat

    workload = load_workload(packaged_path("coding_agent"))
    messages = [{"role": "user", "content": workload.turns[0]}]
    if with_system:
        messages.insert(0, {"role": "system", "content": workload.system})
    before = json.dumps(messages)
    as_text = tools_as_text(messages, workload.tools)
    assert json.dumps(messages) == before
    assert as_text[0]["role"] == "system" and len(as_text) == len(messages) + (not with_system)
    assert (render_chat(tokenizer, as_text, None).prompt_token_ids
            == render_chat(tokenizer, messages, workload.tools).prompt_token_ids)
