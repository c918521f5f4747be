"""What the coding agents send on their defaults (recorded from Claude Code 2.1, Codex CLI 0.171
and opencode 1.18 against agentd) is accepted with the meaning that fits the served model, and
every field that changes nothing here is named in the reply's ``x-agentd-ignored`` header and
logged once at ``info``; malformed values are still 400s.

Each case is the shape a client really sent: thinking and effort on a model without a thinking
template, a system message in the middle of ``messages``, ``max_tokens`` far above the context,
reasoning summaries, namespace, custom and hosted tools, outputs without a ``call_id``.
"""

from __future__ import annotations

import gzip
import json
import logging
import re
from typing import Any

import msgspec
import pytest
import zstandard
from litestar.testing import TestClient

from agentd.server.ignored_fields import HEADER

CHAT, MESSAGES, RESPONSES = "/v1/chat/completions", "/v1/messages", "/v1/responses"
# Claude Code's own parse of Anthropic's error (strings of the 2.1.197 binary)
CLAUDE_TOO_LONG = re.compile(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)", re.I)
SHELL = {"type": "function", "name": "exec_command", "description": "Run a shell command.",
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                        "required": ["cmd"]}}
AGENTS = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
          "tools": [{"type": "function", "name": "spawn_agent", "description": "Spawn one.",
                     "parameters": {"type": "object", "properties": {
                         "task": {"type": "string"}}, "required": ["task"]}}]}
EXEC = {"type": "custom", "name": "exec", "description": "Run JavaScript.",
        "format": {"type": "text"}}


def ignored(response: Any) -> list[str]:
    return [f.strip() for f in response.headers.get(HEADER, "").split(",") if f.strip()]


def max_model_len(client: TestClient) -> int:
    return client.get("/v1/models").json()["data"][0]["max_model_len"]


def claude_body(**fields: Any) -> dict[str, Any]:
    """Claude Code's main request, shrunk: its fields as sent (model, 32000-token cap, adaptive
    thinking, effort, context_management, a system message after the first user turn)."""
    return {"model": "claude-opus-4-8", "max_tokens": 32000, "stream": False,
            "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015",
                                              "keep": "all"}]},
            "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "s"})},
            "system": [{"type": "text", "text": "You are Claude Code."},
                       {"type": "text", "text": "Be brief.",
                        "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>today</system-reminder>"},
                {"type": "text", "text": "List the files.",
                 "cache_control": {"type": "ephemeral"}}]},
                {"role": "system", "content": "Available agent types: general."}],
            "temperature": 0, **fields}


def test_claude_codes_main_request_is_answered_and_says_what_it_ignored(
        client: TestClient) -> None:
    response = client.post(f"{MESSAGES}?beta=true", json=claude_body(max_tokens=3),
                           headers={"anthropic-beta": "context-management-2025-06-27"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["type"] == "message" and body["stop_reason"] == "max_tokens"
    assert body["usage"]["output_tokens"] == 3
    assert set(ignored(response)) == {"model", "thinking", "output_config.effort",
                                      "context_management"}


def test_claude_codes_billing_line_is_left_out_so_its_prompts_share_the_cache(
        client: TestClient) -> None:
    """Claude Code (without CLAUDE_CODE_ATTRIBUTION_HEADER=0) opens its system prompt with a
    billing line whose hash changes with the prompt: kept, no two requests would share a block."""
    def ask(line: str) -> Any:
        body = claude_body(max_tokens=1)
        body["system"] = [{"type": "text", "text": line}, *body["system"]]
        return client.post(MESSAGES, json=body)

    first = ask("x-anthropic-billing-header: cc_version=2.1.197.363; cc_entrypoint=sdk-cli;")
    second = ask("x-anthropic-billing-header: cc_version=2.1.197.6e2; cc_entrypoint=sdk-cli;")
    assert first.status_code == second.status_code == 200, second.text
    assert "system.0" in ignored(second)
    usage = second.json()["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage[
        "cache_creation_input_tokens"]
    assert usage["cache_read_input_tokens"] >= prompt - 16  # all but the last partial block
    counted = client.post(f"{MESSAGES}/count_tokens", json={
        k: v for k, v in claude_body().items() if k in ("model", "system", "messages")})
    assert counted.json()["input_tokens"] == prompt  # the line is not in the prompt at all


def test_a_max_tokens_above_the_context_is_clamped_to_the_room_left(client: TestClient) -> None:
    """llama-server's and Ollama's rule: the reply runs to the end of the context and says so
    (stop_reason max_tokens), where a 400 once stopped Claude Code and opencode cold."""
    limit = max_model_len(client)

    def count(num_words: int) -> int:
        return client.post(f"{MESSAGES}/count_tokens", json={"model": "x", "messages": [
            {"role": "user", "content": words(num_words)}]}).json()["input_tokens"]

    low, high = 1, limit  # the most words whose prompt leaves at least 3 tokens of room
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if count(mid) <= limit - 3 else (low, mid - 1)
    left = limit - count(low)
    response = client.post(MESSAGES, json={"model": "x", "max_tokens": 32000, "temperature": 0,
                                           "messages": [{"role": "user", "content": words(low)}]})
    assert response.status_code == 200, response.text
    assert response.json()["stop_reason"] == "max_tokens"
    assert response.json()["usage"]["output_tokens"] == left
    assert "max_tokens" in ignored(response)


def words(num_words: int) -> str:
    return " ".join(f"w{i}" for i in range(num_words))


def test_a_prompt_over_the_context_is_an_error_in_each_wires_own_words(
        client: TestClient) -> None:
    limit = max_model_len(client)
    long_text = " ".join(f"w{i}" for i in range(2 * limit))
    anthropic = client.post(MESSAGES, json={"model": "x", "max_tokens": 10, "messages": [
        {"role": "user", "content": long_text}]})
    assert anthropic.status_code == 400
    error = anthropic.json()["error"]
    match = CLAUDE_TOO_LONG.search(error["message"])
    assert error["type"] == "invalid_request_error" and match, error
    assert int(match.group(1)) > limit and int(match.group(2)) == limit
    assert re.fullmatch(r"prompt is too long: \d+ tokens > \d+ maximum", error["message"])
    openai = client.post(CHAT, json={"model": "x", "messages": [
        {"role": "user", "content": long_text}]})
    assert openai.status_code == 400
    assert openai.json()["error"]["code"] == "context_length_exceeded"
    assert f"maximum context length is {limit} tokens" in openai.json()["error"]["message"]


def test_a_system_message_in_the_middle_stays_where_it_was_sent(tiny) -> None:
    """Rendered in place (this template takes system turns anywhere): the prefix before it
    stays the same from turn to turn, so the cache keeps serving it."""
    from agentd.server.wires.messages_plan import prompt_ids
    from agentd.server.wires.messages_types import MessagesRequest

    _, engine = tiny
    body = claude_body()
    conv, ids = prompt_ids(MessagesRequest(**body), engine)
    text = engine.tokenizer.decode(ids)
    assert text.index("List the files.") < text.index("Available agent types")
    assert [m["role"] for m in conv.messages] == ["system", "user", "system"]
    without = dict(body, messages=body["messages"][:1])
    _, head = prompt_ids(MessagesRequest(**without), engine)
    # everything up to the user's turn is the same tokens with or without the later system turn
    assert ids[:len(head) - 8] == head[:len(head) - 8]


def test_the_system_turn_is_folded_where_the_template_refuses_it(tiny, monkeypatch) -> None:
    """A template that takes system text at the top only (Mistral's raises otherwise): the
    later system text joins the first, in order, and the reply says so."""
    from agentd.server.wires import messages_plan
    from agentd.server.wires.messages_types import MessagesRequest

    _, engine = tiny
    real = messages_plan.render_ids

    def strict(tokenizer: Any, messages: Any, *args: Any, **kwargs: Any) -> list[int]:
        if any(m["role"] == "system" for m in messages[1:]):
            raise messages_plan.Invalid("the chat template rejected the messages: roles")
        return real(tokenizer, messages, *args, **kwargs)

    monkeypatch.setattr(messages_plan, "render_ids", strict)
    conv, ids = messages_plan.prompt_ids(MessagesRequest(**claude_body()), engine)
    assert [m["role"] for m in conv.messages] == ["system", "user"]
    texts = [p["text"] for p in conv.messages[0]["content"]]
    assert texts == ["You are Claude Code.", "Be brief.", "Available agent types: general."]
    assert [i.field for i in conv.ignored][-1] == "messages[].role"
    assert (0, 1, 300.0) in conv.breakpoints  # the cache mark stays on "Be brief."


@pytest.mark.parametrize("bad, param", [
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"thinking": {"type": "enabled", "budget_tokens": "lots"}}, "thinking.budget_tokens"),
    ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
    ({"max_tokens": 0.5}, "max_tokens"),
])
def test_leniency_is_for_no_ops_a_malformed_value_is_still_a_400(client: TestClient, bad: dict,
                                                                param: str) -> None:
    response = client.post(MESSAGES, json=claude_body(**bad))
    assert response.status_code == 400, response.text
    assert param.split(".")[0] in response.json()["error"]["message"]


def codex_body(**fields: Any) -> dict[str, Any]:
    """Codex's request with its model set (config.toml ``model``): reasoning summary, function,
    namespace, custom and hosted tools, no output cap."""
    return {"model": "gpt-6.2-sol", "stream": False, "tool_choice": "auto",
            "parallel_tool_calls": False, "store": False,
            "reasoning": {"effort": "low", "summary": "auto", "context": "all_turns"},
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "0190-session",
            "text": {"verbosity": "low"}, "client_metadata": {"x-codex-turn-metadata": "{}"},
            "tools": [SHELL, AGENTS, EXEC, {"type": "web_search", "external_web_access": False}],
            "input": [{"type": "message", "role": "developer", "content": [
                {"type": "input_text", "text": "You are a coding agent."}]},
                {"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": "List the files."}]}],
            "temperature": 0, "max_output_tokens": 4, **fields}


def test_codexs_request_is_answered_and_says_what_it_ignored(client: TestClient) -> None:
    response = client.post(RESPONSES, json=codex_body())
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
    assert body["reasoning"] == {"effort": "low", "summary": "auto"}
    names = set(ignored(response))
    assert {"model", "reasoning", "tools[3] (web_search)", "client_metadata"} <= names


def test_namespace_custom_and_hosted_tools_reach_the_prompt_as_function_tools(tiny) -> None:
    from agentd.server.wires.responses_plan import plan_responses
    from agentd.server.wires.responses_types import ResponsesRequest

    _, engine = tiny
    job = plan_responses(msgspec.convert(codex_body(), ResponsesRequest), engine, "m", 0,
                         None, keep=False)
    names = [t["function"]["name"] for t in job.tools.tool_set.tools]
    assert names == ["exec_command", "spawn_agent", "exec"]
    prompt = engine.tokenizer.decode(job.plan.prompt_token_ids)
    assert "spawn_agent" in prompt and "exec_command" in prompt and "web_search" not in prompt
    assert job.tools.origin("spawn_agent").namespace == "multi_agent_v1"
    assert job.tools.origin("exec").custom


@pytest.mark.parametrize("tool, item_type", [("spawn_agent", "function_call"),
                                             ("exec", "custom_tool_call")])
def test_a_call_is_mapped_back_to_the_clients_own_tool(client: TestClient, tool: str,
                                                       item_type: str) -> None:
    body = codex_body(tool_choice={"type": "function", "name": tool}, max_output_tokens=60,
                      tools=[SHELL, AGENTS, EXEC])
    for stream in (False, True):
        response = client.post(RESPONSES, json={**body, "stream": stream})
        assert response.status_code == 200, response.text
        if stream:
            events = [json.loads(line[6:]) for line in response.text.splitlines()
                      if line.startswith("data: ")]
            done = [e for e in events if e["type"] == "response.completed"]
            items = done[0]["response"]["output"] if done else [
                e["item"] for e in events if e["type"] == "response.output_item.done"]
        else:
            items = response.json()["output"]
        calls = [i for i in items if i["type"] in ("function_call", "custom_tool_call")]
        assert calls and calls[0]["type"] == item_type and calls[0]["name"] == tool
        if item_type == "function_call":
            assert calls[0]["namespace"] == "multi_agent_v1"
            assert "task" in json.loads(calls[0]["arguments"])
        else:
            assert isinstance(calls[0]["input"], str) and "namespace" not in calls[0]


def test_history_items_codex_sends_back_are_read(client: TestClient) -> None:
    """Its earlier calls (a namespaced function, a custom tool), their outputs, an output
    without a call_id (goal updates), reasoning items and our own compaction summary."""
    history = [
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "x"},
        {"type": "function_call", "call_id": "c1", "name": "spawn_agent",
         "namespace": "multi_agent_v1", "arguments": '{"task": "look"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "agent a1"},
        {"type": "custom_tool_call", "call_id": "c2", "name": "exec", "input": "ls()"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "a.py"},
        {"type": "function_call_output", "output": "goal updated"},
        {"type": "compaction", "id": "cmp_1", "encrypted_content": "We listed files."}]
    body = codex_body()
    body["input"] = body["input"] + history + [
        {"type": "message", "role": "user", "content": "And now?"}]
    response = client.post(RESPONSES, json=body)
    assert response.status_code == 200, response.text
    assert "input[] (reasoning)" in ignored(response)


def test_input_tokens_and_compact(client: TestClient) -> None:
    body = codex_body()
    counted = client.post(f"{RESPONSES}/input_tokens", json=body)
    assert counted.status_code == 200, counted.text
    assert counted.json()["object"] == "response.input_tokens"
    ran = client.post(RESPONSES, json=body).json()
    assert counted.json()["input_tokens"] == ran["usage"]["input_tokens"]
    compacted = client.post(f"{RESPONSES}/compact", json={**body, "max_output_tokens": 8})
    assert compacted.status_code == 200, compacted.text
    out = compacted.json()
    assert out["object"] == "response.compaction"
    assert [i.get("role") for i in out["output"][:-1]] == ["user"]  # the user's turns kept
    summary = out["output"][-1]
    assert summary["type"] == "compaction" and isinstance(summary["encrypted_content"], str)
    again = client.post(RESPONSES, json={**body, "input": out["output"]})
    assert again.status_code == 200, again.text  # the window replaces the conversation


def test_opencodes_request_is_answered(tiny, serve) -> None:
    """opencode sends max_tokens 32000 with a 7.7k-token prompt: clamped, not a 400. Over a
    real socket, read to the first chunk: hanging up aborts the rest (the tiny model would write
    to the end of its context)."""
    import httpx

    from agentd.server.app import create_app

    config, engine = tiny
    with serve(create_app(config, engine=engine)) as url, httpx.stream(
            "POST", url + CHAT, timeout=60, json={
                "model": "SmolLM2-135M-Instruct", "max_tokens": 32000, "stream": True,
                "stream_options": {"include_usage": True}, "tool_choice": "auto",
                "tools": [{"type": "function", "function": SHELL | {"type": None}}],
                "messages": [{"role": "system", "content": "You are opencode."},
                             {"role": "user", "content": '"List the files"'}],
                "temperature": 0}, headers={"x-session-id": "ses_1",
                                            "user-agent": "opencode/1.18"}) as response:
        assert response.status_code == 200
        assert "max_tokens" in ignored(response)
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["object"] == "chat.completion.chunk"


def test_ignored_fields_are_logged_once_per_client_and_field(client: TestClient,
                                                             caplog) -> None:
    caplog.set_level(logging.INFO, logger="agentd.server")
    for agent in ("claude-cli/2.1.197 (external, sdk-cli)", "claude-cli/2.1.197",
                  "other/1.0"):
        for _ in range(2):
            response = client.post(MESSAGES, json=claude_body(max_tokens=1),
                                   headers={"user-agent": agent})
            assert response.status_code == 200, response.text
    logged = [r.getMessage() for r in caplog.records if "ignoring the field 'thinking'" in
              r.getMessage()]
    assert len(logged) == 2 and any("from other/1.0" in m for m in logged)


def test_the_base_url_answers_the_probe_clients_send(client: TestClient) -> None:
    """Claude Code sends HEAD / before each session (a 404 once ended it)."""
    assert client.head("/").status_code == 200
    assert client.get("/").json()["server"] == "agentd"


@pytest.mark.parametrize("encoding", ["gzip", "zstd"])
def test_compressed_bodies_are_read_and_a_bomb_is_a_413(client: TestClient,
                                                        encoding: str) -> None:
    def pack(data: bytes) -> bytes:
        return gzip.compress(data) if encoding == "gzip" else zstandard.compress(data)

    body = json.dumps({"model": "x", "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}]}).encode()
    headers = {"content-type": "application/json", "content-encoding": encoding}
    response = client.post(CHAT, content=pack(body), headers=headers)
    assert response.status_code == 200, response.text
    bomb = pack(b'{"model": "' + b"a" * (64 * 2**20) + b'"}')  # 64 MiB in a few KiB
    assert len(bomb) < 2**20
    refused = client.post(CHAT, content=bomb, headers=headers)
    assert refused.status_code == 413 and "decompresses" in refused.json()["error"]["message"]
    corrupt = client.post(CHAT, content=b"\x1f\x8b" + b"no" * 10, headers=headers)
    assert corrupt.status_code in (400, 413)
    other = client.post(CHAT, content=body, headers={**headers, "content-encoding": "br"})
    assert other.status_code == 415


def test_a_clients_own_field_names_reach_the_header_escaped_and_bounded(
        client: TestClient) -> None:
    """An unknown field's name is the client's: it cannot break the header (non-Latin-1
    characters, a line break) nor grow it without bound."""
    body = {"prompt": "x", "max_tokens": 1}
    response = client.post("/v1/completions", json={**body, "żółw\r\nX-Evil: 1": 1})
    assert response.status_code == 200, response.text
    value = response.headers[HEADER]
    assert "X-Evil" not in response.headers and value.isascii() and "\n" not in value
    assert value == "\\u017c\\u00f3\\u0142w\\u000d\\u000aX-Evil: 1"
    many = client.post("/v1/completions", json={**body, **{f"x{i}": i for i in range(100)}})
    assert many.headers[HEADER].endswith("and 68 more") and len(many.headers[HEADER]) < 2000


def test_sessions_the_clients_name_group_the_stats(client: TestClient) -> None:
    """Each coding agent names its session in a header of its own; its requests are counted
    under ``client:id`` (``agentd stats --by-key``), a prompt_cache_key wins where sent."""
    sends = [("claude-cli/2.1.197 (external, sdk-cli)", {"x-claude-code-session-id": "s-1"},
              MESSAGES, claude_body(max_tokens=1)),
             ("codex_exec/0.171.0", {"session-id": "s-2", "thread-id": "s-2"}, RESPONSES,
              codex_body(max_output_tokens=1, prompt_cache_key=None)),
             ("opencode/1.18.33", {"x-session-id": "ses_3"}, CHAT,
              {"model": "x", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}),
             ("codex_exec/0.171.0", {"session-id": "s-2"}, RESPONSES,
              codex_body(max_output_tokens=1))]
    for agent, headers, path, body in sends:
        response = client.post(path, json=body, headers={"user-agent": agent, **headers})
        assert response.status_code == 200, response.text
    keys = {row["key"]: row for row in client.get("/v1/stats").json()["by_key"]}
    assert keys["claude-cli:s-1"]["requests"] == 1
    assert keys["codex_exec:s-2"]["requests"] == 1
    assert keys["0190-session"]["requests"] == 1  # its prompt_cache_key, as the client sent it
    assert keys["opencode:ses_3"]["requests"] == 1
