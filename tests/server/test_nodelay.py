"""The daemon's connections run with TCP_NODELAY.

agentd binds its listening socket itself (so a port in use fails before the model loads); sockets
accepted from it carry proto 0, and asyncio only sets TCP_NODELAY on transports whose socket
says IPPROTO_TCP. Without it, Nagle held each response body until the client's delayed ACK of
the headers: ~40 ms more on every request of a kept-alive connection (see serve.py)."""

from __future__ import annotations

import asyncio
import socket

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from agentd.cli._daemon import bind_listener
from agentd.server.serve import _NoDelayH11


async def _app(scope, receive, send) -> None:  # never called: no request is sent
    raise AssertionError("unexpected request")


def accepted_nodelay(protocol_class: type) -> int:
    """TCP_NODELAY on the server side of one connection to agentd's kind of listening socket."""
    config = uvicorn.Config(_app)
    config.load()
    listener = bind_listener("127.0.0.1", 0)  # exactly what `agentd start` does

    async def main() -> int:
        protocols = []

        def factory():
            protocols.append(protocol_class(config=config, server_state=ServerState(),
                                            app_state={}))
            return protocols[-1]

        server = await asyncio.get_running_loop().create_server(factory, sock=listener)
        _, writer = await asyncio.open_connection(*listener.getsockname()[:2])
        for _ in range(200):
            if protocols and protocols[0].transport is not None:
                break
            await asyncio.sleep(0.01)
        sock = protocols[0].transport.get_extra_info("socket")
        value = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        writer.close()
        server.close()
        await server.wait_closed()
        return value

    return asyncio.run(main())


def test_uvicorns_own_protocol_leaves_nagle_on_for_such_sockets() -> None:
    """The precondition: without agentd's protocol, nothing turns Nagle off."""
    assert accepted_nodelay(H11Protocol) == 0


def test_agentd_connections_have_tcp_nodelay() -> None:
    assert accepted_nodelay(_NoDelayH11) != 0
