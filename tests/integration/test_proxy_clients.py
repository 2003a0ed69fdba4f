"""Real agent clients through the real proxy: the official `openai` and `ollama` SDKs, `requests`
and `urllib`, each run as an agent is: a script in its own venv (tests/support/agents_venv.py)
with the env `proxy_env(...)` gives it, against the bundled mock backend, over HTTP and over
HTTPS through the fleettop CA. Then the demo's looping agent under the real supervisor, end to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import http.client
import ipaddress
import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from fleettop.supervisor.capabilities.proxy import proxy_env, write_ca_bundle
from tests.support.agents_venv import agents_python
from tests.support.processes import FLEETTOP, end_by_eof, needs_cgroups

PY = sys.executable
SECRET = "sk-proj-FLEETTOPtest0123456789abcdefXYZ"  # every client sends it; none may be stored
LIBS = ("openai", "ollama", "requests", "urllib")

# One agent turn with a real client library, run by the agents venv's python. What each speaks:
# openai → OpenAI chat (SSE), ollama → Ollama chat (NDJSON), requests → Anthropic messages (SSE),
# urllib → Ollama generate (NDJSON): the four cover the parsers too, not only the clients.
# Prints one JSON line: ok/text, or status/body for an HTTP error, or conn for a broken connection.
CLIENT = r'''
import json
import sys

args = json.loads(sys.argv[1])
lib, base, model, stream = args["lib"], args["base"], args["model"], args["stream"]
key, prompt = args["key"], args["prompt"]
messages = [{"role": "user", "content": prompt}]
partial = []
out = {"lib": lib}


def done(**kw):
    out.update(kw)
    out.setdefault("partial", "".join(partial))
    print(json.dumps(out), flush=True)
    sys.exit(0)


try:
    if lib == "openai":
        import openai
        client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=30)
        try:
            if stream:
                for ch in client.chat.completions.create(model=model, messages=messages,
                                                         stream=True):
                    if ch.choices and ch.choices[0].delta.content:
                        partial.append(ch.choices[0].delta.content)
                done(ok=True, text="".join(partial))
            resp = client.chat.completions.create(model=model, messages=messages)
            done(ok=True, text=resp.choices[0].message.content)
        except openai.APIStatusError as e:
            done(ok=False, status=e.status_code, error=type(e).__name__, body=e.response.text)
        except openai.APIConnectionError as e:
            done(ok=False, conn=True, error=type(e).__name__, detail=repr(e.__cause__ or e))
        except openai.APIError as e:  # an SSE `event: error` in the stream
            done(ok=False, error=type(e).__name__, body=json.dumps(e.body))
    elif lib == "ollama":
        import httpx
        import ollama
        client = ollama.Client(host=base, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        try:
            if stream:
                for part in client.chat(model=model, messages=messages, stream=True):
                    partial.append(part["message"]["content"])
                done(ok=True, text="".join(partial))
            done(ok=True, text=client.chat(model=model, messages=messages)["message"]["content"])
        except ollama.ResponseError as e:
            done(ok=False, status=e.status_code, error=type(e).__name__, body=str(e.error))
        except (httpx.TransportError, ConnectionError) as e:
            done(ok=False, conn=True, error=type(e).__name__, detail=repr(e))
    elif lib == "requests":
        import requests
        body = {"model": model, "max_tokens": 4096, "messages": messages, "stream": stream}
        headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
        try:
            with requests.post(base + "/v1/messages", json=body, headers=headers, stream=stream,
                               timeout=30) as r:
                if r.status_code >= 400:
                    done(ok=False, status=r.status_code, error="HTTPError", body=r.text)
                if not stream:
                    done(ok=True, text="".join(b["text"] for b in r.json()["content"]))
                out["raw"] = ""
                for line in r.iter_lines():
                    out["raw"] += line.decode() + "\n"
                    if line.startswith(b"data: "):
                        ev = json.loads(line[6:])
                        if ev.get("type") == "content_block_delta":
                            partial.append(ev["delta"]["text"])
                done(ok=True, text="".join(partial))
        except (requests.exceptions.ConnectionError, requests.exceptions.ChunkedEncodingError) as e:
            done(ok=False, conn=True, error=type(e).__name__, detail=repr(e))
    elif lib == "urllib":
        import http.client
        import urllib.error
        import urllib.request
        body = {"model": model, "prompt": prompt, "stream": stream}
        req = urllib.request.Request(base + "/api/generate", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json", "api-key": key})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                if not stream:
                    done(ok=True, text=json.loads(resp.read())["response"])
                out["raw"] = ""
                buf = b""
                # read1, not readline: http.client's readline() turns a chunked body cut
                # short into a clean EOF, read1() raises IncompleteRead as it should.
                while data := resp.read1(65536):
                    out["raw"] += data.decode()
                    *lines, buf = (buf + data).split(b"\n")
                    for line in lines:
                        partial.append(json.loads(line).get("response") or "")
                done(ok=True, text="".join(partial))
        except urllib.error.HTTPError as e:
            done(ok=False, status=e.code, error="HTTPError", body=e.read().decode())
        except (http.client.HTTPException, OSError) as e:
            done(ok=False, conn=True, error=type(e).__name__, detail=repr(e))
    else:
        done(ok=False, error=f"unknown lib {lib}")
except SystemExit:
    raise
except BaseException as e:  # anything else is a finding: report it, never hide it
    import traceback
    done(ok=False, error=type(e).__name__, unexpected=True, detail=traceback.format_exc()[-2000:])
'''


def _no_proxy_env() -> dict[str, str]:
    drop = ("http_proxy", "https_proxy", "all_proxy", "no_proxy", "ssl_cert_file",
            "requests_ca_bundle", "curl_ca_bundle", "pythonpath", "virtual_env")
    return {k: v for k, v in os.environ.items() if k.lower() not in drop}


def _direct(url: str, data: bytes | None = None) -> dict:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(urllib.request.Request(url, data=data), timeout=10) as resp:
        return json.loads(resp.read())


def _wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s: {what}")


# --- the backends --------------------------------------------------------------------------


class Mock:
    """`python -m fleettop.supervisor.demo.mock_llm --port 0`, as the demo fleet runs it."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [PY, "-m", "fleettop.supervisor.demo.mock_llm", "--port", "0", "--token-delay",
             "0.003"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env=_no_proxy_env())
        line = self.proc.stdout.readline()
        assert line.startswith("mock-llm listening on "), line
        self.url = line.split()[-1]

    def stats(self) -> dict:
        return _direct(f"{self.url}/mock/stats")["streams"]

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def make_tls(folder: Path) -> tuple[Path, Path, Path]:
    """A private CA and a leaf for 127.0.0.1/localhost signed by it: (ca.pem, cert, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.UTC)
    ca_key, leaf_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(
        ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fleettop test upstream CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(minutes=5))
          .not_valid_after(now + dt.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                       False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(leaf_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
                critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    paths = folder / "upstream-ca.pem", folder / "upstream-cert.pem", folder / "upstream-key.pem"
    paths[0].write_bytes(ca.public_bytes(pem))
    paths[1].write_bytes(leaf.public_bytes(pem))
    paths[2].write_bytes(leaf_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                serialization.NoEncryption()))
    return paths


class TlsMock:
    """The mock's app served over HTTPS (aiohttp + ssl) in a thread of this process."""

    def __init__(self, folder: Path) -> None:
        from aiohttp import web

        from fleettop.supervisor.demo.mock_llm import MockConfig, MockLLM

        self.ca, cert, key = make_tls(folder)
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(cert, key)
        self.mock = MockLLM(MockConfig(token_delay=0.003))
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        async def serve() -> None:
            self.runner = web.AppRunner(self.mock.app(), access_log=None)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0, ssl_context=ctx)
            await site.start()
            self.url = f"https://127.0.0.1:{self.runner.addresses[0][1]}"
            started.set()

        self.thread = threading.Thread(target=self._run, args=(serve,), daemon=True)
        self.thread.start()
        assert started.wait(10), "TLS mock did not start"

    def _run(self, serve) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(serve())
        self.loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# --- the proxy -----------------------------------------------------------------------------


class Proxy:
    """proxy_main as ProxyProcess runs it: JSON reports on stdout, commands on stdin."""

    def __init__(self, state: Path, upstream_ca: Path) -> None:
        self.state = state
        self.tokens: dict[str, str] = {}
        self.tokens_file = state / "tokens.json"
        self.tokens_file.write_text("{}")
        cfg = {"proxy": {"stats_interval": 0.5, "upstream_ca": str(upstream_ca)}}
        (state / "cfg.json").write_text(json.dumps(cfg))
        self.proc = subprocess.Popen(
            [PY, "-m", "fleettop.probes.proxy.main", "--state-dir", str(state), "--config",
             str(state / "cfg.json"), "--tokens", str(self.tokens_file)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=_no_proxy_env())
        self.lines: list[str] = []
        self.events: list[dict] = []
        self.stderr: list[str] = []
        # Both pipes are drained all the time: a full pipe would stall the proxy's event loop.
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr),
                         daemon=True).start()
        ready = self.wait("proxy.ready", timeout=30)
        self.port = ready["port"]
        self.ca = Path(ready["ca_cert"])
        self.bundle = write_ca_bundle(self.ca, state / "ca-bundle.pem")

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self.events.append(json.loads(line))

    def wait(self, kind: str, timeout: float = 10, since: int = 0, **match) -> dict:
        def find():
            for ev in self.events[since:]:
                if ev.get("event") == kind and all(ev.get(k) == v for k, v in match.items()):
                    return ev
            return None

        return _wait_for(find, timeout, f"{kind} {match}")

    def command(self, cmd: dict) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def dump(self, agent: str) -> dict:
        mark = len(self.events)
        self.command({"cmd": "dump", "agent": agent})
        return self.wait("proxy.dump", since=mark, agent=agent)

    def release(self, agent: str) -> None:
        mark = len(self.events)
        self.command({"cmd": "release", "agent": agent})
        self.wait("proxy.released", since=mark, agent=agent)

    def token(self, agent: str) -> str:
        if agent not in self.tokens:
            self.tokens[agent] = f"tok-{agent}-{os.urandom(8).hex()}"
            tmp = self.tokens_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.tokens))
            os.replace(tmp, self.tokens_file)
        return self.tokens[agent]

    def env(self, agent: str, creds: str = "valid") -> dict[str, str]:
        base = _no_proxy_env()
        env = {**base, **proxy_env(agent, self.token(agent), self.port, bundle=self.bundle,
                                   ca_cert=self.ca, base_env=base)}
        if creds != "valid":
            url = (f"http://127.0.0.1:{self.port}" if creds == "none"
                   else f"http://{agent}:not-the-token@127.0.0.1:{self.port}")
            for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
                env[k] = url
        return env

    def close(self) -> None:
        end_by_eof(self.proc, timeout=10)


@pytest.fixture(scope="module")
def agents_py() -> str:
    return agents_python()


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    mock = Mock()
    tls = TlsMock(tmp_path_factory.mktemp("tls"))
    yield mock, tls
    tls.close()
    mock.close()


@pytest.fixture(scope="module")
def mock(backends) -> Mock:
    return backends[0]


@pytest.fixture(scope="module")
def tls(backends) -> TlsMock:
    return backends[1]


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, tls):
    p = Proxy(tmp_path_factory.mktemp("proxy-state"), tls.ca)
    yield p
    p.close()


@pytest.fixture(scope="module")
def client_script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("agent") / "agent_turn.py"
    path.write_text(CLIENT)
    return path


@pytest.fixture
def turn(agents_py, client_script, proxy):
    """turn(agent, lib, base, model, stream=..., creds=..., env=...) → what the client saw."""

    def run(agent: str, lib: str, base: str, model: str = "demo-chat", stream: bool = True,
            creds: str = "valid", env: dict[str, str] | None = None,
            prompt: str = "Tell me about agents.") -> dict:
        args = {"lib": lib, "base": base, "model": model, "stream": stream, "key": SECRET,
                "prompt": prompt}
        got = subprocess.run([agents_py, str(client_script), json.dumps(args)],
                             env=env or proxy.env(agent, creds), capture_output=True, text=True,
                             timeout=60, stdin=subprocess.DEVNULL)
        assert got.returncode == 0 and got.stdout.strip(), (got.stdout, got.stderr[-2000:])
        result = json.loads(got.stdout.strip().splitlines()[-1])
        assert not result.get("unexpected"), result["detail"]
        return result

    return run


def _chars(proxy: Proxy, agent: str) -> str:
    return proxy.dump(agent)["text"]


# --- plain HTTP ----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("lib", LIBS)
def test_client_turn_through_the_proxy(turn, proxy, mock, lib, stream):
    agent = f"turn-{lib}-{'s' if stream else 'w'}"
    got = turn(agent, lib, mock.url, stream=stream)
    assert got["ok"], got
    assert len(got["text"]) > 100
    dump = proxy.dump(agent)
    assert got["text"] in dump["text"]  # the addon read every token the client got
    assert dump["last_model"] == "demo-chat" and dump["tokens_out"] > 0
    assert dump["blocked"] is None and dump["trips"] == 0
    assert dump["recent_requests"] and dump["errors"] == 0


@pytest.mark.parametrize("creds", ["none", "wrong"])
@pytest.mark.parametrize("lib", LIBS)
def test_407_without_valid_credentials(turn, mock, lib, creds):
    before = _direct(f"{mock.url}/mock/stats")["total"]
    got = turn(f"auth-{lib}", lib, mock.url, stream=False, creds=creds)
    assert not got["ok"] and got.get("status") == 407, got
    assert _direct(f"{mock.url}/mock/stats")["total"] == before  # nothing reached upstream


ABORT_PARAMS = LIBS


@pytest.mark.parametrize("lib", ABORT_PARAMS)
def test_loop_aborted_client_sees_broken_stream_upstream_sees_close(turn, proxy, mock, lib):
    agent = f"abort-{lib}"
    aborted = mock.stats()["aborted"]
    mark = len(proxy.events)
    got = turn(agent, lib, mock.url, model="demo-loop", stream=True)
    assert not got["ok"], got
    # Raw readers see the breaker's error event then a cut connection; the openai SDK raises
    # on the `event: error` it reads first (an APIError naming fleettop_breaker).
    if lib == "openai":
        assert got.get("conn") or "fleettop_breaker" in got.get("body", ""), got
    elif lib == "ollama":  # the client raises its own ResponseError from the error line
        assert got.get("conn") or (got.get("error") == "ResponseError"
                                   and "fleettop_breaker" in json.dumps(got)), got
    else:
        assert got.get("conn"), got
        assert "fleettop_breaker" in got.get("raw", ""), got
    assert "check the configuration file again" in got["partial"]  # it did stream first
    trip = proxy.wait("breaker.trip", since=mark, agent=agent)
    assert trip["kind"] == "token_loop" and trip["policy"] == "freeze"
    _wait_for(lambda: mock.stats()["aborted"] > aborted, 10, "upstream saw the stream closed")
    assert Path(trip["incident"], "event.json").exists()


@pytest.mark.parametrize("lib", LIBS)
def test_429_while_blocked_then_success_after_release(turn, proxy, mock, lib):
    agent = f"block-{lib}"
    mark = len(proxy.events)
    # Trip the agent with a looping stream (any client will do), then talk with `lib`.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler(
        {"http": proxy.env(agent)["HTTP_PROXY"]}))
    body = json.dumps({"model": "demo-loop", "stream": True,
                       "messages": [{"role": "user", "content": "go"}]}).encode()
    req = urllib.request.Request(f"{mock.url}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    with pytest.raises((OSError, http.client.HTTPException)), opener.open(req, timeout=10) as resp:
        while resp.read1(65536):
            pass
        raise AssertionError("the loop was not cut")
    proxy.wait("breaker.trip", since=mark, agent=agent)
    total = _direct(f"{mock.url}/mock/stats")["total"]
    for stream in (False, True):
        got = turn(agent, lib, mock.url, stream=stream)
        assert not got["ok"] and got.get("status") == 429, got
        assert "fleettop_blocked" in got["body"] and "resume" in got["body"], got
    assert _direct(f"{mock.url}/mock/stats")["total"] == total  # blocked at the proxy
    proxy.release(agent)
    got = turn(agent, lib, mock.url, stream=True)
    assert got["ok"] and len(got["text"]) > 100, got


# --- HTTPS through the fleettop CA ---------------------------------------------------------


@pytest.mark.parametrize("lib", LIBS)
def test_https_through_the_fleettop_ca(turn, proxy, tls, lib):
    agent = f"tls-{lib}"
    env = proxy.env(agent)
    assert env["SSL_CERT_FILE"] == env["REQUESTS_CA_BUNDLE"] == str(proxy.bundle)
    got = turn(agent, lib, tls.url, stream=True, env=env)
    assert got["ok"], got
    dump = proxy.dump(agent)
    assert got["text"] in dump["text"] and dump["tokens_out"] > 0  # the addon saw inside TLS
    assert dump["recent_requests"][-1]["url"].startswith("https://127.0.0.1:")


def test_https_without_the_fleettop_ca_is_refused(turn, proxy, tls):
    import certifi

    env = proxy.env("tls-untrusting")
    env["SSL_CERT_FILE"] = env["REQUESTS_CA_BUNDLE"] = certifi.where()  # the usual roots only
    got = turn("tls-untrusting", "urllib", tls.url, stream=False, env=env)
    assert not got["ok"] and got.get("conn"), got
    assert "CERTIFICATE_VERIFY_FAILED" in got["detail"], got


# --- redaction -----------------------------------------------------------------------------


def test_api_keys_never_reach_any_file_or_report(turn, proxy, mock, tls):
    # Keys in headers (all four clients) and in a prompt body, then a trip so that an incident
    # folder with the recent requests is written, then dumps of every agent.
    for lib in LIBS:
        got = turn(f"keys-{lib}", lib, mock.url, stream=False,
                   prompt=f"my key is {SECRET}, keep it safe")
        assert got["ok"], got
    mark = len(proxy.events)
    got = turn("keys-openai", "openai", tls.url, model="demo-loop", stream=True)
    assert not got["ok"], got
    trip = proxy.wait("breaker.trip", since=mark, agent="keys-openai")
    requests = Path(trip["incident"], "requests.jsonl").read_text()
    assert "[REDACTED]" in requests and "my key is" in requests
    for agent in sorted(proxy.tokens):
        proxy.dump(agent)
    files = [p for p in proxy.state.rglob("*") if p.is_file()]
    assert any(p.name == "requests.jsonl" for p in files)
    leaked = [str(p) for p in files if SECRET.encode() in p.read_bytes()]
    assert not leaked, f"API key stored in {leaked}"
    assert not [line for line in proxy.lines if SECRET in line]
    assert SECRET not in "".join(proxy.stderr)


# --- detection end to end under the real supervisor ----------------------------------------


@needs_cgroups
def test_demo_looper_is_tripped_and_frozen_by_the_supervisor(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fleettop = " ".join(FLEETTOP)
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(json.dumps({"version": 1, "name": "looptest", "agents": {
        "mock-llm": {"cmd": f"{fleettop} mock-llm --port {port} --token-delay 0.005",
                     "proxy": False, "ready": {"tcp": f"127.0.0.1:{port}"}},
        "looper": {"cmd": f"{fleettop} demo chat --interval 1 --loop-after 1",
                   "env": {"FLEETTOP_DEMO_LLM": f"http://127.0.0.1:{port}"},
                   "depends_on": ["mock-llm"]},
    }}))
    proc = subprocess.Popen([*FLEETTOP, "run", "--headless", str(fleet), "--events", "json",
                             "--no-telemetry"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_no_proxy_env())
    events: list[dict] = []

    def read() -> None:
        for line in proc.stdout:
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))

    threading.Thread(target=read, daemon=True).start()

    def find(kind: str):
        return next((e for e in events if e["kind"] == kind and e["agent"] == "looper"), None)

    try:
        trip = _wait_for(lambda: find("breaker.trip"), 45, "breaker.trip for looper")
        assert trip["data"]["trip_kind"] == "token_loop", trip
        assert trip["data"]["evidence"]["repeating_span"]
        frozen = _wait_for(lambda: find("agent.frozen"), 10, "agent.frozen for looper")
        assert frozen["data"]["source"] == "breaker" and "token_loop" in frozen["reason"], frozen
        status = subprocess.run([*FLEETTOP, "ctl", "-f", str(fleet), "status", "--json"],
                                capture_output=True, text=True, timeout=30)
        looper = next(a for a in json.loads(status.stdout)["agents"] if a["name"] == "looper")
        assert looper["state"] == "frozen", looper
        assert looper["cgroup"], looper
        assert "frozen 1" in Path(looper["cgroup"], "cgroup.events").read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
