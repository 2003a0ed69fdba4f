"""Two changes to how mitmproxy 11.0.2 relays a body, made in fleettop's proxy process only.

- **One piece per read** (`merge_reads`): mitmproxy hands an HTTP/1 body on as one event per
  chunk of its chunked encoding (or per piece h11 gives back), and each event goes through its
  whole layer stack, the `stream` callable and a `send()` to the client of its own. When one
  read from the server brought many chunks (a fast upstream, or a proxy that fell behind), that
  is most of the proxy's time. `read_body` below hands on everything one read brought as one
  event: the same bytes in the same order, none later (they all arrived together), only
  re-chunked — chunk boundaries carry no meaning in HTTP/1.1, and mitmproxy re-chunks anyway.
  The end of the message, an error or the read's end hand the held data on first.
- **uvloop** (`event_loop`): libuv's event loop instead of asyncio's own; each read's wake-up,
  read and write cost less. mitmproxy runs on it unchanged (its `regular` and `reverse` modes,
  all fleettop uses).

Both are checked against the pinned version: another mitmproxy keeps its own `read_body`
(logged once). bench/proxy.py measures each against plain mitmproxy.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from typing import Any

log = logging.getLogger("fleettop.proxy")
PINNED = "11.0.2"
_original: Any = None


def merge_reads(enable: bool = True) -> bool:
    """Install (or with `enable=False` take back) the one-piece-per-read `read_body`.
    Returns whether it is in place."""
    global _original
    import h11
    from mitmproxy import version
    from mitmproxy.proxy import commands, events
    from mitmproxy.proxy.layers.http import _http1
    from mitmproxy.proxy.layers.http._base import ReceiveHttp

    cls = _http1.Http1Connection
    if not enable:
        if _original is not None:
            cls.read_body = _original  # type: ignore[method-assign]
            _original = None
        return False
    if _original is not None:
        return True
    if version.VERSION != PINNED:
        log.warning("fleettop proxy: mitmproxy %s is not %s; relaying chunk by chunk",
                    version.VERSION, PINNED)
        return False

    def read_body(self: Any, event: Any) -> Generator[Any, Any, None]:
        # mitmproxy 11.0.2's Http1Connection.read_body, with Data held until the read is done.
        assert self.stream_id is not None
        held: list[bytes] = []
        while True:
            try:
                if isinstance(event, events.DataReceived):
                    h11_event = self.body_reader(self.buf)
                elif isinstance(event, events.ConnectionClosed):
                    h11_event = self.body_reader.read_eof()
                else:
                    raise AssertionError(f"Unexpected event: {event}")
            except h11.ProtocolError as e:
                if held:
                    yield ReceiveHttp(self.ReceiveData(self.stream_id, b"".join(held)))
                yield commands.CloseConnection(self.conn)
                yield ReceiveHttp(self.ReceiveProtocolError(
                    self.stream_id, f"HTTP/1 protocol error: {e}"))
                return
            if isinstance(h11_event, h11.Data):
                data = bytes(h11_event.data)
                if data:
                    held.append(data)
                continue
            if held:
                yield ReceiveHttp(self.ReceiveData(
                    self.stream_id, held[0] if len(held) == 1 else b"".join(held)))
                held = []
            if h11_event is None:
                return
            if isinstance(h11_event, h11.EndOfMessage):
                assert self.request
                if h11_event.headers:
                    raise NotImplementedError("HTTP trailers are not implemented yet.")
                if self.request.data.method.upper() != b"CONNECT":
                    yield ReceiveHttp(self.ReceiveEndOfMessage(self.stream_id))
                is_request = isinstance(self, _http1.Http1Server)
                yield from self.mark_done(request=is_request, response=not is_request)
                return

    _original = cls.read_body
    cls.read_body = read_body  # type: ignore[method-assign]
    return True


def merge_reads_on() -> bool:
    return _original is not None


def new_event_loop(kind: str) -> Any:
    """An event loop of `kind` (`uvloop` or `asyncio`); `uvloop` falls back to asyncio's,
    with a warning, where uvloop can't be imported."""
    import asyncio

    if kind == "uvloop":
        try:
            import uvloop
        except ImportError:
            log.warning("fleettop proxy: uvloop is not installed; using asyncio's event loop")
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()
