"""The mock LLM speaks each real wire format: tested as a subprocess over real HTTP."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

# Tests must not go through whatever proxy the environment names.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def start_mock(*extra: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleettop.supervisor.demo.mock_llm", "--port", "0", *extra],
        stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    prefix = "mock-llm listening on "
    assert line.startswith(prefix), line
    return proc, line[len(prefix):]


@pytest.fixture(scope="module")
def mock() -> Iterator[str]:
    proc, url = start_mock("--token-delay", "0", "--slow-delay", "0.05")
    yield url
    proc.terminate()
    proc.wait(timeout=5)


def call(url: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, bytes, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with _OPENER.open(req, timeout=20) as resp:
            return resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers.get("Content-Type", "")


def post_json(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    status, raw, _ = call(url, path, body)
    return status, json.loads(raw)


def get_json(url: str, path: str) -> tuple[int, Any]:
    status, raw, _ = call(url, path)
    return status, json.loads(raw)


def sse_events(raw: bytes) -> list[tuple[str | None, str]]:
    """Parse SSE strictly: blank-line separated blocks of `event:` / `data:` fields."""
    text = raw.decode()
    assert text.endswith("\n\n")
    events = []
    for block in text.split("\n\n")[:-1]:
        event, data = None, None
        for line in block.split("\n"):
            key, _, value = line.partition(": ")
            assert key in ("event", "data"), line
            if key == "event":
                event = value
            else:
                data = value
        assert data is not None
        events.append((event, data))
    return events


CHAT = {"messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "How do GPU locks work?"}]}


# ---------------------------------------------------------------- OpenAI


def test_chat_completions_stream_with_usage(mock: str) -> None:
    body = {"model": "demo-chat", "stream": True, "stream_options": {"include_usage": True},
            **CHAT}
    status, raw, ctype = call(mock, "/v1/chat/completions", body)
    assert status == 200 and ctype.startswith("text/event-stream")
    events = sse_events(raw)
    assert all(ev is None for ev, _ in events)
    assert events[-1][1] == "[DONE]"
    chunks = [json.loads(d) for _, d in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    deltas = [c["choices"][0]["delta"]["content"] for c in chunks[1:-2]]
    assert all(1 <= len(d.split()) <= 4 for d in deltas)
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert all(c["usage"] is None for c in chunks[:-1])
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0

    # Deterministic: the same request without streaming gives the same answer.
    status, full = post_json(mock, "/v1/chat/completions", {"model": "demo-chat", **CHAT})
    assert status == 200 and full["object"] == "chat.completion"
    assert full["choices"][0]["message"]["content"] == text
    assert full["usage"] == usage


def test_chat_completions_stream_without_usage_and_max_tokens(mock: str) -> None:
    body = {"model": "demo-chat", "stream": True, "max_tokens": 5, **CHAT}
    _, raw, _ = call(mock, "/v1/chat/completions", body)
    chunks = [json.loads(d) for _, d in sse_events(raw)[:-1]]
    assert all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    status, full = post_json(mock, "/v1/chat/completions",
                             {"model": "demo-chat", "max_completion_tokens": 5, **CHAT})
    assert full["choices"][0]["finish_reason"] == "length"
    assert full["usage"]["completion_tokens"] <= 5


def test_completions_stream_and_json(mock: str) -> None:
    body = {"model": "demo-chat", "prompt": "Once upon a time", "stream": True,
            "stream_options": {"include_usage": True}}
    _, raw, _ = call(mock, "/v1/completions", body)
    events = sse_events(raw)
    assert events[-1][1] == "[DONE]"
    chunks = [json.loads(d) for _, d in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert chunks[-1]["usage"]["completion_tokens"] > 0
    status, full = post_json(mock, "/v1/completions",
                             {"model": "demo-chat", "prompt": "Once upon a time"})
    assert status == 200 and full["choices"][0]["text"] == text
    assert full["choices"][0]["finish_reason"] == "stop"
    assert set(full["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}


def test_responses_stream_and_json(mock: str) -> None:
    body = {"model": "demo-chat", "input": "Explain cron jitter.", "instructions": "Be terse.",
            "stream": True}
    _, raw, _ = call(mock, "/v1/responses", body)
    events = sse_events(raw)
    payloads = [json.loads(d) for _, d in events]
    kinds = [p["type"] for p in payloads]
    assert [ev for ev, _ in events] == kinds
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.output_text.done" in kinds
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    deltas = [p for p in payloads if p["type"] == "response.output_text.delta"]
    assert {(d["output_index"], d["content_index"]) for d in deltas} == {(0, 0)}
    text = "".join(d["delta"] for d in deltas)
    done = next(p for p in payloads if p["type"] == "response.output_text.done")
    assert done["text"] == text
    final = payloads[-1]["response"]
    assert final["status"] == "completed"
    assert final["output"][0]["content"][0] == {"type": "output_text", "text": text,
                                                "annotations": []}
    usage = final["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] > 0
    body.pop("stream")
    status, full = post_json(mock, "/v1/responses", body)
    assert status == 200 and full["object"] == "response" and full["status"] == "completed"
    assert full["output"][0]["content"][0]["text"] == text


def test_models_list(mock: str) -> None:
    status, out = get_json(mock, "/v1/models")
    assert status == 200 and out["object"] == "list"
    assert {"demo-chat", "demo-loop", "demo-slow", "demo-error", "demo-json"} <= {
        m["id"] for m in out["data"]}


# ---------------------------------------------------------------- Anthropic


def test_messages_stream_and_json(mock: str) -> None:
    body = {"model": "demo-chat", "max_tokens": 1024, "stream": True, "system": "Be brief.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    _, raw, ctype = call(mock, "/v1/messages", body)
    assert ctype.startswith("text/event-stream")
    events = sse_events(raw)
    payloads = [json.loads(d) for _, d in events]
    assert [ev for ev, _ in events] == [p["type"] for p in payloads]
    kinds = [p["type"] for p in payloads if p["type"] not in ("ping", "content_block_delta")]
    assert kinds == ["message_start", "content_block_start", "content_block_stop",
                     "message_delta", "message_stop"]
    start = payloads[0]["message"]
    assert start["role"] == "assistant" and start["usage"]["input_tokens"] > 0
    deltas = [p["delta"] for p in payloads if p["type"] == "content_block_delta"]
    assert {d["type"] for d in deltas} == {"text_delta"}
    text = "".join(d["text"] for d in deltas)
    msg_delta = next(p for p in payloads if p["type"] == "message_delta")
    assert msg_delta["delta"]["stop_reason"] == "end_turn"
    assert msg_delta["usage"]["output_tokens"] > 0

    body.pop("stream")
    status, full = post_json(mock, "/v1/messages", body)
    assert status == 200 and full["type"] == "message"
    assert full["content"] == [{"type": "text", "text": text}]
    assert full["usage"]["output_tokens"] == msg_delta["usage"]["output_tokens"]


def test_messages_errors(mock: str) -> None:
    msgs = {"messages": [{"role": "user", "content": "x"}]}
    status, out = post_json(mock, "/v1/messages", {"model": "demo-chat", **msgs})
    assert status == 400 and out["error"]["type"] == "invalid_request_error"
    status, out = post_json(mock, "/v1/messages", {"model": "claude-x", "max_tokens": 9, **msgs})
    assert status == 404 and out == {"type": "error", "error": {
        "type": "not_found_error", "message": "model: claude-x"}}
    status, out = post_json(mock, "/v1/messages", {"model": "demo-error", "max_tokens": 9, **msgs})
    assert status == 500 and out["error"]["type"] == "api_error"


# ---------------------------------------------------------------- Ollama


def test_ollama_chat_ndjson_stream(mock: str) -> None:
    status, raw, ctype = call(mock, "/api/chat", {"model": "demo-chat", **CHAT})
    assert status == 200 and ctype.startswith("application/x-ndjson")
    lines = raw.decode().splitlines()
    objs = [json.loads(line) for line in lines]
    assert all(not o["done"] for o in objs[:-1]) and objs[-1]["done"]
    assert all(o["message"]["role"] == "assistant" for o in objs)
    final = objs[-1]
    assert final["done_reason"] == "stop" and final["message"]["content"] == ""
    for key in ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration",
                "eval_count", "eval_duration"):
        assert isinstance(final[key], int), key
    assert final["eval_count"] > 0 and final["prompt_eval_count"] > 0
    text = "".join(o["message"]["content"] for o in objs)
    status, full = post_json(mock, "/api/chat", {"model": "demo-chat", "stream": False, **CHAT})
    assert full["message"]["content"] == text and full["done"] is True


def test_ollama_generate_json_and_stream(mock: str) -> None:
    body = {"model": "demo-chat:latest", "prompt": "Why is the sky blue?", "stream": False}
    status, full = post_json(mock, "/api/generate", body)
    assert status == 200 and full["done"] and full["model"] == "demo-chat:latest"
    assert full["response"] and isinstance(full["context"], list)
    body["stream"] = True
    _, raw, _ = call(mock, "/api/generate", body)
    objs = [json.loads(line) for line in raw.decode().splitlines()]
    assert "".join(o["response"] for o in objs) == full["response"]
    assert objs[-1]["eval_count"] == full["eval_count"]


def _ps_names(mock: str) -> set[str]:
    _, out = get_json(mock, "/api/ps")
    return {m["name"] for m in out["models"]}


def test_ollama_ps_load_and_unload(mock: str) -> None:
    call(mock, "/mock/reset", {})
    assert _ps_names(mock) == set()
    post_json(mock, "/api/generate", {"model": "demo-json", "prompt": "rows", "stream": False,
                                      "keep_alive": "10m"})
    _, ps = get_json(mock, "/api/ps")
    (entry,) = ps["models"]
    assert entry["name"] == "demo-json:latest"
    assert entry["size"] >= entry["size_vram"] > 0 and entry["expires_at"]
    assert entry["details"]["format"] == "gguf"
    # Ollama's unload idiom: no prompt, keep_alive 0.
    status, out = post_json(mock, "/api/generate", {"model": "demo-json", "keep_alive": 0})
    assert status == 200 and out["done"] and out["done_reason"] == "unload"
    assert _ps_names(mock) == set()
    # Load idiom, then a chat with keep_alive 0 answers and leaves /api/ps.
    _, out = post_json(mock, "/api/chat", {"model": "demo-chat", "messages": []})
    assert out["done_reason"] == "load" and _ps_names(mock) == {"demo-chat:latest"}
    _, out = post_json(mock, "/api/chat", {"model": "demo-chat", "stream": False,
                                          "keep_alive": "0s", **CHAT})
    assert out["message"]["content"] and _ps_names(mock) == set()


def test_ollama_tags(mock: str) -> None:
    _, out = get_json(mock, "/api/tags")
    names = {m["name"] for m in out["models"]}
    assert "demo-loop:latest" in names
    assert all({"size", "digest", "details", "modified_at"} <= set(m) for m in out["models"])


# ---------------------------------------------------------------- errors and models


def test_error_shapes(mock: str) -> None:
    msgs = {"messages": [{"role": "user", "content": "x"}]}
    status, out = post_json(mock, "/api/chat", {"model": "nope", **msgs})
    assert status == 404 and out == {"error": 'model "nope" not found, try pulling it first'}
    status, out = post_json(mock, "/v1/chat/completions", {"model": "nope", **msgs})
    assert status == 404 and out["error"]["code"] == "model_not_found"
    assert set(out["error"]) == {"message", "type", "param", "code"}
    status, out = post_json(mock, "/v1/chat/completions", {"model": "demo-error", **msgs})
    assert status == 500 and out["error"]["type"] == "server_error"
    status, out = post_json(mock, "/api/chat", {"model": "demo-error", **msgs})
    assert status == 500 and isinstance(out["error"], str)
    status, out = post_json(mock, "/api/generate", {"model": "demo-error", "prompt": "x",
                                                    "stream": False})
    assert status == 500


def test_loop_model_degenerates(mock: str) -> None:
    _, out = post_json(mock, "/v1/chat/completions", {"model": "demo-loop", **CHAT})
    text = out["choices"][0]["message"]["content"]
    assert out["usage"]["completion_tokens"] >= 4000
    head, tail = text[:200], text[-2000:]
    assert head.count(head[-40:]) == 1  # starts like a normal answer
    phrase = tail.split(". ")[-2]
    assert tail.count(phrase) > 20


def test_json_model_is_repetitive_but_varied(mock: str) -> None:
    _, out = post_json(mock, "/v1/chat/completions", {"model": "demo-json", **CHAT})
    rows = json.loads(out["choices"][0]["message"]["content"])
    assert len(rows) >= 18 and len({json.dumps(r) for r in rows}) == len(rows)
    assert len({r["temp_c"] for r in rows}) > len(rows) // 2
    table_req = {"model": "demo-json", "messages": [{"role": "user", "content": "a table"}]}
    _, out = post_json(mock, "/v1/chat/completions", table_req)
    lines = out["choices"][0]["message"]["content"].splitlines()
    assert lines[0].startswith("| id |") and len(set(lines)) == len(lines)


def test_stats_and_abort_counted(mock: str) -> None:
    call(mock, "/mock/reset", {})
    post_json(mock, "/api/generate", {"model": "demo-chat", "prompt": "a", "stream": False})
    body = json.dumps({"model": "demo-slow", "stream": True, **CHAT}).encode()
    req = urllib.request.Request(mock + "/v1/chat/completions", data=body)
    resp = _OPENER.open(req, timeout=10)
    assert resp.readline().startswith(b"data: ")
    resp.close()  # hang up mid-stream, like a breaker cutting the flow
    stats: dict[str, Any] = {}
    for _ in range(100):
        _, stats = get_json(mock, "/mock/stats")
        if stats["streams"]["aborted"]:
            break
        time.sleep(0.05)
    assert stats["streams"]["aborted"] == 1
    assert stats["requests"] == {"demo-chat": 1, "demo-slow": 1}
    assert stats["endpoints"]["/api/generate"] == 1


def test_root_and_sigterm_exit() -> None:
    proc, url = start_mock()
    assert call(url, "/")[1] == b"Ollama is running"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=5) == 0
