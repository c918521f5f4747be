"""``agentd.bench.record``: a client pointed at the recorder gets what the server sends, and each
exchange is written with its status and the usage and finish its reply reported, on every wire,
streamed or not (the coding-agent tests and the replay benchmark read these)."""

from __future__ import annotations

import gzip
import json

import httpx
import openai
import pytest

from agentd.bench.record import finish_of, read_records, recording


@pytest.fixture(scope="module")
def server(tiny_server) -> str:
    return tiny_server[0]


def test_every_wire_is_passed_on_and_recorded_with_its_usage(server, tmp_path) -> None:
    out = tmp_path / "s.jsonl"
    with recording(server, out, label="t") as (url, recorder):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        chat = client.chat.completions.create(
            model="m", max_tokens=5, temperature=0,
            messages=[{"role": "user", "content": "hello there"}])
        streamed = list(client.chat.completions.create(
            model="m", max_tokens=5, temperature=0, stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "hello there"}]))
        response = client.responses.create(model="m", input="hello there", max_output_tokens=5,
                                           temperature=0)
        with httpx.stream("POST", f"{url}/v1/messages", headers={"x-session-id": "abc"},
                          json={"model": "m", "max_tokens": 5, "stream": True,
                                "messages": [{"role": "user", "content": "hello there"}]}) as r:
            messages_text = r.read().decode()
        refused = httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": 3})
        head = httpx.head(url)
    assert refused.status_code == 400 and head.status_code == 200
    assert "event: message_stop" in messages_text
    records = read_records(out)
    assert records == recorder.records and len(records) == 6
    assert [r["status"] for r in records] == [200, 200, 200, 200, 400, 200]
    assert all(r["label"] == "t" for r in records)
    first, stream, resp, msg, bad, probe = records
    assert first["usage"] == {"prompt_tokens": chat.usage.prompt_tokens,
                              "cached_tokens": chat.usage.prompt_tokens_details.cached_tokens,
                              "output_tokens": chat.usage.completion_tokens}
    assert first["finish"] == chat.choices[0].finish_reason
    assert first["body"]["messages"][0]["content"] == "hello there"
    assert stream["usage"]["prompt_tokens"] == streamed[-1].usage.prompt_tokens
    cached = streamed[-1].usage.prompt_tokens_details.cached_tokens
    assert stream["usage"]["cached_tokens"] == cached > 0  # the first request's prompt
    assert resp["usage"]["output_tokens"] == response.usage.output_tokens
    assert resp["finish"] == response.status + (
        f":{response.incomplete_details.reason}" if response.incomplete_details else "")
    assert msg["headers"]["x-session-id"] == "abc" and msg["usage"]["output_tokens"] >= 1
    assert msg["finish"] in ("end_turn", "max_tokens")
    assert bad["usage"] is None and bad["reply"]["error"]["param"] == "messages"
    assert probe["method"] == "HEAD" and probe["path"] == "/"


def test_a_gzipped_recording_reads_back(tmp_path) -> None:
    path = tmp_path / "s.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"path": "/v1/chat/completions"}) + "\n\n")
    assert read_records(path) == [{"path": "/v1/chat/completions"}]


def test_finish_of_reads_every_wire_with_its_text_deltas() -> None:
    """A Responses stream's text deltas are strings, a Messages stream's are objects: a reply cut
    at its cap reads as cut on each (Codex's capped replies were recorded with no finish)."""
    responses = [{"type": "response.output_text.delta", "delta": "Hel"},
                 {"type": "response.incomplete", "response": {
                     "status": "incomplete",
                     "incomplete_details": {"reason": "max_output_tokens"}}}]
    assert finish_of(responses) == "incomplete:max_output_tokens"
    messages = [{"type": "message_start", "message": {"stop_reason": None}},
                {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "Hi"}},
                {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}}]
    assert finish_of(messages) == "max_tokens"
    chat = [{"choices": [{"delta": {"content": "Hi"}, "finish_reason": None}]},
            {"choices": [{"delta": {}, "finish_reason": "length"}]}]
    assert finish_of(chat) == "length"
