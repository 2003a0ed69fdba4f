"""The GPU at the proxy, with the real proxy process and the bundled mock backend: requests to
a local-GPU server wait for the fleet's GPU lock (one at a time, batched by model), the router
rewrites `route:TASK`, the governor's caps shrink requests, and the watchdog's activity file is
kept. The mock's request log (`/mock/log`: start/end/model/limits per request, and the most
requests it served at once) is the upstream's own account of what reached it."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from fleettop.supervisor.gpu.lock import GpuLock
from tests.support.processes import end_by_eof, spawn_proxy

TOKENS = {"alice": "a" * 32, "bob": "b" * 32, "carol": "c" * 32, "excl": "e" * 32}


@pytest.fixture(scope="module")
def mock():
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleettop.supervisor.demo.mock_llm", "--port", "0",
         "--token-delay", "0.01", "--slow-delay", "0.08"], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    url = line.split()[-1].rstrip("/") if "http" in line else None
    assert url, f"mock did not start: {line!r}"
    yield url
    proc.terminate()
    proc.wait(timeout=5)
    proc.stdout.close()


def mock_get(mock: str, path: str) -> dict:
    with urllib.request.urlopen(mock + path, timeout=5) as r:
        return json.loads(r.read())


def mock_reset(mock: str) -> None:
    urllib.request.urlopen(urllib.request.Request(mock + "/mock/reset", method="POST"),
                           timeout=5).read()


class Proxy:
    """proxy_main with a `gpu` config; reports collected from its stdout."""

    def __init__(self, tmp: Path, gpu: dict) -> None:
        cfg = {"proxy": {"stats_interval": 0.2}, "gpu": {"stats_interval": 0.05, **gpu}}
        self.stderr = open(tmp / "proxy.stderr", "w")  # noqa: SIM115 (closed in close())
        self.proc = spawn_proxy(tmp, TOKENS, cfg, stderr=self.stderr)
        self.events: queue.Queue[dict] = queue.Queue()
        self.seen: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.port = self.wait("proxy.ready", timeout=30)["port"]

    def _read(self) -> None:
        for line in self.proc.stdout:
            ev = json.loads(line)
            self.seen.append(ev)
            self.events.put(ev)

    def wait(self, kind: str, timeout: float = 10, pred=None) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                ev = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if ev.get("event") == kind and (pred is None or pred(ev)):
                return ev
        raise AssertionError(f"no {kind} within {timeout}s; seen: "
                             f"{[e.get('event') for e in self.seen][-20:]}")

    def post(self, agent: str, url: str, body: dict, timeout: float = 30) -> tuple[int, dict]:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler(
            {"http": f"http://{agent}:{TOKENS[agent]}@127.0.0.1:{self.port}"}))
        req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json"})
        try:
            with opener.open(req, timeout=timeout) as r:
                raw = r.read()
                status = r.status
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        text = raw.decode()
        try:
            return status, json.loads(text)
        except ValueError:
            return status, {"stream": text}

    def get(self, agent: str, url: str) -> tuple[int, dict]:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler(
            {"http": f"http://{agent}:{TOKENS[agent]}@127.0.0.1:{self.port}"}))
        try:
            with opener.open(url, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def close(self) -> None:
        end_by_eof(self.proc, timeout=5)
        self.proc.stdout.close()
        self.stderr.close()


@pytest.fixture
def make_proxy(tmp_path):
    made: list[Proxy] = []

    def make(gpu: dict) -> Proxy:
        p = Proxy(tmp_path, gpu)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def chat(model: str, prompt: str = "hello", stream: bool = True, **extra) -> dict:
    return {"model": model, "stream": stream,
            "messages": [{"role": "user", "content": prompt}], **extra}


def in_threads(*calls) -> list:
    out: list = [None] * len(calls)

    def run(i, fn):
        out[i] = fn()

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def gpu_config(tmp_path: Path, mock: str, **over) -> dict:
    return {"lock_dir": str(tmp_path / "gpu"), "lock_timeout": 20, "batch_max_wait": 30,
            "backends": [mock], "activity": str(tmp_path / "activity.json"),
            "agents": {"alice": "shared", "bob": "shared", "carol": "shared",
                       "excl": "exclusive"}, **over}


def overlapped(log: list[dict]) -> bool:
    spans = sorted((e["start"], e["end"]) for e in log)
    return any(b[0] < a[1] for a, b in zip(spans, spans[1:], strict=False))


# --- the gate ----------------------------------------------------------------------------


def test_two_shared_agents_reach_a_local_gpu_one_at_a_time(make_proxy, mock, tmp_path):
    mock_reset(mock)
    proxy = make_proxy(gpu_config(tmp_path, mock))
    url = mock + "/v1/chat/completions"
    results = in_threads(*[lambda a=a: proxy.post(a, url, chat("demo-chat", f"story {a}"))
                           for a in ("alice", "bob", "alice", "bob")])
    assert [s for s, _ in results] == [200] * 4
    assert all("[DONE]" in r["stream"] for _, r in results)
    log = mock_get(mock, "/mock/log")["requests"]
    assert len(log) == 4
    assert mock_get(mock, "/mock/stats")["max_in_flight"] == 1
    assert not overlapped(log)


def test_without_the_gate_the_same_requests_overlap(make_proxy, mock, tmp_path):
    """The control for the test above: agents with `gpu: none` are not serialised."""
    mock_reset(mock)
    proxy = make_proxy(gpu_config(tmp_path, mock, agents={"alice": "none", "bob": "none"}))
    url = mock + "/v1/chat/completions"
    results = in_threads(*[lambda a=a: proxy.post(a, url, chat("demo-chat", f"story {a}"))
                           for a in ("alice", "bob")])
    assert [s for s, _ in results] == [200, 200]
    assert mock_get(mock, "/mock/stats")["max_in_flight"] == 2
    assert overlapped(mock_get(mock, "/mock/log")["requests"])


def test_queued_requests_for_the_loaded_model_go_first(make_proxy, mock, tmp_path):
    mock_reset(mock)
    proxy = make_proxy(gpu_config(tmp_path, mock))
    url = mock + "/v1/chat/completions"
    out: dict[str, tuple] = {}

    def send(agent: str, model: str, key: str) -> threading.Thread:
        def go() -> None:
            out[key] = proxy.post(agent, url, chat(model, f"prompt {key}"))

        t = threading.Thread(target=go)
        t.start()
        return t

    def queued(n: int):
        return lambda ev: ev.get("gate") and len(ev["gate"]["queue"]) == n

    # A (demo-slow, ~0.3 s a token) holds the GPU; B asks for another model, then C for A's.
    a = send("alice", "demo-slow", "A")
    proxy.wait("proxy.gpu", pred=lambda ev: ev.get("gate") and ev["gate"]["in_flight"] == 1)
    b = send("bob", "demo-chat", "B")
    proxy.wait("proxy.gpu", pred=queued(1))
    c = send("carol", "demo-slow", "C")
    proxy.wait("proxy.gpu", pred=queued(2))
    for t in (a, b, c):
        t.join(120)
    assert all(out[k][0] == 200 for k in "ABC"), out
    log = sorted(mock_get(mock, "/mock/log")["requests"], key=lambda e: e["start"])
    assert [e["model"] for e in log] == ["demo-slow", "demo-slow", "demo-chat"]
    assert not overlapped(log)


def test_a_request_waits_for_the_lock_and_times_out_cleanly(make_proxy, mock, tmp_path):
    mock_reset(mock)
    proxy = make_proxy(gpu_config(tmp_path, mock, lock_timeout=1.0))
    holder = GpuLock(tmp_path / "gpu", name="nightly-job")  # e.g. an exclusive agent
    holder.acquire()
    try:
        status, body = proxy.post("alice", mock + "/v1/chat/completions",
                                  chat("demo-chat", stream=False))
        assert status == 503
        assert body["error"]["type"] == "fleettop_gpu_busy"
        ev = proxy.wait("gpu.timeout")
        # It waited the whole timeout; the event loop may fire a timer up to its clock's
        # resolution (~1 ms) early, and `waited` is rounded to ms: 0.999 seen under load.
        assert ev["agent"] == "alice" and ev["waited"] >= 1.0 - 0.005
        assert mock_get(mock, "/mock/stats")["total"] == 0  # nothing reached the GPU
        # An exclusive agent already holds the lock for its whole run: never gated.
        status, _ = proxy.post("excl", mock + "/v1/chat/completions",
                               chat("demo-chat", stream=False))
        assert status == 200
    finally:
        holder.release()
    status, body = proxy.post("alice", mock + "/v1/chat/completions",
                              chat("demo-chat", stream=False))
    assert status == 200 and body["choices"][0]["message"]["content"]


def test_activity_file_tracks_requests_to_gpu_servers(make_proxy, mock, tmp_path):
    from fleettop.supervisor.gpu.evictor import model_key, read_activity

    mock_reset(mock)
    proxy = make_proxy(gpu_config(tmp_path, mock))
    key = model_key(mock, "demo-slow")
    t = threading.Thread(target=proxy.post, args=("alice", mock + "/api/chat",
                                                  chat("demo-slow")))
    t.start()
    proxy.wait("proxy.gpu", pred=lambda ev: ev.get("gate") and ev["gate"]["in_flight"] == 1)
    during = read_activity(tmp_path / "activity.json")
    t.join(60)
    after = read_activity(tmp_path / "activity.json")
    assert during[key].in_flight == 1
    assert after[key].in_flight == 0 and after[key].last_end >= after[key].last_start > 0


# --- governor caps -----------------------------------------------------------------------


def test_governor_caps_shrink_new_requests_to_local_servers(make_proxy, mock, tmp_path):
    mock_reset(mock)
    state = tmp_path / "governor.json"
    proxy = make_proxy(gpu_config(tmp_path, mock, governor_state=str(state)))
    url = mock + "/v1/chat/completions"
    assert proxy.post("alice", url, chat("demo-chat", stream=False, max_tokens=5000))[0] == 200
    state.write_text(json.dumps({"level": 2, "since": time.time(), "num_ctx_cap": 4096,
                                 "max_tokens_cap": 1024, "figures": {}, "pid": os.getpid()}))
    assert proxy.post("alice", url, chat("demo-chat", stream=False, max_tokens=5000))[0] == 200
    assert proxy.post("alice", mock + "/api/chat",
                      chat("demo-chat", stream=False, options={"num_ctx": 32768}))[0] == 200
    log = mock_get(mock, "/mock/log")["requests"]
    assert log[0]["limits"] == {"max_tokens": 5000}
    assert log[1]["limits"] == {"max_tokens": 1024}
    assert log[2]["limits"] == {"num_ctx": 4096, "num_predict": 1024}
    ev = proxy.wait("governor.shrunk")
    assert ev["agent"] == "alice" and ev["level"] == 2 and ev["changes"]["max_tokens"] == [5000,
                                                                                          1024]
    # A governor that died leaves no caps behind.
    state.write_text(json.dumps({"level": 2, "since": 0, "num_ctx_cap": 4096,
                                 "max_tokens_cap": 1024, "pid": 2**22 + 7}))
    assert proxy.post("alice", url, chat("demo-chat", stream=False, max_tokens=5000))[0] == 200
    assert mock_get(mock, "/mock/log")["requests"][3]["limits"] == {"max_tokens": 5000}


# --- router ------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def router_config(tmp_path: Path, mock: str, hardware: dict) -> dict:
    dead = f"http://127.0.0.1:{_free_port()}"
    return gpu_config(tmp_path, mock, hardware=hardware, models={
        "writer": {"backend": "ollama", "url": mock, "model": "demo-slow", "device": "gpu",
                   "vram": 5 * 2**30},
        "offline": {"backend": "openai", "url": dead + "/v1", "model": "demo-json",
                    "device": "cpu"},
        "tiny": {"backend": "openai", "url": mock + "/v1", "model": "demo-chat",
                 "device": "cpu"},
    }, routes={"write": {"use": ["writer", "offline", "tiny"]}})


@pytest.mark.parametrize(("hardware", "expected", "skipped"), [
    ({"gpu": False}, "demo-chat", {"writer": "needs a GPU; none here",
                                   "offline": "server down"}),
    ({"gpu": True, "vram_total": 8 * 2**30, "vram_free": 8 * 2**30}, "demo-slow", {}),
    ({"gpu": True, "vram_total": 8 * 2**30, "vram_free": 2**30}, "demo-chat",
     {"writer": "needs 5.0GiB of VRAM; 1.0GiB free now", "offline": "server down"}),
])
def test_route_task_picks_a_model_for_this_hardware(make_proxy, mock, tmp_path, hardware,
                                                    expected, skipped):
    mock_reset(mock)
    proxy = make_proxy(router_config(tmp_path, mock, hardware))
    # The agent's own URL is any server: the router replaces it with the chosen model's.
    status, body = proxy.post("alice", mock + "/v1/chat/completions",
                              chat("route:write", stream=False, max_tokens=8))
    assert status == 200, body
    assert [e["model"] for e in mock_get(mock, "/mock/log")["requests"]] == [expected]
    ev = proxy.wait("route.changed")
    assert ev["task"] == "write" and ev["model"] == expected
    verdicts = {v["candidate"]: v["verdict"] for v in ev["verdicts"]}
    assert {k: verdicts[k] for k in skipped} == skipped


def test_virtual_router_host_and_its_errors(make_proxy, mock, tmp_path):
    mock_reset(mock)
    proxy = make_proxy(router_config(tmp_path, mock, {"gpu": False}))
    status, body = proxy.post("alice", "http://router.fleettop/v1/chat/completions",
                              chat("write", stream=False))
    assert status == 200 and body["choices"][0]["message"]["content"]
    assert mock_get(mock, "/mock/log")["requests"][0]["model"] == "demo-chat"
    status, models = proxy.get("alice", "http://router.fleettop/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["write"]
    status, body = proxy.post("alice", "http://router.fleettop/v1/chat/completions",
                              chat("summarise", stream=False))
    assert status == 400 and "unknown task 'summarise'" in body["error"]["message"]
    assert "write" in body["error"]["message"]


def test_no_candidate_fits_answers_503_with_every_verdict(make_proxy, mock, tmp_path):
    cfg = router_config(tmp_path, mock, {"gpu": False})
    cfg["routes"] = {"write": ["writer", "offline"]}
    proxy = make_proxy(cfg)
    status, body = proxy.post("alice", mock + "/v1/chat/completions",
                              chat("route:write", stream=False))
    assert status == 503 and body["error"]["type"] == "fleettop_no_route"
    ev = proxy.wait("route.failed")
    assert {v["candidate"]: v["verdict"] for v in ev["verdicts"]} == {
        "writer": "needs a GPU; none here", "offline": "server down"}


def test_routed_requests_count_against_the_model_budget(make_proxy, mock, tmp_path):
    cfg = router_config(tmp_path, mock, {"gpu": False})
    cfg["models"]["tiny"]["budget"] = {"requests": 2}
    cfg["models"]["spare"] = {"backend": "openai", "url": mock + "/v1",
                              "model": "demo-json", "device": "cpu"}
    cfg["routes"] = {"write": ["tiny", "spare"]}
    mock_reset(mock)
    proxy = make_proxy(cfg)
    for _ in range(3):
        status, _ = proxy.post("alice", mock + "/v1/chat/completions",
                               chat("route:write", stream=False))
        assert status == 200
    assert [e["model"] for e in mock_get(mock, "/mock/log")["requests"]] == [
        "demo-chat", "demo-chat", "demo-json"]
    ev = proxy.wait("route.changed", pred=lambda e: e["name"] == "spare")
    assert "over budget: 2/2 requests" in ev["reason"]


# --- the whole path: a fleet file, the supervisor, the proxy, real agent processes ---------

AGENT = """
import json, os, sys, urllib.request
url = sys.argv[1]
for i in range(2):  # urllib honours HTTP_PROXY: the agent knows nothing of fleettop
    body = {"model": "demo-slow", "stream": True,
            "messages": [{"role": "user", "content": os.environ["FLEETTOP_AGENT"] + str(i)}]}
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200 and b'"done":true' in r.read().replace(b" ", b"")
print("agent done", flush=True)
"""


def test_a_fleet_of_shared_agents_takes_turns_on_a_local_gpu_server(tmp_path):
    from tests.support.processes import FLEETTOP, write_fleet

    port = _free_port()
    server = f"http://127.0.0.1:{port}"
    agent = {"cmd": [sys.executable, "-c", AGENT, server + "/api/chat"], "gpu": "shared",
             "depends_on": ["mock"], "restart": "no"}
    fleet = write_fleet(tmp_path, json.dumps({
        "agents": {
            "mock": {"cmd": [sys.executable, "-m", "fleettop.supervisor.demo.mock_llm",
                             "--port", str(port), "--slow-delay", "0.05"],
                     "proxy": False, "ready": {"tcp": f"127.0.0.1:{port}"}},
            "one": agent, "two": agent},
        "gpu": {"backends": [{"kind": "ollama", "url": server}]},
        "governor": {"enabled": False}}))
    proc = subprocess.Popen([*FLEETTOP, "run", "--headless", str(fleet), "--events", "json",
                             "--no-telemetry", "--for", "90s"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    events: list[dict] = []
    exited: set[str] = set()
    try:
        for line in proc.stdout:
            ev = json.loads(line)
            events.append(ev)
            if ev.get("kind") == "agent.state" and ev.get("data", {}).get("to") == "exited":
                exited.add(ev.get("agent"))
            if {"one", "two"} <= exited:
                break
        stats = mock_get(server, "/mock/stats")
        log = mock_get(server, "/mock/log")["requests"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert {"one", "two"} <= exited, [e.get("reason") for e in events][-20:]
    ends = [e for e in events if e.get("kind") == "agent.state" and e["agent"] in ("one", "two")
            and e["data"].get("to") == "exited"]
    assert all(e["data"].get("exit_code") == 0 for e in ends), ends
    assert stats["total"] == 4 and stats["max_in_flight"] == 1
    assert not overlapped(log)


def test_reload_applies_new_agent_gpu_modes(make_proxy, mock, tmp_path):
    mock_reset(mock)
    cfg = gpu_config(tmp_path, mock, lock_timeout=0.5, agents={"alice": "none"})
    proxy = make_proxy(cfg)
    holder = GpuLock(tmp_path / "gpu", name="nightly-job")
    holder.acquire()
    try:
        url = mock + "/v1/chat/completions"
        assert proxy.post("alice", url, chat("demo-chat", stream=False))[0] == 200
        raw = json.loads((tmp_path / "cfg.json").read_text())
        raw["gpu"]["agents"] = {"alice": "shared"}  # as ProxyBreaker.after_reload writes it
        (tmp_path / "cfg.json").write_text(json.dumps(raw))
        proxy.proc.stdin.write(json.dumps({"cmd": "reload"}) + "\n")
        proxy.proc.stdin.flush()
        assert proxy.wait("proxy.reply", pred=lambda e: e.get("cmd") == "reload")["ok"]
        status, body = proxy.post("alice", url, chat("demo-chat", stream=False))
        assert status == 503 and body["error"]["type"] == "fleettop_gpu_busy"
    finally:
        holder.release()


def test_embeddings_to_a_gpu_server_are_gated_too(make_proxy, mock, tmp_path):
    """Endpoints the wire parsers don't know (embeddings) still load models: gated too."""
    mock_reset(mock)
    proxy = make_proxy(gpu_config(tmp_path, mock, lock_timeout=0.5))
    body = {"model": "demo-chat", "input": ["some text"]}
    holder = GpuLock(tmp_path / "gpu", name="nightly-job")
    holder.acquire()
    try:
        status, reply = proxy.post("alice", mock + "/api/embed", body)
        assert status == 503 and reply["error"]["type"] == "fleettop_gpu_busy"
        assert not mock_get(mock, "/mock/log")["requests"]  # held at the proxy
    finally:
        holder.release()
    status, _ = proxy.post("alice", mock + "/api/embed", body)
    assert status == 404  # the mock has no embeddings endpoint: it got the request now
    assert [e["path"] for e in mock_get(mock, "/mock/log")["requests"]] == ["/api/embed"]
