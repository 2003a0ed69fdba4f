"""`fleettop replay`: every input kind, sniffing, --format, --config, real proxy incidents."""

from __future__ import annotations

import gzip
import http.client
import json
import queue
import subprocess
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from fleettop.supervisor.cli import main as cli
from fleettop.supervisor.replay import BadInput, ReplayParams, replay_path, replay_stream, sniff
from tests.support.processes import spawn_proxy

DATA = Path(__file__).parent / "data"
MiB = 1 << 20
LOOP_TEXT = ("Let me look at the failing test first. The error says the fixture is missing. "
             + "I will try the same thing again to see what happens. " * 40)
PROSE = ("The scheduler keeps one queue per priority. Each agent gets a slice of the GPU when "
         "it holds the lock, and the lock is handed over in ticket order. A frozen agent keeps "
         "its memory, so resuming it is cheap; a stopped one must reload its model. ") * 2


def _corpus(name: str) -> list[dict]:
    with gzip.open(DATA / name, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def _pieces(text: str, n: int = 7) -> list[str]:
    return [text[i : i + n] for i in range(0, len(text), n)]


def openai_sse(text: str) -> str:
    events = [{"model": "m", "choices": [{"delta": {"content": p}}]} for p in _pieces(text)]
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def anthropic_sse(text: str) -> str:
    out = ["event: message_start\ndata: " + json.dumps(
        {"type": "message_start", "message": {"model": "claude", "usage": {"input_tokens": 9}}})]
    for p in _pieces(text):
        out.append("event: content_block_delta\ndata: " + json.dumps(
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta",
                                                                  "text": p}}))
    out.append('event: message_stop\ndata: {"type": "message_stop"}')
    return "\n\n".join(out) + "\n\n"


def ollama_chat(text: str) -> str:
    lines = [{"model": "llama", "message": {"role": "assistant", "content": p}, "done": False}
             for p in _pieces(text)]
    lines.append({"model": "llama", "message": {"role": "assistant", "content": ""},
                  "done": True, "prompt_eval_count": 5, "eval_count": 99})
    return "".join(json.dumps(x) + "\n" for x in lines)


def ollama_generate(text: str) -> str:
    return "".join(json.dumps({"model": "llama", "response": p, "done": False}) + "\n"
                   for p in _pieces(text))


def request_log(n: int, same: bool = True) -> str:
    bodies = [{"model": "m", "messages": [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Run the tests." if same else f"Summarise file {i}.py."}]}
        for i in range(n)]
    return "".join(json.dumps(b) + "\n" for b in bodies)


def memory_csv(kind: str, seed: int = 3) -> str:
    rng = np.random.default_rng(seed)
    t = np.arange(0, 1800, 1.0)
    y = 300 * MiB + rng.normal(0, 2 * MiB, len(t))
    if kind == "leak":  # 1 MiB/s from minute 5
        y += np.clip(t - 300, 0, None) * MiB
    else:  # GC sawtooth: 200 MiB up, then back down, every 30 s
        y += 200 * MiB * ((t % 30) / 30)
    return "t_seconds,bytes\n" + "".join(f"{a:.0f},{b:.0f}\n" for a, b in zip(t, y,
                                                                                 strict=True))


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """Every input kind, each under a misleading name (sniffing must ignore names)."""
    made = {
        "openai": ("reply.txt", openai_sse(LOOP_TEXT)),
        "anthropic": ("anthropic.jsonl", anthropic_sse(LOOP_TEXT)),
        "ollama_chat": ("chat.csv", ollama_chat(LOOP_TEXT)),
        "ollama_generate": ("gen.sse", ollama_generate(LOOP_TEXT)),
        "text": ("loop.jsonl", LOOP_TEXT),
        "prose": ("prose.sse", PROSE),
        "retry": ("requests.txt", request_log(8)),
        "progress": ("progress.log", request_log(8, same=False)),
        "leak": ("leak.txt", memory_csv("leak")),
        "sawtooth": ("saw.jsonl", memory_csv("sawtooth")),
    }
    out = {}
    for key, (name, text) in made.items():
        out[key] = tmp_path / name
        out[key].write_text(text)
    return out


def test_sniffing_ignores_file_names(files):
    want = {"openai": "sse", "anthropic": "sse", "ollama_chat": "ndjson",
            "ollama_generate": "ndjson", "text": "text", "prose": "text", "retry": "requests",
            "progress": "requests", "leak": "memory", "sawtooth": "memory"}
    assert {k: sniff(p) for k, p in files.items()} == want
    assert sniff(files["text"].parent) == "incident"


def test_streams_trip_at_the_same_char_whatever_the_framing(files):
    results = {k: replay_path(files[k]) for k in
               ("openai", "anthropic", "ollama_chat", "ollama_generate", "text")}
    for key, r in results.items():
        assert r["verdict"] == "loop" and r["kind"] == "generation", key
        assert r["evidence"]["repeating_span"] and r["evidence"]["tier"], key
        assert r["input"] == str(files[key])
    assert len({r["at_char"] for r in results.values()}) == 1, results
    onset = LOOP_TEXT.index("I will try")
    assert onset < results["text"]["at_char"] < onset + 500
    ok = replay_stream(ollama_chat(PROSE).encode(), "ndjson", ReplayParams())
    assert ok["verdict"] == "ok" and ok["chars"] == len(PROSE)
    assert (ok["tokens_in"], ok["tokens_out"]) == (5, 99)  # usage read by the proxy's parser
    assert results["anthropic"]["format"] == "sse" and results["anthropic"]["malformed"] == 0


def test_legit_inputs_are_ok(files):
    for key in ("prose", "progress", "sawtooth"):
        assert replay_path(files[key])["verdict"] == "ok", key


def test_request_log_retry_loop(files):
    r = replay_path(files["retry"])
    assert (r["verdict"], r["kind"], r["at_request"]) == ("loop", "retry", 5)
    assert r["at_char"] is None and len(r["evidence"]["hits"]) >= 5


def test_memory_traces(files):
    leak = replay_path(files["leak"])
    assert leak["verdict"] == "leak" and leak["format"] == "memory"
    assert leak["slope_bytes_per_s"] > 0 and 0 <= leak["r2"] <= 1
    assert 300 < leak["detected_at_s"] <= 300 + 90  # 1 MiB/s declared within 90 s of onset
    saw = replay_path(files["sawtooth"])
    assert saw["verdict"] == "ok" and saw["detected_at_s"] is None
    assert {"input", "verdict", "slope_bytes_per_s", "r2", "detected_at_s"} <= saw.keys()


def test_format_forces_the_kind(files, tmp_path):
    # An SSE body read as plain text: the JSON framing itself is the "generated text".
    forced = replay_path(files["openai"], fmt="text")
    assert forced["format"] == "text" and forced["chars"] > len(LOOP_TEXT)
    as_text = replay_path(files["retry"], fmt="text")  # 8 identical bodies read as text
    assert (as_text["format"], as_text["kind"]) == ("text", "generation")
    assert replay_path(files["ollama_chat"], fmt="ndjson")["verdict"] == "loop"
    with pytest.raises(BadInput):
        replay_path(files["ollama_chat"], fmt="sse")  # no data: lines
    with pytest.raises(BadInput):
        replay_path(files["prose"], fmt="requests")
    with pytest.raises(BadInput):
        replay_path(files["prose"], fmt="memory")
    with pytest.raises(BadInput):
        replay_path(files["prose"], fmt="incident")
    with pytest.raises(BadInput):
        replay_path(files["prose"], fmt="sse")  # no SSE events in it


def test_config_thresholds_change_verdicts(files, tmp_path, capsys):
    four = tmp_path / "four.jsonl"
    four.write_text(request_log(4))
    assert replay_path(four)["verdict"] == "ok"  # default: 6 in a row
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("agents:\n  coder:\n    cmd: 'true'\n    breaker: {retry: {repeats: 2}}\n"
                     "breaker:\n  retry: {repeats: 3}\n")
    assert cli.main(["replay", "--json", "--config", str(fleet), str(four)]) == 1
    r = json.loads(capsys.readouterr().out)
    assert (r["verdict"], r["kind"], r["at_request"]) == ("loop", "retry", 2)
    assert cli.main(["replay", "--json", "--config", str(fleet), "--agent", "coder",
                     str(four)]) == 1
    assert json.loads(capsys.readouterr().out)["at_request"] == 1  # the agent's override
    # Budget: 50 tokens ≈ 200 chars of estimated output.
    budget = tmp_path / "budget.yaml"
    budget.write_text("breaker:\n  budget: {tokens: 50}\n")
    assert cli.main(["replay", "--json", "--config", str(budget), str(files["prose"])]) == 1
    r = json.loads(capsys.readouterr().out)
    assert r["kind"] == "budget" and r["evidence"]["budget"] == "tokens" and r["at_char"] <= 256
    # Generation thresholds raised out of reach: the loop text passes (budget aside).
    relaxed = tmp_path / "relaxed.yaml"
    relaxed.write_text("breaker:\n  generation: {min_cover: 8192, copies: 50,"
                       " unit_consecutive: 60, window_consecutive: 60}\n")
    assert cli.main(["replay", "--config", str(relaxed), str(files["text"])]) == 0
    assert ": ok (text," in capsys.readouterr().out


def test_cli_exit_codes_and_bad_inputs(files, tmp_path, capsys):
    assert cli.main(["replay", str(files["prose"]), str(files["sawtooth"])]) == 0
    assert capsys.readouterr().out.count(": ok (") == 2
    assert cli.main(["replay", str(files["prose"]), str(files["text"])]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith(f"{files['text']}: loop (generation")
    missing = tmp_path / "missing.sse"
    broken = tmp_path / "broken.csv"
    broken.write_text("t_seconds,bytes\n1,2\nthree,4\n")
    code = cli.main(["replay", "--json", str(missing), str(broken), str(files["text"])])
    assert code == 2
    got = capsys.readouterr()
    assert f"{missing}: No such file or directory" in got.err
    assert f"{broken}: line 3: expected two numbers" in got.err
    lines = [json.loads(line) for line in got.out.splitlines()]
    assert [x["verdict"] for x in lines] == ["error", "error", "loop"]  # others still processed
    bad_fleet = tmp_path / "bad.yaml"
    bad_fleet.write_text("breaker: {retry: {repeats: 0}}\n")
    assert cli.main(["replay", "--config", str(bad_fleet), str(files["text"])]) == 2


def test_corpus_sample_verdicts():
    sample = [s for s in _corpus("loop_corpus.jsonl.gz")[::6] if s["label"] != "ambiguous"]
    assert {s["label"] for s in sample} == {"legit", "loop"}
    wrong = []
    for s in sample:
        r = replay_stream(openai_sse(s["text"]).encode(), "sse", ReplayParams(), s["id"])
        if (r["verdict"] == "loop") != (s["label"] == "loop"):
            wrong.append(s["id"])
        elif r["verdict"] == "loop":
            assert r["kind"] == "generation" and r["at_char"] > s["loop_start"], s["id"]
    assert wrong == []


def test_request_corpus_verdicts(tmp_path):
    wrong = []
    for s in _corpus("request_corpus.jsonl.gz")[::3]:
        path = tmp_path / s["id"].replace("/", "_")
        path.write_text("".join(json.dumps(b) + "\n" for b in s["requests"]))
        r = replay_path(path)
        if (r["verdict"] == "loop") != (s["label"] == "loop") or r["format"] != "requests":
            wrong.append(s["id"])
    assert wrong == []


def test_incident_written_by_hand(tmp_path):
    folder = tmp_path / "20250101-000000-coder-retry_loop"
    folder.mkdir()
    records = [{"ts": 1000.0 + i, "method": "POST", "url": "http://x/v1/chat/completions",
                "api": "openai_chat", "headers": {}, "body": json.loads(line)}
               for i, line in enumerate(request_log(7).splitlines())]
    (folder / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "response.txt").write_text(PROSE)
    (folder / "event.json").write_text(json.dumps(
        {"event": "breaker.trip", "agent": "coder", "kind": "retry_loop", "at_request": 5}))
    r = replay_path(folder)
    assert (r["format"], r["verdict"], r["kind"], r["reproduced"]) == (
        "incident", "loop", "retry", True)
    assert r["recorded"]["at_request"] == r["at_request"] == 5
    (folder / "requests.jsonl").write_text("")
    r = replay_path(folder)
    assert r["verdict"] == "ok" and r["reproduced"] is False
    with pytest.raises(BadInput):
        replay_path(tmp_path / "20250101-000000-coder-retry_loop" / "response.txt",
                    fmt="incident")


# --- an incident folder written by the real proxy ------------------------------------------

TOKENS = {"looper": "tok-looper-0123456789", "retrier": "tok-retrier-0123456789"}


class _Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        if body.get("stream"):
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            try:
                for piece in _pieces(LOOP_TEXT * 3, 11):
                    event = {"model": "mock-1", "choices": [{"delta": {"content": piece}}]}
                    data = b"data: " + json.dumps(event).encode() + b"\n\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                    time.sleep(0.001)
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                pass
            return
        raw = json.dumps({"model": "mock-1", "choices": [{"message": {"content": "fine"}}],
                          "usage": {"prompt_tokens": 10, "completion_tokens": 2}}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


@pytest.fixture(scope="module")
def real_incidents(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("replay-proxy")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    upstream = f"http://127.0.0.1:{server.server_address[1]}"
    proc = spawn_proxy(tmp, TOKENS, {"proxy": {"stats_interval": 5}}, stderr=subprocess.DEVNULL)
    events: queue.Queue[dict] = queue.Queue()
    threading.Thread(target=lambda: [events.put(json.loads(x)) for x in proc.stdout],
                     daemon=True).start()

    def wait(kind: str, timeout: float = 20, **match) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                ev = events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if ev.get("event") == kind and all(ev.get(k) == v for k, v in match.items()):
                return ev
        raise AssertionError(f"no {kind} {match} within {timeout}s")

    try:
        port = wait("proxy.ready")["port"]
        for agent, prompt, stream, times in (("looper", "write it", True, 1),
                                             ("retrier", "please fix the build", False, 7)):
            proxy = f"http://{agent}:{TOKENS[agent]}@127.0.0.1:{port}"
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy}))
            for _ in range(times):
                body = {"model": "mock-1", "stream": stream,
                        "messages": [{"role": "user", "content": prompt}]}
                req = urllib.request.Request(f"{upstream}/v1/chat/completions", method="POST",
                                             data=json.dumps(body).encode(),
                                             headers={"content-type": "application/json"})
                try:
                    with opener.open(req, timeout=10) as resp:
                        resp.read()
                except (urllib.error.HTTPError, http.client.IncompleteRead, OSError):
                    pass
        yield {a: wait("breaker.trip", agent=a) for a in TOKENS}
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        server.shutdown()


def test_real_proxy_incidents_replay_to_the_same_verdict(real_incidents, capsys):
    loop, retry = real_incidents["looper"], real_incidents["retrier"]
    assert loop["kind"] == "token_loop" and retry["kind"] == "retry_loop"
    r = replay_path(loop["incident"])
    assert (r["verdict"], r["kind"], r["reproduced"]) == ("loop", "generation", True)
    assert r["evidence"]["tier"] == loop["evidence"]["tier"]
    # The ring held this one response only. The proxy trips at the end of an upstream read
    # (one or more 11-char events), replay at the end of a 32-char delta: close, not equal.
    assert -64 <= loop["at_char"] - r["at_char"] <= 1024, (r["at_char"], loop["at_char"])
    r = replay_path(retry["incident"])
    assert (r["verdict"], r["kind"], r["reproduced"]) == ("loop", "retry", True)
    assert r["at_request"] == retry["at_request"]
    # Through the CLI, sniffed as folders, and the response text alone as plain text.
    text = str(Path(loop["incident"], "response.txt"))
    assert cli.main(["replay", "--json", loop["incident"], retry["incident"], text]) == 1
    got = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(g["format"], g["verdict"]) for g in got] == [
        ("incident", "loop"), ("incident", "loop"), ("text", "loop")]
