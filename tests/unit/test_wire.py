"""Wire parsers: every chunk split, every known format, compressed and malformed bodies."""

from __future__ import annotations

import gzip
import json
import random
import zlib

import brotli
import pytest
import zstandard

from fleettop.probes.proxy.wire import ResponseParser, classify

OPENAI_SSE = b"".join(
    b"data: " + json.dumps({"model": "m1", "choices": [{"delta": {"content": t}}]}).encode()
    + b"\n\n" for t in ["Hel", "lo", " wor", "ld"]
) + b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":4}}\n\ndata: [DONE]\n\n'

ANTHROPIC_SSE = (
    b'event: message_start\ndata: {"type":"message_start","message":{"model":"claude-x",'
    b'"usage":{"input_tokens":11,"output_tokens":1}}}\r\n\r\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"Hi"}}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":" there"}}\n\n'
    b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":5}}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)

RESPONSES_SSE = (
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
    b'"delta":"Yo"}\n\n'
    b'event: response.completed\ndata: {"type":"response.completed","response":{"model":"g",'
    b'"usage":{"input_tokens":3,"output_tokens":1}}}\n\n'
)

OLLAMA_NDJSON = b"".join(json.dumps(o).encode() + b"\n" for o in [
    {"model": "llama3", "message": {"role": "assistant", "content": "A"}, "done": False},
    {"model": "llama3", "message": {"role": "assistant", "content": "B"}, "done": False},
    {"model": "llama3", "message": {"role": "assistant", "content": ""}, "done": True,
     "prompt_eval_count": 9, "eval_count": 2},
])


def run(parser: ResponseParser, body: bytes, cuts: list[int]) -> str:
    out, last = [], 0
    for cut in [*cuts, len(body)]:
        out += parser.feed(body[last:cut])
        last = cut
    out += parser.finish()
    return "".join(out)


@pytest.mark.parametrize("api,ctype,body,text,tin,tout,model", [
    ("openai_chat", "text/event-stream", OPENAI_SSE, "Hello world", 7, 4, "m1"),
    ("anthropic_messages", "text/event-stream", ANTHROPIC_SSE, "Hi there", 11, 5, "claude-x"),
    ("openai_responses", "text/event-stream", RESPONSES_SSE, "Yo", 3, 1, "g"),
    ("ollama_chat", "application/x-ndjson", OLLAMA_NDJSON, "AB", 9, 2, "llama3"),
])
def test_streams_split_at_every_boundary(api, ctype, body, text, tin, tout, model):
    for cut in range(len(body) + 1):
        p = ResponseParser(api, ctype)
        assert run(p, body, [cut]) == text
        assert (p.info.tokens_in, p.info.tokens_out, p.info.model) == (tin, tout, model)
    rng = random.Random(3)
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(body)), 8))
        assert run(ResponseParser(api, ctype), body, cuts) == text


@pytest.mark.parametrize("body,text", [
    ({"model": "m", "choices": [{"message": {"content": "whole"}}],
      "usage": {"prompt_tokens": 1, "completion_tokens": 2}}, "whole"),
    ({"type": "message", "model": "c", "content": [{"type": "text", "text": "anth"}],
      "usage": {"input_tokens": 1, "output_tokens": 2}}, "anth"),
    ({"object": "response", "model": "r", "output": [{"type": "message", "content": [
        {"type": "output_text", "text": "resp"}]}], "usage": {"input_tokens": 1,
                                                              "output_tokens": 2}}, "resp"),
    ({"model": "o", "response": "gen", "done": True, "prompt_eval_count": 1,
      "eval_count": 2}, "gen"),
    ({"model": "c", "choices": [{"text": "compl"}],
      "usage": {"prompt_tokens": 1, "completion_tokens": 2}}, "compl"),
])
def test_whole_json_bodies(body, text):
    raw = json.dumps(body).encode()
    p = ResponseParser("openai_chat", "application/json")
    assert run(p, raw, [5, 17]) == text
    assert (p.info.tokens_in, p.info.tokens_out) == (1, 2)


@pytest.mark.parametrize("encoding,compress", [
    ("gzip", gzip.compress),
    ("deflate", zlib.compress),
    ("deflate", lambda b: zlib.compress(b)[2:-4]),  # raw deflate, seen in the wild
    ("br", brotli.compress),
    ("zstd", lambda b: zstandard.ZstdCompressor().compress(b)),
])
def test_compressed_streams(encoding, compress):
    packed = compress(OPENAI_SSE)
    for cuts in ([1], [3, 9, 20], list(range(1, len(packed), 7))):
        p = ResponseParser("openai_chat", "text/event-stream", encoding)
        assert run(p, packed, cuts) == "Hello world"


def test_malformed_input_never_raises():
    rng = random.Random(7)
    for _ in range(200):
        junk = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 300)))
        for api, ctype, enc in [("openai_chat", "text/event-stream", None),
                                ("ollama_chat", "application/x-ndjson", "gzip"),
                                ("anthropic_messages", "application/json", "br"),
                                ("openai_chat", "text/event-stream", "zstd")]:
            p = ResponseParser(api, ctype, enc)
            run(p, b"data: {bad json\n\n" + junk + b"data: [1,2]\n\n", [3, 40])
    p = ResponseParser("openai_chat", "text/event-stream", "x-unknown")
    assert run(p, OPENAI_SSE, [4]) == ""


def test_classify():
    assert classify("/v1/chat/completions") == "openai_chat"
    assert classify("/v1/completions?x=1") == "openai_completions"
    assert classify("/v1/responses") == "openai_responses"
    assert classify("/v1/messages") == "anthropic_messages"
    assert classify("/api/chat") == "ollama_chat"
    assert classify("/api/generate") == "ollama_generate"
    assert classify("/api/tags") is None


def test_several_sse_events_in_one_read_match_one_event_per_read():
    # The fast path for reads of whole one-line `data:` events, malformed ones included.
    body = (OPENAI_SSE.replace(b"data: [DONE]\n\n", b"")
            + b"data: {not json\n\ndata: [1, 2]\n\ndata: {\"choices\": 7}\n\n"
            + b'data: {"choices":[{"delta":{"content":"!"}}]} x\n\n'
            + b'data: {"choices":[{"delta":{"content":"?"}}]}  \n\ndata: [DONE]\n\n')
    events = [e + b"\n\n" for e in body.split(b"\n\n")[:-1]]
    whole, single = ResponseParser("openai_chat", "text/event-stream"), ResponseParser(
        "openai_chat", "text/event-stream")
    got_whole = whole.feed(body) + whole.finish()
    got_single = [t for e in events for t in single.feed(e)] + single.finish()
    assert got_whole == got_single == ["Hel", "lo", " wor", "ld", "?"]
    for attr in ("events", "malformed"):
        assert getattr(whole, attr) == getattr(single, attr)
    assert whole.info.done and whole.info.tokens_in == 7 and whole.info.model == "m1"
