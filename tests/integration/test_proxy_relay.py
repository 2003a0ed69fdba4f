"""How the proxy relays (probes/proxy/relay.py): what one upstream read brought goes on as one
piece, on uvloop; the same bytes either way. The real proxy process, a raw-socket upstream that
sends many chunks in one write, a raw-socket client that reads the chunk framing."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fleettop.probes.proxy import relay as proxy_relay
from tests.support.processes import spawn_proxy

TOKEN = "tok-relay-0123456789"
N = 300  # SSE events the upstream sends in one write


def _event(i: int) -> bytes:
    return b"data: " + json.dumps({"choices": [{"delta": {"content": f"word{i} "}}]}).encode() \
        + b"\n\n"


BODY = b"".join(_event(i) for i in range(N)) + b"data: [DONE]\n\n"


def _chunked(pieces: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)


class Upstream(threading.Thread):
    """Answers each request with N chunks in one sendall; `BAD` in the body: the good chunks,
    then a chunk size that isn't hex, in the same write."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]

    def run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def serve(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n")
                          if h.lower().startswith(b"content-length"))
            while len(body) < length:
                body += conn.recv(65536)
            pieces = [_event(i) for i in range(N)] + [b"data: [DONE]\n\n"]
            out = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                   b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")
            if b"BAD" in body:
                out += _chunked(pieces[:50]) + b"zz\r\nnot a chunk\r\n"
            else:
                out += _chunked(pieces) + b"0\r\n\r\n"
            conn.sendall(out)
            conn.shutdown(socket.SHUT_WR)
            while conn.recv(65536):
                pass


@pytest.fixture(scope="module")
def upstream():
    up = Upstream()
    up.start()
    yield up.port
    up.sock.close()


def _start(tmp: Path, relay: dict) -> tuple[subprocess.Popen, dict]:
    tmp.mkdir()
    proc = spawn_proxy(tmp, {"relay": TOKEN}, {"proxy": relay}, stderr=subprocess.DEVNULL)
    ready = json.loads(proc.stdout.readline())
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    return proc, ready


@pytest.fixture(scope="module", params=["shipped", "chunkwise"])
def proxy(request, tmp_path_factory):
    relay = {} if request.param == "shipped" else {"merge_reads": False,
                                                   "event_loop": "asyncio"}
    proc, ready = _start(tmp_path_factory.mktemp("relay") / request.param, relay)
    yield request.param, ready
    proc.stdin.close()
    proc.wait(timeout=10)


def _fetch(port: int, up: int, prompt: str) -> tuple[int, bytes, bytes]:
    """POST through the proxy; returns (chunk frames, de-chunked body, raw bytes after the
    headers) — the raw read goes to the connection's end, clean or not."""
    body = json.dumps({"model": "m", "stream": True,
                       "messages": [{"role": "user", "content": prompt}]}).encode()
    auth = base64.b64encode(f"relay:{TOKEN}".encode()).decode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"POST http://127.0.0.1:{up}/v1/chat/completions HTTP/1.1\r\n"
                  f"host: 127.0.0.1:{up}\r\nproxy-authorization: Basic {auth}\r\n"
                  f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
                  f"connection: close\r\n\r\n".encode() + body)
        raw = b""
        try:
            while data := s.recv(65536):
                raw += data
        except ConnectionResetError:
            pass
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    frames, out, pos = 0, b"", 0
    while True:
        eol = rest.find(b"\r\n", pos)
        if eol < 0:
            break
        size = int(rest[pos:eol], 16)
        if size == 0:
            break
        out += rest[eol + 2 : eol + 2 + size]
        frames += 1
        pos = eol + 2 + size + 2
    return frames, out, rest


def test_ready_says_how_it_relays(proxy):
    kind, ready = proxy
    if kind == "shipped":
        assert (ready["event_loop"], ready["merge_reads"]) == ("uvloop", True)
    else:
        assert (ready["event_loop"], ready["merge_reads"]) == ("asyncio", False)


def test_many_chunks_in_one_read_arrive_as_sent(proxy, upstream):
    kind, ready = proxy
    frames, body, raw = _fetch(ready["port"], upstream, "hello")
    assert body == BODY  # the same bytes, in order, whatever the framing
    assert raw.endswith(b"0\r\n\r\n")  # a clean end of message
    if kind == "shipped":
        # One piece per read: the 301 chunks came in a few reads, not one frame each.
        assert frames < N // 10, frames
    else:
        assert frames == N + 1  # mitmproxy's own: a frame per upstream chunk


def test_good_chunks_before_a_protocol_error_still_reach_the_client(proxy, upstream):
    kind, ready = proxy
    frames, body, raw = _fetch(ready["port"], upstream, "BAD")
    good = b"".join(_event(i) for i in range(50))
    assert body == good
    assert not raw.endswith(b"0\r\n\r\n")  # the broken body does not end cleanly


def test_merge_reads_checks_the_pinned_version(monkeypatch, caplog):
    from mitmproxy import version
    from mitmproxy.proxy.layers.http import _http1

    shipped = _http1.Http1Connection.read_body
    assert proxy_relay.merge_reads(False) is False  # not in place in the test process
    monkeypatch.setattr(version, "VERSION", "99.0.0")
    with caplog.at_level(logging.WARNING, logger="fleettop.proxy"):
        assert proxy_relay.merge_reads() is False
    assert "99.0.0 is not 11.0.2" in caplog.text
    assert _http1.Http1Connection.read_body is shipped
    monkeypatch.setattr(version, "VERSION", proxy_relay.PINNED)
    try:
        assert proxy_relay.merge_reads() is True and proxy_relay.merge_reads_on()
        assert _http1.Http1Connection.read_body is not shipped
        assert proxy_relay.merge_reads() is True  # installing twice is a no-op
    finally:
        proxy_relay.merge_reads(False)
    assert _http1.Http1Connection.read_body is shipped and not proxy_relay.merge_reads_on()


def test_event_loop_falls_back_to_asyncio_without_uvloop(monkeypatch, caplog):
    loop = proxy_relay.new_event_loop("uvloop")
    assert type(loop).__module__.startswith("uvloop")
    loop.close()
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` now fails
    with caplog.at_level(logging.WARNING, logger="fleettop.proxy"):
        loop = proxy_relay.new_event_loop("uvloop")
    assert isinstance(loop, asyncio.BaseEventLoop) and "uvloop is not installed" in caplog.text
    loop.close()


@pytest.fixture
def client_socket(monkeypatch):
    """A plain-TCP HTTP/1.1 client connection as mitmproxy's handler holds it: a real
    StreamWriter over a socket pair; yields (make_flow, peer socket)."""
    from types import SimpleNamespace

    from mitmproxy import ctx
    from mitmproxy.test import tflow, tutils

    mine, peer = socket.socketpair()
    state: dict = {}

    def make_flow(tls: bool = False, sized: bool = False):
        body = json.dumps({"model": "m", "stream": True,
                           "messages": [{"role": "user", "content": "hi"}]}).encode()
        req = tutils.treq(method=b"POST", host="127.0.0.1", port=9,
                          path=b"/v1/chat/completions", content=body,
                          headers=((b"content-type", b"application/json"),
                                   (b"content-length", str(len(body)).encode())))
        flow = tflow.tflow(req=req)
        flow.client_conn.tls = tls
        flow.metadata["fleettop_agent"] = "relay"
        head = [(b"content-type", b"text/event-stream")]
        head.append((b"content-length", b"100000") if sized
                    else (b"transfer-encoding", b"chunked"))
        handler = SimpleNamespace(transports={flow.client_conn: SimpleNamespace(
            writer=state["writer"])})
        state["connections"][flow.client_conn.id] = handler
        return flow, tutils.tresp(headers=tuple(head), content=b"")

    async def setup():
        _, state["writer"] = await asyncio.open_connection(sock=mine)
        state["connections"] = {}
        server = SimpleNamespace(connections=state["connections"])
        monkeypatch.setattr(ctx, "master", SimpleNamespace(addons=SimpleNamespace(
            get=lambda name: server if name == "proxyserver" else None)), raising=False)

    yield make_flow, peer, setup
    peer.close()


async def test_direct_writes_send_a_plain_http1_clients_chunks_themselves(client_socket):
    from fleettop.probes.proxy.breaker import FleettopProxy

    make_flow, peer, setup = client_socket
    await setup()
    peer.settimeout(5)
    addon = FleettopProxy()
    for tls, sized, direct in ((False, False, True), (True, False, False),
                               (False, True, False)):
        flow, resp = make_flow(tls=tls, sized=sized)
        addon.request(flow)
        flow.response = resp
        addon.responseheaders(flow)
        event = _event(1)
        big = b"".join(_event(i) for i in range(10))  # completes a 512-byte parse batch
        outs = [flow.response.stream(event), flow.response.stream(big)]
        outs = [o if isinstance(o, (bytes, list)) else b"".join(o) for o in outs]
        if direct:  # written by the callback, framed as mitmproxy's HTTP/1 layer would
            assert outs == [[], []]
            await asyncio.sleep(0)
            want = _chunked([event, big])
            got = b""
            while len(got) < len(want):
                got += peer.recv(65536)
            assert got == want
        else:  # TLS to encrypt, or Content-Length: mitmproxy's layers send them
            assert outs == [event, big]
    # Switched off: mitmproxy's layers send every chunk.
    addon.proxy = addon.proxy.model_copy(update={"direct_writes": False})
    flow, resp = make_flow()
    addon.request(flow)
    flow.response = resp
    addon.responseheaders(flow)
    assert flow.response.stream(_event(2)) == _event(2)
