"""A stream sends its wire's keep-alive while nothing else comes (a long CPU prefill sends nothing
for minutes, and clients' idle timeouts are shorter): an SSE comment on the OpenAI wires,
Anthropic's ``ping`` event on Messages; the official SDKs read streams that carry them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import openai
import pytest

from agentd.server.app import ServerSettings, create_app
from agentd.server.wires.messages_plan import PING
from agentd.server.wires.serving import SSE_COMMENT, with_keepalive


async def slow(chunks: list[bytes], gap_s: float, closed: list[bool]) -> AsyncIterator[bytes]:
    try:
        for chunk in chunks:
            await asyncio.sleep(gap_s)
            yield chunk
    finally:
        closed.append(True)


def test_pings_fill_the_gaps_and_the_chunks_keep_their_order() -> None:
    async def main() -> list[bytes]:
        closed: list[bool] = []
        got = [c async for c in with_keepalive(slow([b"a", b"b"], 0.25, closed), b"P", 0.05)]
        assert closed == [True]
        return got

    got = asyncio.run(main())
    assert [c for c in got if c != b"P"] == [b"a", b"b"]
    assert got.index(b"a") >= 3 and got[-1] == b"b"  # pings came before the first chunk


def test_closing_the_stream_early_closes_its_source() -> None:
    """A client that hangs up mid-prefill: the source (the request's events) is closed, which
    aborts the request."""
    async def main() -> list[bool]:
        closed: list[bool] = []
        stream = with_keepalive(slow([b"a"], 10.0, closed), b"P", 0.01)
        assert await anext(stream) == b"P"
        await stream.aclose()
        return closed

    assert asyncio.run(main()) == [True]


@pytest.fixture(scope="module")
def url(tiny, serve) -> Iterator[str]:
    """A daemon whose streams ping after 1 ms of silence: every stream carries pings."""
    config, engine = tiny
    with serve(create_app(config, engine=engine,
                          settings=ServerSettings(keepalive_s=0.001))) as base_url:
        yield base_url


def test_the_sdks_read_streams_that_carry_keepalives(url: str) -> None:
    import httpx

    body: dict[str, Any] = {"model": "x", "max_tokens": 8, "stream": True, "temperature": 0,
                            "messages": [{"role": "user", "content": "Hi " * 200}]}
    with httpx.stream("POST", f"{url}/v1/messages", json=body, timeout=60) as raw:
        text = b"".join(raw.iter_bytes())
    assert b"event: message_stop" in text and text.count(b"event: ping") >= 1
    messages = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0)
    with messages.messages.stream(model="x", max_tokens=8, messages=body["messages"],
                                  extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert final.usage.output_tokens == 8
    chat = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
    chunks = list(chat.chat.completions.create(model="x", max_tokens=8, temperature=0,
                                               stream=True, messages=body["messages"]))
    assert sum(len(c.choices[0].delta.content or "") for c in chunks if c.choices) > 0
    assert PING.startswith(b"event: ping") and SSE_COMMENT.startswith(b":")
