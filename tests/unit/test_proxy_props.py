"""Property tests (hypothesis) for the proxy's stream path: random and malformed SSE, NDJSON,
JSON and compressed (gzip, deflate, br, zstd) byte streams, split at random chunk boundaries.

- Directly through `wire.ResponseParser` and the addon's real hooks (`request`,
  `responseheaders`, then the `flow.response.stream` callable it installs, chunk by chunk):
  nothing ever raises, the relay returns exactly the bytes it was given unless the breaker
  tripped, and the text parsed from a valid stream does not depend on where it was split.
- A smaller number through the real proxy process with a real upstream: the client receives
  exactly the bytes upstream sent whenever nothing tripped.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import http.client
import json
import os
import threading
import time
import urllib.error
import urllib.request
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import brotli
import pytest
import zstandard
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from mitmproxy import ctx
from mitmproxy.test import tflow, tutils

from fleettop.probes.proxy import wire
from fleettop.probes.proxy.breaker import FleettopProxy
from tests.support.processes import end_by_eof, spawn_proxy

FAST = settings(max_examples=120, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
REAL = settings(max_examples=40, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

PATHS = {"openai_chat": "/v1/chat/completions", "openai_completions": "/v1/completions",
         "openai_responses": "/v1/responses", "anthropic_messages": "/v1/messages",
         "ollama_chat": "/api/chat", "ollama_generate": "/api/generate"}
CTYPES = ["text/event-stream", "application/x-ndjson", "application/json",
          "application/json; charset=utf-8", "text/plain", "", "application/jsonl"]
ENCODINGS = ["identity", "gzip", "deflate", "deflate-raw", "br", "zstd"]


# --- building streams ----------------------------------------------------------------------


def encode(data: bytes, encoding: str) -> tuple[bytes, str | None]:
    """Compress as a server would; returns (body, content-encoding header)."""
    if encoding == "gzip":
        return gzip.compress(data), "gzip"
    if encoding == "deflate":
        return zlib.compress(data), "deflate"
    if encoding == "deflate-raw":  # what some servers send as "deflate"
        c = zlib.compressobj(wbits=-zlib.MAX_WBITS)
        return c.compress(data) + c.flush(), "deflate"
    if encoding == "br":
        return brotli.compress(data), "br"
    if encoding == "zstd":
        return zstandard.ZstdCompressor().compress(data), "zstd"
    return data, None


def frames(api: str, texts: list[str]) -> tuple[bytes, str]:
    """A well-formed streamed response for `api` carrying `texts` as deltas; (body, ctype)."""
    def sse(obj, event: str | None = None) -> bytes:
        head = f"event: {event}\n" if event else ""
        return f"{head}data: {json.dumps(obj)}\n\n".encode()

    out = b""
    if api == "openai_chat":
        for t in texts:
            out += sse({"model": "m", "choices": [{"index": 0, "delta": {"content": t}}]})
        out += sse({"model": "m", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": len(texts)}})
        return out + b"data: [DONE]\n\n", "text/event-stream"
    if api == "openai_completions":
        for t in texts:
            out += sse({"model": "m", "choices": [{"index": 0, "text": t}]})
        return out + b"data: [DONE]\n\n", "text/event-stream"
    if api == "openai_responses":
        for t in texts:
            out += sse({"type": "response.output_text.delta", "delta": t},
                       "response.output_text.delta")
        return out + sse({"type": "response.completed", "response": {"usage": {
            "input_tokens": 3, "output_tokens": len(texts)}}}, "response.completed"), \
            "text/event-stream"
    if api == "anthropic_messages":
        out += sse({"type": "message_start", "message": {"model": "m", "usage": {
            "input_tokens": 3, "output_tokens": 1}}}, "message_start")
        for t in texts:
            out += sse({"type": "content_block_delta", "index": 0,
                        "delta": {"type": "text_delta", "text": t}}, "content_block_delta")
        return out + sse({"type": "message_stop"}, "message_stop"), "text/event-stream"
    key = "message" if api == "ollama_chat" else "response"
    for t in texts:
        piece = {"role": "assistant", "content": t} if key == "message" else t
        out += (json.dumps({"model": "m", key: piece, "done": False}) + "\n").encode()
    out += (json.dumps({"model": "m", "done": True, "eval_count": len(texts)}) + "\n").encode()
    return out, "application/x-ndjson"


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:], strict=False) if b > a]


# Texts: mostly varied prose-like pieces, sometimes a phrase repeated (which may trip).
_piece = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=24)
_PHRASES = ["I will check the configuration file again. ", "Let me try that once more. ",
            "The answer is 42, the answer is ", "retry ", "- item\n", "| a | b |\n"]
_loop = st.builds(lambda head, p, n, size: [head, *[(p * n)[i:i + size]
                                                    for i in range(0, len(p) * n, size)]],
                  _piece, st.one_of(st.sampled_from(_PHRASES), st.text(min_size=4, max_size=40)),
                  st.integers(1, 80), st.integers(1, 16))
texts_st = st.one_of(st.lists(_piece, max_size=40), _loop)
cuts_st = st.lists(st.integers(0, 1 << 20), max_size=24)


@st.composite
def valid_stream(draw):
    api = draw(st.sampled_from(sorted(PATHS)))
    texts = draw(texts_st)
    body, ctype = frames(api, texts)
    enc = draw(st.sampled_from(ENCODINGS))
    raw, header = encode(body, enc)
    return api, texts, ctype, header, raw


@st.composite
def any_stream(draw):
    """Valid, corrupted, truncated or pure-noise bodies with any (even lying) headers."""
    api = draw(st.sampled_from(sorted(PATHS)))
    kind = draw(st.sampled_from(["valid", "noise", "corrupt", "truncate", "mixed"]))
    enc = draw(st.sampled_from(ENCODINGS))
    if kind == "noise":
        raw = draw(st.binary(max_size=2048))
        header = draw(st.sampled_from([None, "gzip", "deflate", "br", "zstd", "x-bogus"]))
        ctype = draw(st.sampled_from(CTYPES))
        return api, ctype, header, raw
    body, ctype = frames(api, draw(texts_st))
    if kind == "mixed":  # malformed lines between good ones
        junk = draw(st.lists(st.sampled_from([
            b"data: {not json\n\n", b"data: [1,2,3]\n\n", b"\x00\xff\xfe\r\n\r\n", b"data:\n\n",
            b"event: x\n", b"{\"choices\": 7}\n", b"data: {\"choices\": [null, 3]}\n\n",
            b"{\"message\": \"str\", \"done\": \"yes\"}\n", b": comment\n", b"\r\n" * 3,
            b"data: {\"type\": \"content_block_delta\", \"delta\": []}\n\n",
        ]), max_size=8))
        at = draw(st.integers(0, len(body)))
        body = body[:at] + b"".join(junk) + body[at:]
    raw, header = encode(body, enc)
    if kind == "corrupt" and raw:
        pos = draw(st.lists(st.integers(0, len(raw) - 1), min_size=1, max_size=6))
        b = bytearray(raw)
        for p in pos:
            b[p] ^= draw(st.integers(1, 255))
        raw = bytes(b)
    if kind == "truncate":
        raw = raw[: draw(st.integers(0, len(raw)))]
    if draw(st.booleans()):
        ctype = draw(st.sampled_from(CTYPES))  # a lying content type
    return api, ctype, header, raw


# --- the parsers directly ------------------------------------------------------------------


@FAST
@given(any_stream(), cuts_st)
def test_parser_never_raises(case, cuts):
    api, ctype, header, raw = case
    parser = wire.ResponseParser(api, ctype, header)
    got: list[str] = []
    for chunk in split(raw, cuts):
        got += parser.feed(chunk)
    got += parser.finish()
    assert all(isinstance(t, str) and t for t in got)
    assert parser.raw_bytes == len(raw)


@FAST
@given(valid_stream(), cuts_st)
def test_parsed_text_does_not_depend_on_chunk_splits(case, cuts):
    api, texts, ctype, header, raw = case
    whole = wire.ResponseParser(api, ctype, header)
    one = whole.feed(raw) + whole.finish()
    parser = wire.ResponseParser(api, ctype, header)
    got: list[str] = []
    for chunk in split(raw, cuts):
        got += parser.feed(chunk)
    got += parser.finish()
    assert got == one
    assert "".join(got) == "".join(texts)
    assert parser.malformed == 0 and parser.info.done


# --- the addon's hooks, no network ---------------------------------------------------------


@contextlib.contextmanager
def _no_proxyserver():
    """`_close_client` asks ctx.master for the proxyserver addon; without one it kills the
    flow. Give the addon a master that has none (restored afterwards)."""
    had = hasattr(ctx, "master")
    old = getattr(ctx, "master", None)
    ctx.master = SimpleNamespace(addons=SimpleNamespace(get=lambda name: None))
    try:
        yield
    finally:
        if had:
            ctx.master = old
        else:
            del ctx.master


def _flow(api: str, ctype: str, header: str | None):
    body = json.dumps({"model": "m", "stream": True, "messages": [
        {"role": "user", "content": f"case {os.urandom(6).hex()}"}]}).encode()
    req = tutils.treq(method=b"POST", host="127.0.0.1", port=9, path=PATHS[api].encode(),
                      headers=((b"content-type", b"application/json"),
                               (b"content-length", str(len(body)).encode())), content=body)
    headers = [(b"content-type", ctype.encode())]
    if header:
        headers.append((b"content-encoding", header.encode()))
    resp = tutils.tresp(headers=tuple(headers), content=b"")
    flow = tflow.tflow(req=req)
    flow.metadata["fleettop_agent"] = "prop"  # what requestheaders sets after auth
    return flow, resp


_GOODBYES = (b'event: error\ndata: {"error": {"type": "fleettop_breaker"',
             b'{"error": {"type": "fleettop_breaker"',
             b'{"error": "fleettop_breaker')  # Ollama's own error-line shape


def _prefix_then_goodbye(relayed: bytes, raw: bytes) -> bool:
    for marker in _GOODBYES:
        at = relayed.rfind(marker)
        if at >= 0:
            return raw.startswith(relayed[:at])
    return raw.startswith(relayed)


def _relay(raw: bytes, cuts: list[int], api: str, ctype: str, header: str | None):
    """Run one response through the addon exactly as mitmproxy does; (relayed, reports)."""
    reports: list[dict] = []
    addon = FleettopProxy(report=reports.append)
    flow, resp = _flow(api, ctype, header)

    async def go() -> bytes:
        addon.request(flow)
        flow.response = resp
        addon.responseheaders(flow)
        stream = flow.response.stream
        assert callable(stream)
        out = b""
        for chunk in [*split(raw, cuts), b""]:
            got = stream(chunk)
            out += got if isinstance(got, bytes) else b"".join(got)
        await asyncio.sleep(0.03 if reports else 0)  # let a delayed close run
        return out

    with _no_proxyserver():
        relayed = asyncio.run(go())
    return relayed, reports, addon


@FAST
@given(any_stream(), cuts_st)
def test_addon_relays_exactly_what_upstream_sent_unless_it_trips(case, cuts):
    api, ctype, header, raw = case
    relayed, reports, addon = _relay(raw, cuts, api, ctype, header)
    trips = [r for r in reports if r.get("event") == "breaker.trip"]
    event("tripped" if trips else "relayed untouched")
    if not trips:
        assert relayed == raw
    else:  # cut after a prefix of what upstream sent, then at most the breaker's goodbye
        assert addon.agents["prop"].blocked is not None
        assert _prefix_then_goodbye(relayed, raw)
    assert addon.agents["prop"].active_streams == 0


@FAST
@given(valid_stream(), cuts_st)
def test_addon_reads_every_token_of_a_valid_stream(case, cuts):
    api, texts, ctype, header, raw = case
    relayed, reports, addon = _relay(raw, cuts, api, ctype, header)
    tripped = any(r.get("event") == "breaker.trip" for r in reports)
    event("tripped" if tripped else "relayed untouched")
    if tripped:
        assert _prefix_then_goodbye(relayed, raw)
        return
    assert relayed == raw
    agent = addon.agents["prop"]
    assert agent.ring() == "".join(texts)  # well under the ring's size
    assert agent.text_total == len("".join(texts))
    assert agent.last_model == "m"


# --- through the real proxy ----------------------------------------------------------------


class Upstream(BaseHTTPRequestHandler):
    """Serves the case registered under the path's id, chunk by chunk as given."""

    protocol_version = "HTTP/1.1"
    cases: dict[str, tuple[str, str | None, list[bytes], bool]] = {}

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        case_id = self.path.split("/")[2]
        ctype, header, chunks, chunked = self.cases.pop(case_id)
        self.send_response(200)
        self.send_header("content-type", ctype)
        if header:
            self.send_header("content-encoding", header)
        if chunked:
            self.send_header("transfer-encoding", "chunked")
        else:
            self.send_header("content-length", str(sum(map(len, chunks))))
        self.end_headers()
        try:
            for chunk in chunks:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
                self.wfile.flush()
                if len(chunks) <= 8:
                    time.sleep(0.002)  # separate upstream reads, sometimes
            if chunked:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass


class RealProxy:
    def __init__(self, state) -> None:
        self.token = os.urandom(8).hex()
        # One agent sends every example: no retry-loop trips across examples.
        cfg = {"proxy": {"stats_interval": 30}, "agents": {"prop": {"retry": {"repeats": 1000}}}}
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        self.proc = spawn_proxy(state, {"prop": self.token}, cfg, env=env)
        self.events: list[dict] = []
        self.stderr: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        assert self._ready.wait(30), "proxy did not start"
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler(
            {"http": f"http://prop:{self.token}@127.0.0.1:{self.port}"}))

    def _read(self) -> None:
        for line in self.proc.stdout:
            ev = json.loads(line)
            self.events.append(ev)
            if ev.get("event") == "proxy.ready":
                self.port = ev["port"]
                self._ready.set()

    def wait(self, kind: str, since: int, timeout: float = 5) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for ev in self.events[since:]:
                if ev.get("event") == kind:
                    return ev
            time.sleep(0.01)
        raise AssertionError(f"no {kind} from the proxy")

    def sync(self) -> None:
        """Wait for the answer to a command sent now: what the proxy reported before it (a
        trip decided in a body's last callback, after the client had every byte) is in
        `events` by then."""
        mark = len(self.events)
        self.proc.stdin.write(json.dumps({"cmd": "stats"}) + "\n")
        self.proc.stdin.flush()
        self.wait("proxy.stats", mark)

    def release(self) -> None:
        mark = len(self.events)
        self.proc.stdin.write(json.dumps({"cmd": "release", "agent": "prop"}) + "\n")
        self.proc.stdin.flush()
        self.wait("proxy.released", mark)

    def close(self) -> None:
        end_by_eof(self.proc, timeout=10)


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proxy = RealProxy(tmp_path_factory.mktemp("props-proxy"))
    yield proxy, f"http://127.0.0.1:{server.server_address[1]}"
    proxy.close()
    server.shutdown()


@REAL
@given(any_stream(), cuts_st, st.booleans())
def test_real_proxy_relays_exact_bytes_unless_it_trips(real, case, cuts, chunked):
    proxy, upstream = real
    api, ctype, header, raw = case
    case_id = os.urandom(6).hex()
    Upstream.cases[case_id] = (ctype, header, split(raw, cuts), chunked)
    body = json.dumps({"model": "m", "stream": True,
                       "messages": [{"role": "user", "content": f"case {case_id}"}]}).encode()
    req = urllib.request.Request(f"{upstream}/case/{case_id}{PATHS[api]}", data=body,
                                 headers={"content-type": "application/json"})
    mark = len(proxy.events)
    got = b""
    try:
        with proxy.opener.open(req, timeout=10) as resp:
            assert resp.status == 200
            assert (resp.headers.get("content-encoding") or None) == header
            while data := resp.read1(65536):
                got += data
        broken = False
    except (http.client.HTTPException, OSError):
        broken = True
    proxy.sync()
    trips = [e for e in proxy.events[mark:] if e.get("event") == "breaker.trip"]
    event("tripped" if broken or trips else "relayed untouched")
    if not broken and not trips:
        assert got == raw
        return
    # Something differed: only a breaker trip may explain it.
    trip = proxy.wait("breaker.trip", mark)
    assert trip["agent"] == "prop" and trip["kind"] == "token_loop", trip
    proxy.release()


@pytest.mark.parametrize("chunked", [False, True])
def test_trip_in_the_last_chunk_still_breaks_the_stream(real, chunked):
    # The chunk that trips is upstream's last (one read, then the end; Content-Length or chunked):
    # mitmproxy calls the stream callable with b"" and would then end the message cleanly. The
    # client must get the breaker's error event and then a broken connection (a reset: after a
    # FIN, http.client's read1() takes a body cut short under Content-Length as complete),
    # and the delayed close must not kill the finished flow ('Unhandled error in task').
    proxy, upstream = real
    loop = ["Before answering, "] + ["I will check the configuration file again. "] * 40
    raw, ctype = frames("openai_chat", loop)
    case_id = os.urandom(6).hex()
    Upstream.cases[case_id] = (ctype, None, [raw], chunked)  # one read, then the end
    body = json.dumps({"model": "m", "stream": True,
                       "messages": [{"role": "user", "content": f"case {case_id}"}]}).encode()
    req = urllib.request.Request(f"{upstream}/case/{case_id}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    mark = len(proxy.events)
    got, broken = b"", False
    try:
        with proxy.opener.open(req, timeout=10) as resp:
            while data := resp.read1(65536):
                got += data
    except (http.client.HTTPException, OSError):
        broken = True
    proxy.wait("breaker.trip", mark)
    time.sleep(0.2)  # the delayed close has run by now
    proxy.release()
    unhandled = [line for line in proxy.stderr if "Unhandled error" in line]
    assert b"fleettop_breaker" in got, got[-300:]
    assert (broken, unhandled) == (True, []), "".join(proxy.stderr)[-2000:]


# --- redaction ------------------------------------------------------------------------------

_SECRETISH = ["sk-", "sk-ant-", "pk-live-", "rk-", "AIza", "hf_", "ghp_", "ghs_", "github_pat_",
              "xoxb-", "AKIA", "ASIA", "gsk_", "r8_", "eyJ", ".", "Bearer ", "basic  ", "TOKEN",
              "token=", "api_key: '", "apikey=\"", "API-KEY", "passwd:", "Password = ", "secret ",
              "https://", "user:pw@", "http://a:b@host/", "abcdefghijklmnop", "0123456789ABCDEF",
              "-", "_", " ", "\n", "\u0131", "\u017f", "\u212a", "\u0130", "\u00df", "tokeN"]


@FAST
@given(st.lists(st.one_of(st.sampled_from(_SECRETISH), st.text(max_size=6)), max_size=24))
def test_redact_text_is_the_four_substitutions_in_order(parts):
    # redact_text only tries each pattern where its leading literal occurs: same result.
    from fleettop.supervisor.detect import redact as r

    text = "".join(parts)
    want = r._KEY_SHAPES.sub(r.REDACTED, text)
    want = r._BEARER.sub(lambda m: f"{m.group(1)} {r.REDACTED}", want)
    want = r._URL_USERINFO.sub(lambda m: f"{m.group(1)}{r.REDACTED}@", want)
    want = r._ASSIGNMENT.sub(lambda m: m.group(1) + r.REDACTED, want)
    assert r.redact_text(text) == want
