"""Incremental parsers for LLM wire formats, fed raw response bytes as they arrive.

mitmproxy's stream callable gets one call per upstream read, not aligned to SSE events or JSON
lines, and sees the body still content-encoded: `ResponseParser` decodes (gzip, deflate, br, zstd)
and buffers across arbitrary chunk boundaries, then pulls out text deltas, token usage and the
model for OpenAI (chat/completions, completions, responses), Anthropic messages and Ollama
chat/generate, streaming or not. It never raises: malformed input is counted and skipped, the
bytes themselves are relayed untouched by the caller.
"""

from __future__ import annotations

import json
import json.scanner
import zlib
from dataclasses import dataclass, field
from typing import Any

import brotli
import zstandard

# The decoder's own scanner (C), without decode()'s two whitespace regex matches per call:
# on str, since json.loads(bytes) first sniffs the encoding.
_scan = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]
MAX_JSON_BODY = 8 * 1024 * 1024
MAX_LINE = 4 * 1024 * 1024

APIS = ("openai_chat", "openai_completions", "openai_responses", "anthropic_messages",
        "ollama_chat", "ollama_generate")


def classify(path: str) -> str | None:
    """Which LLM API a request path belongs to (None: pass through, only count)."""
    path = path.split("?", 1)[0].rstrip("/")
    for suffix, api in (
        ("/chat/completions", "openai_chat"),
        ("/completions", "openai_completions"),
        ("/responses", "openai_responses"),
        ("/messages", "anthropic_messages"),
        ("/api/chat", "ollama_chat"),
        ("/api/generate", "ollama_generate"),
    ):
        if path.endswith(suffix):
            return api
    return None


class BodyDecoder:
    """Incremental Content-Encoding decoder; unknown or broken encodings yield nothing."""

    def __init__(self, encoding: str | None) -> None:
        enc = (encoding or "identity").strip().lower()
        self.failed = False
        self._obj: Any = None
        if enc in ("", "identity"):
            self.kind = "identity"
        elif enc in ("gzip", "x-gzip"):
            self.kind, self._obj = "gzip", zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif enc == "deflate":
            self.kind, self._head = "deflate", b""
        elif enc == "br":
            self.kind, self._obj = "br", brotli.Decompressor()
        elif enc == "zstd":
            self.kind, self._obj = "zstd", zstandard.ZstdDecompressor().decompressobj()
        else:
            self.kind, self.failed = enc, True

    def feed(self, data: bytes) -> bytes:
        if self.failed or not data:
            return b""
        if self.kind == "identity":
            return data
        if self.kind == "deflate" and self._obj is None:
            # "deflate" is meant to be zlib-wrapped, but some servers send raw deflate: look
            # at the first two bytes for a zlib header before choosing.
            self._head += data
            if len(self._head) < 2:
                return b""
            data, self._head = self._head, b""
            zlib_header = data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
            self._obj = zlib.decompressobj(zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS)
        try:
            if self.kind == "br":
                return self._obj.process(data)
            return self._obj.decompress(data)
        except Exception:
            self.failed = True
            return b""


class LineSplitter:
    """Split a byte stream into complete lines (SSE or NDJSON), across any chunk boundary."""

    def __init__(self) -> None:
        self._buf = b""
        self.overflow = False

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        if b"\n" not in data:
            if len(self._buf) > MAX_LINE:
                self._buf, self.overflow = b"", True
            return []
        *lines, self._buf = self._buf.split(b"\n")
        return [line.rstrip(b"\r") for line in lines]

    def rest(self) -> bytes:
        rest, self._buf = self._buf, b""
        return rest


@dataclass
class Extract:
    """What one response told us so far."""

    texts: list[str] = field(default_factory=list)
    model: str | None = None
    tokens_in: int | None = None
    tokens_out: int | None = None
    done: bool = False
    error: str | None = None


def _usage(obj: dict[str, Any], out: Extract) -> None:
    usage = obj.get("usage")
    if isinstance(usage, dict):
        tin = usage.get("prompt_tokens", usage.get("input_tokens"))
        tout = usage.get("completion_tokens", usage.get("output_tokens"))
        if isinstance(usage.get("cache_read_input_tokens"), int) and isinstance(tin, int):
            tin += usage["cache_read_input_tokens"]
        if isinstance(tin, int):
            out.tokens_in = max(out.tokens_in or 0, tin)
        if isinstance(tout, int):
            out.tokens_out = max(out.tokens_out or 0, tout)
    if isinstance(obj.get("prompt_eval_count"), int):  # Ollama
        out.tokens_in = obj["prompt_eval_count"]
    if isinstance(obj.get("eval_count"), int):
        out.tokens_out = obj["eval_count"]
    if isinstance(obj.get("model"), str) and obj["model"]:
        out.model = obj["model"]


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


_NOT_PLAIN_CHOICES = frozenset(("usage", "prompt_eval_count", "eval_count", "error", "type",
                                "output"))


def extract_event(obj: Any, out: Extract) -> None:
    """Pull text deltas, usage and model from one decoded JSON event or body, any known shape."""
    if not isinstance(obj, dict):
        return
    if "choices" in obj and _NOT_PLAIN_CHOICES.isdisjoint(obj):
        # The usual OpenAI stream event (choices, maybe model, no usage): nothing else to read.
        if isinstance(obj.get("model"), str) and obj["model"]:
            out.model = obj["model"]
        _choices(obj, out)
        return
    _usage(obj, out)
    if isinstance(obj.get("error"), dict | str):
        err = obj["error"]
        out.error = str(err.get("message", err) if isinstance(err, dict) else err)[:500]
    kind = obj.get("type")
    if kind == "message_start" and isinstance(obj.get("message"), dict):  # Anthropic
        _usage(obj["message"], out)
    if isinstance(kind, str) and kind.startswith("response.") and isinstance(
        obj.get("response"), dict
    ):  # OpenAI Responses envelope events
        _usage(obj["response"], out)
        if kind in ("response.completed", "response.done", "response.incomplete"):
            out.done = True
    _choices(obj, out)
    # OpenAI Responses stream events.
    if (isinstance(kind, str) and kind.startswith("response.") and kind.endswith(".delta")
            and (t := _text(obj.get("delta")))):
        out.texts.append(t)
    # Anthropic stream events.
    if kind == "content_block_delta" and isinstance(obj.get("delta"), dict):
        delta = obj["delta"]
        for key in ("text", "thinking", "partial_json"):
            if t := _text(delta.get(key)):
                out.texts.append(t)
    if kind == "message_stop":
        out.done = True
    if kind == "message" and isinstance(obj.get("content"), list):  # Anthropic whole body
        _collect_content(obj["content"], out)
    if isinstance(obj.get("output"), list):  # Responses whole body
        for item in obj["output"]:
            if isinstance(item, dict):
                _collect_content(item.get("content"), out)
    # Ollama chat / generate.
    if kind is None and "choices" not in obj:
        msg = obj.get("message")
        if isinstance(msg, dict):
            for key in ("thinking", "content"):
                if t := _text(msg.get(key)):
                    out.texts.append(t)
        if t := _text(obj.get("response")):
            out.texts.append(t)
        if t := _text(obj.get("thinking")):
            out.texts.append(t)
        if obj.get("done") is True:
            out.done = True


def _choices(obj: dict[str, Any], out: Extract) -> None:
    # OpenAI chat / completions (stream deltas and whole bodies).
    texts = out.texts
    for choice in obj.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        for holder in (choice.get("delta"), choice.get("message")):
            if holder and isinstance(holder, dict):
                if _HOLDER_RARE.isdisjoint(holder):  # the usual delta: content (and role)
                    t = holder.get("content")
                    if t and isinstance(t, str):
                        texts.append(t)
                    continue
                for key in _HOLDER_KEYS:
                    t = holder.get(key)
                    if t and isinstance(t, str):
                        texts.append(t)
                for call in holder.get("tool_calls") or []:
                    fn = call.get("function") if isinstance(call, dict) else None
                    if isinstance(fn, dict) and (t := _text(fn.get("arguments"))):
                        texts.append(t)
        t = choice.get("text")
        if t and isinstance(t, str):
            texts.append(t)
        if choice.get("finish_reason"):
            out.done = True


_HOLDER_KEYS = ("reasoning_content", "reasoning", "content")
_HOLDER_RARE = frozenset(("reasoning_content", "reasoning", "tool_calls"))


def _collect_content(content: Any, out: Extract) -> None:
    if isinstance(content, str):
        if content:
            out.texts.append(content)
        return
    if not isinstance(content, list):
        return
    for block in content:
        if isinstance(block, dict):
            for key in ("text", "thinking"):
                if t := _text(block.get(key)):
                    out.texts.append(t)
            if block.get("type") == "tool_use" and "input" in block:
                out.texts.append(json.dumps(block["input"]))


def _scan_events(data: bytes, events: int) -> list[Any] | None:
    """The JSON objects of `events` SSE events of one `data: {...}` line each (the fast path's
    shape), decoded and scanned in one go; None when any is not exactly what `_json` would take
    alone (not an object, extra data, bad UTF-8): the caller then goes event by event.

    An object cannot run past its line: the next line starts with `data:`, which no JSON value
    may hold outside a string, and no string may hold a raw newline."""
    try:
        text = data.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None
    objs = []
    pos, last = 6, len(text) - 2
    try:
        for _ in range(events):
            if text[pos] != "{":
                return None
            obj, end = _scan(text, pos)
            line_end = text.index("\n", end)
            if line_end != end and text[end:line_end].strip(" \t"):
                return None  # extra data after the object
            objs.append(obj)
            if line_end == last:
                break
            if text[line_end : line_end + 8] != "\n\ndata: ":
                return None
            pos = line_end + 8
    except (ValueError, StopIteration, IndexError):
        return None
    return objs if len(objs) == events and line_end == last else None


class ResponseParser:
    """Feed raw (still encoded) response bytes; read back text deltas, usage and model.

    `feed(chunk)` returns the text deltas completed by this chunk; `finish()` flushes the rest
    (a non-streaming JSON body is only parsed there). Framing is picked from the content type:
    `text/event-stream` → SSE, `*ndjson*`/`jsonl` or Ollama's default stream → JSON lines,
    anything JSON → one body.
    """

    def __init__(self, api: str | None, content_type: str | None,
                 content_encoding: str | None = None) -> None:
        self.api = api
        ctype = (content_type or "").lower()
        if "event-stream" in ctype:
            self.framing = "sse"
        elif "ndjson" in ctype or "jsonl" in ctype:
            self.framing = "ndjson"
        elif "json" in ctype:
            self.framing = "json"
        else:
            self.framing = "ndjson" if api in ("ollama_chat", "ollama_generate") else "other"
        self.decoder = BodyDecoder(content_encoding)
        self.lines = LineSplitter()
        self.info = Extract()
        self.raw_bytes = 0
        self.decoded_bytes = 0
        self.events = 0
        self.malformed = 0
        self._body = bytearray()
        self._sse_data: list[bytes] = []
        self._sse_event = ""
        self._identity = self.decoder.kind == "identity"

    def feed(self, chunk: bytes) -> list[str]:
        try:
            return self._feed(chunk)
        except Exception:  # never let a parser bug break the relay
            self.malformed += 1
            return []

    def _feed(self, chunk: bytes) -> list[str]:
        self.raw_bytes += len(chunk)
        data = chunk if self._identity else self.decoder.feed(chunk)
        self.decoded_bytes += len(data)
        if not data or self.framing == "other":
            return []
        self.info.texts = texts = list[str]()  # this chunk's deltas (a stream's would grow forever)
        if (self.framing == "sse" and data[:6] == b"data: " and data[-2:] == b"\n\n"
                and not self._sse_data and not self.lines._buf and b"\r" not in data):
            # Fast path, the usual shape: whole events of one `data:` line each. Every newline
            # in a pair and every pair followed by "data: " (or the end) says just that.
            events = data.count(b"\n\n")
            if (data.count(b"\n") == 2 * events
                    and (events == 1 or data.count(b"\n\ndata: ") == events - 1)):
                objs = _scan_events(data, events)
                if objs is not None:  # all of them JSON objects, each alone on its line
                    self.events += events
                    info = self.info
                    for obj in objs:
                        try:
                            extract_event(obj, info)
                        except Exception:  # as in _json: this event only
                            self.malformed += 1
                    self._sse_event = ""
                    return texts
                for event in data[:-2].split(b"\n\n") if events > 1 else (data[:-2],):
                    payload = event[6:]
                    if payload[:1] != b"{" and payload.strip() == b"[DONE]":
                        self.info.done = True
                    else:
                        self._json(payload)
                self._sse_event = ""
                return texts
        if self.framing == "json":
            if len(self._body) + len(data) <= MAX_JSON_BODY:
                self._body += data
            return []
        for line in self.lines.feed(data):
            self._line(line)
        return texts

    def _line(self, line: bytes) -> None:
        if self.framing == "ndjson":
            if line.strip():
                self._json(line)
            return
        if not line:  # SSE event boundary
            self._dispatch()
        elif line.startswith(b"data:"):
            self._sse_data.append(line[5:].removeprefix(b" "))
        elif line.startswith(b"event:"):
            self._sse_event = line[6:].strip().decode("utf-8", "replace")

    def _dispatch(self) -> None:
        if not self._sse_data:
            self._sse_event = ""
            return
        payload = b"\n".join(self._sse_data)
        self._sse_data = []
        self._sse_event = ""
        if payload.strip() == b"[DONE]":
            self.info.done = True
            return
        self._json(payload)

    def _json(self, payload: bytes) -> None:
        try:
            if payload[:1] == b"{":
                text = payload.decode("utf-8", "surrogatepass")
                obj, end = _scan(text, 0)
                if end != len(text) and text[end:].strip(" \t\n\r"):
                    raise ValueError("extra data after the JSON value")
            else:
                obj = json.loads(payload)
        except (ValueError, StopIteration):
            self.malformed += 1
            return
        self.events += 1
        try:
            extract_event(obj, self.info)
        except Exception:  # an unexpected shape ("choices": 7): this event only, not the read
            self.malformed += 1

    def finish(self) -> list[str]:
        """End of body: flush a trailing line/event, parse a buffered JSON body."""
        self.info.texts = texts = list[str]()
        try:
            if self.framing == "json" and self._body:
                self._json(bytes(self._body))
                self._body = bytearray()
            elif self.framing in ("sse", "ndjson"):
                rest = self.lines.rest()
                if rest.strip():
                    self._line(rest.rstrip(b"\r"))
                if self.framing == "sse":
                    self._dispatch()
        except Exception:
            self.malformed += 1
        return texts


def parse_request(content: bytes | None) -> dict[str, Any] | None:
    """The JSON body of an LLM request, or None."""
    if not content:
        return None
    try:
        obj = json.loads(content)
    except (ValueError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def request_text_chars(body: dict[str, Any]) -> int:
    """Characters of prompt text in a request (for a token estimate when usage is absent)."""
    total = 0
    for key in ("messages", "input", "prompt", "system"):
        value = body.get(key)
        if value is not None:
            total += len(json.dumps(value, ensure_ascii=False))
    return total


def estimate_tokens(chars: int) -> int:
    """~4 characters per token: the usual rule for English text with BPE tokenizers."""
    return (chars + 3) // 4
