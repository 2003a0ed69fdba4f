"""Cutting a client's stream short, and writing to it directly: through mitmproxy internals.

Pinned to mitmproxy 11.0.2 (probes/proxy/relay.py checks the version at start). Both reach
the proxyserver addon's connection handler for the flow's client connection and its
transport, which mitmproxy does not expose as an API:
- `close_client` resets the client's connection once what was written to it has left (a
  reset, not a FIN: see its docstring);
- `direct_writer` gives the client's StreamWriter when a chunk may go to it as is (plain TCP,
  HTTP/1.1), so the chunk callback writes it itself instead of mitmproxy's way back out.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import socket
import struct
from typing import Any

from mitmproxy import ctx, http

_SIOCOUTQNSD = 0x894B  # Linux: bytes in a socket's send queue not sent yet


def close_client(flow: http.HTTPFlow, final: bool = False, tries: int = 0) -> None:
    """Cut the client's connection with a reset once what we wrote to it has left.

    A reset, not a FIN: after a FIN, a body cut short under Content-Length reads as a
    clean end to some clients (http.client's read1()); a reset is a connection error to
    every client, and what reached it before (the error event) is still read first. With
    `final` (the body ended: mitmproxy writes its end of message right after) it cannot
    wait: a FIN then if bytes are still queued, so they are not thrown away."""
    server = ctx.master.addons.get("proxyserver")
    handler = server.connections.get(flow.client_conn.id) if server else None
    if handler is None:
        if flow.killable:  # already finished and gone: nothing left to cut
            flow.kill()
        return
    io = handler.transports.get(flow.client_conn)
    writer = getattr(io, "writer", None)
    transport = getattr(writer, "transport", None)
    if transport is None:
        handler.close_connection(flow.client_conn)
        return
    if transport.is_closing():
        return
    sock = transport.get_extra_info("socket")
    queued = transport.get_write_buffer_size() or unsent(sock)
    if queued and not final and tries < 20:
        asyncio.get_running_loop().call_later(0.005, close_client, flow, False,
                                              tries + 1)
        return
    if not queued and sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()  # no chunked terminator: the client sees a broken stream


def direct_writer(flow: http.HTTPFlow) -> asyncio.StreamWriter | None:
    """The client connection's writer, when a chunk may be written to it as is: plain TCP
    (no TLS to encrypt it: CONNECT clients go through mitmproxy's TLS layer) and HTTP/1.1 (no
    HTTP/2 framing). mitmproxy writes every command of an event as its layers yield it, so
    whatever it sent this client before our callback (the response head) is on the wire
    already; what it sends after (the end of the body) follows ours."""
    if flow.client_conn.tls or flow.request.http_version != "HTTP/1.1":
        return None
    server = ctx.master.addons.get("proxyserver")
    handler = server.connections.get(flow.client_conn.id) if server else None
    io = handler.transports.get(flow.client_conn) if handler is not None else None
    writer = getattr(io, "writer", None)
    return writer if type(writer) is asyncio.StreamWriter else None


def unsent(sock: Any) -> int:
    if sock is None:
        return 0
    try:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), _SIOCOUTQNSD,
                                                  b"\0\0\0\0"))[0])
    except OSError:
        return 0
