"""The real proxy in the path: proxy_main as a subprocess, a real upstream, real clients."""

from __future__ import annotations

import base64
import contextlib
import gzip
import http.client
import json
import os
import queue
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes import spawn_proxy

SECRET = "sk-ant-TESTSECRET0123456789abcdefXYZ"
TOKENS = {a: f"tok-{a}-0123456789" for a in
          ("plain", "looper", "legit", "retrier", "budgety", "secret", "gz", "odd")}
TABLE = "".join(f"| {i} | row{i} | {i * 7 % 13} | ok |\n" for i in range(150))
MALFORMED = b"data: {not json\n\n\x00\xff\xfe garbage\r\n\r\ndata: [1,2,3]\n\nno newline at end"


class Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[dict] = []
    closed: list[str] = []
    finished: dict[str, float] = {}

    def log_message(self, *args) -> None:
        pass

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _sse(self, pieces, pace: float = 0.0, tag: str = "") -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        try:
            for piece in pieces:
                event = {"model": "mock-1", "choices": [{"delta": {"content": piece}}]}
                self._chunk(b"data: " + json.dumps(event).encode() + b"\n\n")
                if pace:
                    time.sleep(pace)
            self._chunk(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
            Upstream.finished[tag] = time.monotonic()
        except (BrokenPipeError, ConnectionResetError):
            Upstream.closed.append(tag)

    def _json(self, obj, gz: bool = False) -> None:
        raw = json.dumps(obj).encode()
        if gz:
            raw = gzip.compress(raw)
        self.send_response(200)
        self.send_header("content-type", "application/json")
        if gz:
            self.send_header("content-encoding", "gzip")
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)
        Upstream.sent = raw

    def do_GET(self) -> None:
        Upstream.seen.append({"path": self.path, "headers": dict(self.headers)})
        self._json({"ok": True})

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        Upstream.seen.append({"path": self.path, "headers": dict(self.headers),
                              "body": body.decode("utf-8", "replace")})
        prompt = json.loads(body)["messages"][-1]["content"]
        if prompt == "SLOW":
            self._sse([f"tok{i} " for i in range(10)], pace=0.1, tag="slow")
        elif prompt == "LOOP":
            self._sse(["Let me think about the plan. "] * 5
                      + ["I will try the same thing again. "] * 3000, pace=0.002, tag="loop")
        elif prompt == "TABLE":
            self._sse([TABLE[i : i + 9] for i in range(0, len(TABLE), 9)], tag="table")
        elif prompt == "MALFORMED":
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("content-length", str(len(MALFORMED)))
            self.end_headers()
            self.wfile.write(MALFORMED)
        elif prompt == "GZIP":
            self._json({"model": "mock-gz", "choices": [{"message": {"content": "zipped"}}],
                        "usage": {"prompt_tokens": 12, "completion_tokens": 34}}, gz=True)
        else:
            self._json({"model": "mock-1", "choices": [{"message": {"content": "fine"}}],
                        "usage": {"prompt_tokens": 10, "completion_tokens": 20}})


@pytest.fixture(scope="module")
def upstream():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


class Proxy:
    def __init__(self, tmp: Path) -> None:
        self.state = tmp
        cfg = {"proxy": {"stats_interval": 0.2, "prices": {"mock-*": {"input": 1.0,
                                                                      "output": 2.0}}},
               "breaker": {"budget": {"window": "1h"}},
               "agents": {"budgety": {"budget": {"tokens": 40}}}}
        self.proc = spawn_proxy(tmp, TOKENS, cfg)
        self.events: queue.Queue[dict] = queue.Queue()
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        ready = self.wait("proxy.ready", timeout=20)
        self.port = ready["port"]
        self.ca = ready["ca_cert"]

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self.events.put(json.loads(line))

    def wait(self, kind: str, timeout: float = 5, **match) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                ev = self.events.get(timeout=deadline - time.monotonic())
            except queue.Empty:
                break
            if ev.get("event") == kind and all(ev.get(k) == v for k, v in match.items()):
                return ev
        raise AssertionError(f"no {kind} {match} within {timeout}s")

    def command(self, cmd: dict) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def opener(self, agent: str | None, token: str | None = None):
        if agent is None:
            proxy = f"http://127.0.0.1:{self.port}"
        else:
            proxy = f"http://{agent}:{token or TOKENS[agent]}@127.0.0.1:{self.port}"
        return urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy}))


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    p = Proxy(tmp_path_factory.mktemp("proxy"))
    yield p
    p.proc.stdin.close()
    try:
        p.proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        p.proc.kill()
        p.proc.wait()


def chat(upstream: str, prompt: str, stream: bool = True, headers: dict | None = None,
         extra: dict | None = None) -> urllib.request.Request:
    body = {"model": "mock-1", "stream": stream,
            "messages": [{"role": "user", "content": prompt}], **(extra or {})}
    return urllib.request.Request(f"{upstream}/v1/chat/completions",
                                  data=json.dumps(body).encode(), method="POST",
                                  headers={"content-type": "application/json", **(headers or {})})


def test_relays_chunk_by_chunk(proxy, upstream):
    with proxy.opener("plain").open(chat(upstream, "SLOW"), timeout=10) as resp:
        first = resp.readline()
        assert first.startswith(b"data: ")
        assert "slow" not in Upstream.finished  # the first byte came before the stream ended
        rest = resp.read()
    assert rest.endswith(b"data: [DONE]\n\n")
    # The upstream's thread marks the stream finished just after its last write, which the
    # proxy may already have relayed to us.
    deadline = time.monotonic() + 5
    while "slow" not in Upstream.finished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "slow" in Upstream.finished


def test_407_without_or_with_wrong_credentials(proxy, upstream):
    for opener in (proxy.opener(None), proxy.opener("plain", "wrong"),
                   proxy.opener("nobody", "x")):
        with pytest.raises(urllib.error.HTTPError) as err:
            opener.open(chat(upstream, "hi"), timeout=5)
        assert err.value.code == 407


def test_credentials_never_reach_upstream(proxy, upstream):
    Upstream.seen.clear()
    with proxy.opener("plain").open(chat(upstream, "hi", stream=False), timeout=5) as resp:
        assert json.loads(resp.read())["choices"][0]["message"]["content"] == "fine"
    dumped = json.dumps(Upstream.seen)
    assert "Proxy-Authorization" not in dumped and TOKENS["plain"] not in dumped
    assert base64.b64encode(f"plain:{TOKENS['plain']}".encode()).decode() not in dumped


def test_degenerate_stream_is_aborted_then_blocked_until_release(proxy, upstream):
    opener = proxy.opener("looper")
    got = b""
    broken = (http.client.IncompleteRead, urllib.error.URLError, OSError)
    with pytest.raises(broken) as err, opener.open(chat(upstream, "LOOP"), timeout=10) as resp:
        while chunk := resp.read1(65536):
            got += chunk
        raise AssertionError("stream ended cleanly")
    assert not isinstance(err.value, AssertionError)
    assert b"[DONE]" not in got and b"fleettop_breaker" in got  # error event, then the cut
    trip = proxy.wait("breaker.trip", agent="looper")
    assert trip["kind"] == "token_loop" and trip["policy"] == "freeze"
    ev = trip["evidence"]
    assert "try the same thing again" in ev["repeating_span"] and ev["tier"]
    assert trip["at_char"] < 1500 and Path(trip["incident"], "response.txt").exists()
    deadline = time.monotonic() + 5
    while "loop" not in Upstream.closed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "loop" in Upstream.closed and "loop" not in Upstream.finished  # upstream cut too
    with pytest.raises(urllib.error.HTTPError) as blocked:
        opener.open(chat(upstream, "hi", stream=False), timeout=5)
    assert blocked.value.code == 429
    body = json.loads(blocked.value.read())
    assert body["error"]["type"] == "fleettop_blocked" and "resume" in body["error"]["message"]
    assert proxy.wait("proxy.stats", agent="looper")["loop_score"] == 1.0  # the UI's Loop
    proxy.command({"cmd": "release", "agent": "looper"})
    proxy.wait("proxy.released", agent="looper")
    with opener.open(chat(upstream, "hi", stream=False), timeout=5) as resp:
        assert resp.status == 200


def test_legit_repetitive_stream_is_not_tripped(proxy, upstream):
    with proxy.opener("legit").open(chat(upstream, "TABLE"), timeout=10) as resp:
        body = resp.read()
    assert body.endswith(b"data: [DONE]\n\n")
    text = "".join(json.loads(line[6:])["choices"][0]["delta"]["content"]
                   for line in body.decode().split("\n\n") if line.startswith("data: {"))
    assert text == TABLE
    stats = proxy.wait("proxy.stats", agent="legit")
    assert stats["blocked"] is None and stats["trips"] == 0 and stats["loop_score"] < 1.0


def test_retry_loop_trips_across_requests(proxy, upstream):
    opener = proxy.opener("retrier")
    codes = []
    for i in range(8):
        req = chat(upstream, "please fix the failing build", stream=False,
                   extra={"metadata": {"attempt": i}})
        try:
            with opener.open(req, timeout=5) as resp:
                codes.append(resp.status)
        except urllib.error.HTTPError as e:
            codes.append(e.code)
    assert codes[:5] == [200] * 5 and codes[5:] == [429] * 3
    trip = proxy.wait("breaker.trip", agent="retrier")
    assert trip["kind"] == "retry_loop" and trip["at_request"] == 5
    assert len(trip["evidence"]["hits"]) >= 5


def test_token_budget(proxy, upstream):
    opener = proxy.opener("budgety")
    with opener.open(chat(upstream, "one", stream=False), timeout=5) as resp:
        assert resp.status == 200  # 30 tokens: under 40
    with opener.open(chat(upstream, "two", stream=False), timeout=5) as resp:
        resp.read()  # crossing the budget on this response blocks what follows
    trip = proxy.wait("breaker.trip", agent="budgety")
    assert trip["kind"] == "budget" and trip["evidence"]["budget"] == "tokens"
    with pytest.raises(urllib.error.HTTPError) as blocked:
        opener.open(chat(upstream, "three", stream=False), timeout=5)
    assert blocked.value.code == 429
    stats = proxy.wait("proxy.stats", agent="budgety")
    assert stats["tokens_in"] == 20 and stats["tokens_out"] == 40
    assert stats["cost"] == pytest.approx((20 * 1.0 + 40 * 2.0) / 1e6)
    assert stats["last_model"] == "mock-1"


def test_secrets_are_never_stored_or_reported(proxy, upstream):
    opener = proxy.opener("secret")
    req = chat(upstream, f"my key is {SECRET}", stream=False,
               headers={"Authorization": f"Bearer {SECRET}", "x-api-key": SECRET},
               extra={"api_key": SECRET})
    with opener.open(req, timeout=5) as resp:
        resp.read()
    assert any(SECRET in json.dumps(s) for s in Upstream.seen)  # upstream still gets it
    proxy.command({"cmd": "dump", "agent": "secret"})
    dump = proxy.wait("proxy.dump", agent="secret")
    headers = {k.lower(): v for k, v in dump["recent_requests"][0]["headers"].items()}
    assert headers["authorization"] == headers["x-api-key"] == "[REDACTED]"
    with opener.open(chat(upstream, "LOOP"), timeout=10) as resp, contextlib.suppress(
            http.client.IncompleteRead, OSError):
        resp.read()
    trip = proxy.wait("breaker.trip", agent="secret")
    for _ in range(200):  # the files follow the report (event.json is written last)
        if Path(trip["incident"], "event.json").exists():
            break
        time.sleep(0.01)
    files = list(Path(trip["incident"]).iterdir())
    assert {f.name for f in files} >= {"event.json", "response.txt", "requests.jsonl"}
    for f in files:
        assert SECRET not in f.read_text()
    assert not any(SECRET in line for line in proxy.lines)
    assert TOKENS["secret"] not in "".join(proxy.lines)


def test_malformed_traffic_passes_untouched(proxy, upstream):
    with proxy.opener("odd").open(chat(upstream, "MALFORMED"), timeout=5) as resp:
        assert resp.read() == MALFORMED
    with proxy.opener("odd").open(f"{upstream}/not/an/llm/path", timeout=5) as resp:
        assert json.loads(resp.read()) == {"ok": True}
    stats = proxy.wait("proxy.stats", agent="odd")
    assert stats["passthrough"] >= 1 and stats["blocked"] is None


def test_gzip_bodies_are_relayed_as_sent_and_counted(proxy, upstream):
    with proxy.opener("gz").open(chat(upstream, "GZIP", stream=False), timeout=5) as resp:
        assert resp.headers["content-encoding"] == "gzip"
        raw = resp.read()
    assert raw == Upstream.sent
    assert json.loads(gzip.decompress(raw))["choices"][0]["message"]["content"] == "zipped"
    stats = proxy.wait("proxy.stats", agent="gz")
    assert (stats["tokens_in"], stats["tokens_out"], stats["last_model"]) == (12, 34, "mock-gz")


def test_ca_key_is_private(proxy):
    key = Path(proxy.ca).parent / "mitmproxy-ca.pem"
    assert os.stat(key).st_mode & 0o077 == 0


class FakeSupervisor:
    """The Supervisor surface that ProxyBreaker uses."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str | None, dict]] = []
        self.frozen: list[tuple[str, str, str, dict]] = []
        self.agents = {"looper2": object()}

    def emit(self, kind, agent=None, reason="", **data):
        self.events.append((kind, agent, {"reason": reason, **data}))

    async def freeze_agent(self, name, reason, source="user", evidence=None):
        self.frozen.append((name, reason, source, evidence or {}))

    async def stop_agent(self, name):
        pass


async def test_proxy_link_env_freeze_and_release(tmp_path, upstream):
    import asyncio
    from types import SimpleNamespace

    from fleettop.probes.proxy.config import ProxyConfig
    from fleettop.supervisor.capabilities.proxy import ProxyBreaker, proxy_env
    from fleettop.supervisor.config.proxy import ProxySection

    sup = FakeSupervisor()
    link = ProxyBreaker(sup, ProxyConfig(proxy=ProxySection(stats_interval=0.2)), tmp_path)
    await link.start()
    try:
        env = {"NO_PROXY": "localhost,127.0.0.1,example.com"}
        link.agent_env(SimpleNamespace(name="looper2", proxy=True), env)
        assert env["HTTP_PROXY"] == env["https_proxy"] and "@127.0.0.1:" in env["HTTP_PROXY"]
        assert env["NO_PROXY"] == "example.com"
        bundle = await asyncio.to_thread(Path(env["SSL_CERT_FILE"]).read_text)
        assert env["REQUESTS_CA_BUNDLE"] == env["CURL_CA_BUNDLE"] == env["SSL_CERT_FILE"]
        ca = await asyncio.to_thread(Path(env["NODE_EXTRA_CA_CERTS"]).read_text)
        assert ca.strip() in bundle
        assert bundle.count("BEGIN CERTIFICATE") > 50  # certifi's roots + ours
        assert os.stat(link.tokens_file).st_mode & 0o077 == 0
        opener = urllib.request.build_opener(urllib.request.ProxyHandler(
            {"http": env["HTTP_PROXY"]}))

        def loop_request() -> int:
            try:
                with opener.open(chat(upstream, "LOOP"), timeout=10) as resp:
                    resp.read()
                return 200
            except urllib.error.HTTPError as e:
                return e.code
            except (http.client.IncompleteRead, OSError):
                return -1

        assert await asyncio.to_thread(loop_request) == -1
        for _ in range(100):
            if sup.frozen:
                break
            await asyncio.sleep(0.05)
        assert sup.frozen, sup.events
        name, reason, source, evidence = sup.frozen[0]
        assert (name, source) == ("looper2", "breaker") and reason.startswith("token_loop")
        assert evidence["repeating_span"] and evidence["incident"]
        assert any(k == "breaker.trip" and a == "looper2" for k, a, _ in sup.events)
        assert await asyncio.to_thread(loop_request) == 429
        await link.before_resume("looper2")
        for _ in range(100):
            if any(k == "breaker.released" for k, _, _ in sup.events):
                break
            await asyncio.sleep(0.05)
        assert any(k == "breaker.released" for k, _, _ in sup.events)
        for _ in range(40):
            if link.agent_fields("looper2"):
                break
            await asyncio.sleep(0.05)
        assert link.agent_fields("looper2")["proxy"]["trips"] == 1
        assert link.component()["state"] == "running" and link.component()["port"] == link.port
    finally:
        await link.stop()
    assert proxy_env("a", "t", 1, base_env={})["NO_PROXY"] == ""


LOOP_AGENT = r"""
import json, os, sys, time, urllib.request, urllib.error
url = os.environ["LOOP_UPSTREAM"] + "/v1/chat/completions"
while True:
    body = json.dumps({"model": "m", "stream": True,
                       "messages": [{"role": "user", "content": "LOOP"}]}).encode()
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            for _ in resp:
                pass
        print("200", flush=True)
    except urllib.error.HTTPError as e:
        print(e.code, flush=True)
    except Exception:
        print("cut", flush=True)
    time.sleep(0.02)
"""


async def looping_fleet(tmp_path, upstream, name):
    """A real Supervisor with its ProxyBreaker running, and one agent that loops forever."""
    from fleettop.supervisor.capabilities.proxy import ProxyBreaker
    from fleettop.supervisor.config.load import parse_fleet
    from fleettop.supervisor.core.supervisor import Supervisor

    fleet = {"agents": {name: {"cmd": [sys.executable, "-c", LOOP_AGENT], "restart": "no",
                               "env": {"LOOP_UPSTREAM": upstream}}}}
    text = json.dumps(fleet)
    (tmp_path / "fleet.yaml").write_text(text)
    sup = Supervisor(parse_fleet(text, str(tmp_path / "fleet.yaml")))
    link = ProxyBreaker.for_fleet(sup)
    sup.add(link)
    await link.start()
    return sup, link


async def test_repeated_trip_freeze_resume_cycles_do_not_stall(tmp_path, upstream):
    """Regression (bench/proxy_trip.py stalled after ~10 cycles): a real agent through the
    real Supervisor + ProxyBreaker trips, is frozen and resumed again and again. Resuming waits
    for `agent.frozen` (the supervisor's freeze is complete), and every resume is accepted."""
    import asyncio

    sup, link = await looping_fleet(tmp_path, upstream, "cycler")
    events = sup.subscribe()
    await sup.start()
    try:
        for cycle in range(12):
            for want in ("breaker.trip", "agent.frozen"):
                while True:
                    ev = await asyncio.wait_for(events.get(), 15)
                    if ev.kind == want and ev.agent == "cycler":
                        break
            reply = await sup.resume_agent("cycler", reason="test")
            assert reply["ok"], (cycle, reply)
            while True:  # the proxy confirms the block is gone
                ev = await asyncio.wait_for(events.get(), 15)
                if ev.kind == "breaker.released" and ev.agent == "cycler":
                    break
        assert link.stats.get("cycler") is None or link.stats["cycler"]["trips"] >= 11
    finally:
        sup.unsubscribe(events)
        await sup.shutdown()
        await link.stop()


async def test_resume_with_a_lower_breaker_does_not_refreeze_at_once(tmp_path, upstream):
    """A looping agent resumed the plain way is frozen again within ~2 s. Resumed with
    `--breaker warn --for 10m`, its next loops are reported (policy warn) and it runs on;
    its row says so until then."""
    import asyncio

    from fleettop.supervisor.control.dispatch import dispatch

    sup, link = await looping_fleet(tmp_path, upstream, "looper")
    events = sup.subscribe(maxsize=0)
    await sup.start()
    try:
        async def next_event(kind: str) -> Any:
            while True:
                ev = await asyncio.wait_for(events.get(), 20)
                if ev.kind == kind and ev.agent == "looper":
                    return ev

        await next_event("agent.frozen")
        reply = await dispatch(sup, {"cmd": "resume", "name": "looper", "breaker": "warn",
                                     "for": "10m"})
        assert reply["ok"], reply
        for _ in range(2):  # it loops on: reported, not frozen
            trip = await next_event("breaker.trip")
            assert trip.data["policy"] == "warn", trip.data
        assert sup.agents["looper"].state.value == "running"
        row = next(a for a in sup.snapshot()["agents"] if a["name"] == "looper")
        assert row["breaker_relaxed"]["policy"] == "warn"
        bad = await dispatch(sup, {"cmd": "resume", "name": "looper", "breaker": "nap"})
        assert not bad["ok"] and "breaker must be one of" in bad["error"]
    finally:
        sup.unsubscribe(events)
        await sup.shutdown()
        await link.stop()


async def test_a_resume_lifts_the_block_once_before_the_thaw(tmp_path):
    """One `release` per resume, sent before the agent runs again (it once went twice: a
    resume hook and an `agent.resumed` follower)."""
    import asyncio

    from fleettop.supervisor.capabilities.proxy import ProxyBreaker
    from fleettop.supervisor.config.load import parse_fleet
    from fleettop.supervisor.core.supervisor import Supervisor

    text = json.dumps({"agents": {"sleeper": {"cmd": ["sleep", "60"], "restart": "no"}}})
    (tmp_path / "fleet.yaml").write_text(text)
    sup = Supervisor(parse_fleet(text, str(tmp_path / "fleet.yaml")), use_cgroups=False)
    link = ProxyBreaker.for_fleet(sup)
    sent: list[tuple[str, str]] = []
    link.send = lambda cmd: sent.append(  # type: ignore[method-assign]
        (cmd["cmd"], sup.agents["sleeper"].state.value))
    sup.add(link)
    await sup.start()
    try:
        assert (await sup.freeze_agent("sleeper", "test"))["ok"]
        sent.clear()
        assert (await sup.resume_agent("sleeper", "test"))["ok"]
        await asyncio.sleep(0)
        assert sent == [("release", "frozen")]
    finally:
        await sup.shutdown()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs a writable cgroup v2")
async def test_resume_during_an_unconfirmed_freeze_is_not_lost(tmp_path, monkeypatch):
    """The root cause of the proxy_trip stall: the kernel said `frozen 1`, the resume came
    before freeze_agent() had marked the agent FROZEN, was refused, and the agent stayed
    frozen. A resume sent then must end with the agent running."""
    import asyncio

    from fleettop.supervisor.config.load import parse_fleet
    from fleettop.supervisor.core import cgroups
    from fleettop.supervisor.core import freeze as freeze_path
    from fleettop.supervisor.core.supervisor import Supervisor

    text = json.dumps({"agents": {"sleeper": {"cmd": ["sleep", "60"], "restart": "no"}}})
    (tmp_path / "fleet.yaml").write_text(text)
    sup = Supervisor(parse_fleet(text, str(tmp_path / "fleet.yaml")))
    await sup.start()
    try:
        rt = sup.agents["sleeper"]
        for _ in range(200):
            if (rt.state.value == "running" and rt.cgroup is not None
                    and rt.pid in cgroups.procs(rt.cgroup)):
                break
            await asyncio.sleep(0.01)
        if rt.cgroup is None:
            pytest.skip("no cgroup for the agent")
        real, confirm = cgroups.freeze, freeze_path.await_frozen

        async def slow_confirm(sup, cg, want):  # a kernel slower than freeze()'s 2 ms wait
            await asyncio.sleep(0.01)
            return await confirm(sup, cg, want)

        monkeypatch.setattr(cgroups, "freeze", lambda cg, timeout=1.0: real(cg, 0) and False)
        monkeypatch.setattr(freeze_path, "await_frozen", slow_confirm)
        freezing = asyncio.create_task(sup.freeze_agent("sleeper", "test", source="breaker"))
        await asyncio.sleep(0)  # freeze_agent is now awaiting; the kernel has frozen it
        await sup.resume_agent("sleeper", reason="test")
        assert (await freezing)["ok"]
        await asyncio.sleep(0.05)
        assert sup.agents["sleeper"].state.value == "running"
        assert cgroups.read_events(rt.cgroup).get("frozen") == 0
    finally:
        await sup.shutdown()
