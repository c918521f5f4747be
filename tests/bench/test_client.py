"""The bench client against a real HTTP server on 127.0.0.1 that drops a kept-alive connection
without answering (as llama-server's HTTP library does after its keep-alive timeout)."""

from __future__ import annotations

import asyncio
import json

from agentd.bench.client import BenchClient, BenchError
from agentd.bench.workload import Namespace

CHUNKS = [{"choices": [{"index": 0, "delta": {"content": "Hi"}}]},
          {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}]


def sse_reply() -> bytes:
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in CHUNKS) + "data: [DONE]\n\n"
    return (f"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            f"content-length: {len(body)}\r\n\r\n{body}").encode()


async def read_request(reader: asyncio.StreamReader) -> bool:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    await reader.readexactly(length)
    return True


async def serve_and_chat(drops: int) -> tuple[list[str], object]:
    """A server that, for its first ``drops`` requests, reads the request and closes the
    connection; then answers. Returns what happened per request and the client's result."""
    seen: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await read_request(reader):
                if len(seen) < drops:
                    seen.append("dropped")
                    break
                seen.append("answered")
                writer.write(sse_reply())
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = BenchClient(f"http://127.0.0.1:{port}", None)
    client.send_ignore_eos = False
    try:
        result: object = await client.chat("warm", "m", [{"role": "user", "content": "x"}], [],
                                           Namespace(), 4)
    except BenchError as exc:
        result = exc
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()
    return seen, result


def test_a_dropped_connection_is_sent_again_once() -> None:
    seen, result = asyncio.run(serve_and_chat(drops=1))
    assert seen == ["dropped", "answered"]
    assert not isinstance(result, BenchError)
    assert result.output_tokens == 1 and result.prompt_tokens == 5 and result.ttft_s is not None


def test_a_server_that_keeps_dropping_fails_the_run_with_its_phase() -> None:
    seen, result = asyncio.run(serve_and_chat(drops=5))
    assert seen == ["dropped", "dropped"]  # one retry, no more
    assert isinstance(result, BenchError)
    assert "warm request failed" in str(result)


def test_an_answering_server_is_asked_once() -> None:
    seen, result = asyncio.run(serve_and_chat(drops=0))
    assert seen == ["answered"] and not isinstance(result, BenchError)
