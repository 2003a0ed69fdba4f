"""Mock LLM backend: OpenAI, Anthropic and Ollama wire formats from one aiohttp server.

The demo fleet and the proxy/breaker tests need a backend that streams exactly like the real
ones (SSE framing, NDJSON lines, usage fields, /api/ps with keep_alive) but runs offline with
no GPU. Answers come from `scripts.py`, keyed by model name, so each demo model shows one
behaviour. A client that disconnects mid-stream is counted in /mock/stats as `aborted`, which
lets tests prove a breaker's abort reached the upstream.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import signal
import sys
import time
import uuid
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from aiohttp import web

from fleettop.supervisor.demo import scripts

Frame = tuple[bytes, bool]
"""One chunk to write, and whether it carries a text delta (the stream sleeps after those)."""

# Per-request storage for the request log (typed keys where this aiohttp has them).
_MODEL_KEY: Any = web.RequestKey("mock_model", str) if hasattr(web, "RequestKey") else "mock_model"
_LIMITS_KEY: Any = (web.RequestKey("mock_limits", dict) if hasattr(web, "RequestKey")
                    else "mock_limits")
DEFAULT_KEEP_ALIVE = 300.0
FOREVER = float("inf")


@dataclass
class MockConfig:
    """Stream pacing: `token_delay` after each delta, `slow_delay` for demo-slow."""

    token_delay: float = 0.02
    slow_delay: float = 0.3


@dataclass
class MockState:
    """Counters for /mock/stats and the loaded-model table behind /api/ps."""

    requests: Counter[str] = field(default_factory=Counter)
    endpoints: Counter[str] = field(default_factory=Counter)
    streams: Counter[str] = field(default_factory=Counter)
    loaded: dict[str, float] = field(default_factory=dict)  # model -> expiry (epoch s)
    log: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=2000))
    """One entry per generation request: path, model, start/end (epoch s), status, and the
    generation limits it asked for (max_tokens, num_ctx, ...)."""
    in_flight: int = 0
    max_in_flight: int = 0
    """Most generation requests served at once since the last reset (a GPU serves one)."""

    def expire(self) -> None:
        now = time.time()
        for name in [n for n, t in self.loaded.items() if t <= now]:
            del self.loaded[name]

    def load(self, model: str, keep_alive: float) -> bool:
        """Mark a model loaded until now+keep_alive; True when this was a cold load."""
        self.expire()
        cold = model not in self.loaded
        self.loaded[model] = time.time() + keep_alive if keep_alive >= 0 else FOREVER
        return cold


@dataclass
class Plan:
    """One scripted generation, ready to be framed in any wire format."""

    model: str
    prompt_tokens: int
    deltas: list[str]
    truncated: bool
    delay: float
    cold: bool = False

    @property
    def text(self) -> str:
        return "".join(self.deltas)

    @property
    def completion_tokens(self) -> int:
        return sum(scripts.estimate_tokens(d) for d in self.deltas)


# ---------------------------------------------------------------- request helpers


def _base(model: str) -> str:
    return model.removesuffix(":latest")


def _text_of(value: Any) -> str:
    """Flatten message content (str, or a list of typed parts) into plain text."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(_text_of(v) for v in value)
    if isinstance(value, dict):
        if "content" in value:
            return _text_of(value["content"])
        return str(value.get("text", ""))
    return ""


def prompt_text(body: dict[str, Any]) -> str:
    """All the text a request sends to the model, for prompt-token estimates and seeding."""
    parts = [_text_of(body.get(k)) for k in ("system", "instructions", "prompt", "input")]
    parts.append(_text_of(body.get("messages", [])))
    return "\n".join(p for p in parts if p)


_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: Any) -> float:
    """Ollama's keep_alive: seconds as a number, or a Go duration ("5m", "1h30m"); <0 = forever."""
    if value is None:
        return DEFAULT_KEEP_ALIVE
    if isinstance(value, int | float):
        return FOREVER if value < 0 else float(value)
    text = str(value).strip()
    with contextlib.suppress(ValueError):
        return parse_keep_alive(float(text))
    if text.startswith("-"):
        return FOREVER
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return DEFAULT_KEEP_ALIVE
    return sum(float(n) * _UNIT[u] for n, u in parts)


def _now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _local_iso(epoch: float) -> str:
    if epoch == FOREVER:
        return (datetime.now().astimezone() + timedelta(days=365 * 290)).isoformat()
    return datetime.fromtimestamp(epoch).astimezone().isoformat()


def _json(data: Any, status: int = 200) -> web.Response:
    # Compact like the real servers; aiohttp's default dumps adds spaces.
    return web.json_response(data, status=status, dumps=_compact)


def _compact(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"))


def _sse(data: Any, event: str | None = None) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


def _ndjson(data: dict[str, Any]) -> bytes:
    return (json.dumps(data, separators=(",", ":")) + "\n").encode()


# ---------------------------------------------------------------- error shapes


def _openai_error(status: int, message: str, type_: str, code: str | None) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return _json(body, status=status)


def _anthropic_error(status: int, type_: str, message: str) -> web.Response:
    body = {"type": "error", "error": {"type": type_, "message": message}}
    return _json(body, status=status)


def _ollama_error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status=status)


def not_found(api: str, model: str) -> web.Response:
    if api == "anthropic":
        return _anthropic_error(404, "not_found_error", f"model: {model}")
    if api == "ollama":
        return _ollama_error(404, f'model "{model}" not found, try pulling it first')
    msg = f"The model `{model}` does not exist or you do not have access to it."
    return _openai_error(404, msg, "invalid_request_error", "model_not_found")


def server_error(api: str) -> web.Response:
    if api == "anthropic":
        return _anthropic_error(500, "api_error", "Internal server error")
    if api == "ollama":
        return _ollama_error(500, "llama runner process has terminated: exit status 2")
    msg = "The server had an error while processing your request. Sorry about that!"
    return _openai_error(500, msg, "server_error", None)


def bad_request(api: str, message: str) -> web.Response:
    if api == "anthropic":
        return _anthropic_error(400, "invalid_request_error", message)
    if api == "ollama":
        return _ollama_error(400, message)
    return _openai_error(400, message, "invalid_request_error", None)


# ---------------------------------------------------------------- wire formats


def _chat_chunk(plan: Plan, cid: str, created: int, delta: dict[str, Any],
                finish: str | None, usage: bool) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": cid, "object": "chat.completion.chunk", "created": created, "model": plan.model,
        "system_fingerprint": "fp_mock",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    if usage:
        chunk["usage"] = None
    return chunk


def _openai_usage(plan: Plan) -> dict[str, int]:
    return {"prompt_tokens": plan.prompt_tokens, "completion_tokens": plan.completion_tokens,
            "total_tokens": plan.prompt_tokens + plan.completion_tokens}


def openai_chat_frames(plan: Plan, body: dict[str, Any]) -> Iterator[Frame]:
    cid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    usage = bool((body.get("stream_options") or {}).get("include_usage"))
    first = {"role": "assistant", "content": "", "refusal": None}
    yield _sse(_chat_chunk(plan, cid, created, first, None, usage)), False
    for d in plan.deltas:
        yield _sse(_chat_chunk(plan, cid, created, {"content": d}, None, usage)), True
    finish = "length" if plan.truncated else "stop"
    yield _sse(_chat_chunk(plan, cid, created, {}, finish, usage)), False
    if usage:
        last = _chat_chunk(plan, cid, created, {}, None, False)
        last["choices"], last["usage"] = [], _openai_usage(plan)
        yield _sse(last), False
    yield _sse("[DONE]"), False


def openai_chat_json(plan: Plan) -> dict[str, Any]:
    message = {"role": "assistant", "content": plan.text, "refusal": None}
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion",
        "created": int(time.time()), "model": plan.model, "system_fingerprint": "fp_mock",
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": "length" if plan.truncated else "stop"}],
        "usage": _openai_usage(plan),
    }


def _completion(plan: Plan, cid: str, created: int, text: str, finish: str | None
                ) -> dict[str, Any]:
    return {"id": cid, "object": "text_completion", "created": created, "model": plan.model,
            "system_fingerprint": "fp_mock",
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}


def openai_completion_frames(plan: Plan, body: dict[str, Any]) -> Iterator[Frame]:
    cid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    usage = bool((body.get("stream_options") or {}).get("include_usage"))
    for d in plan.deltas:
        yield _sse(_completion(plan, cid, created, d, None)), True
    yield _sse(_completion(plan, cid, created, "", "length" if plan.truncated else "stop")), False
    if usage:
        last = _completion(plan, cid, created, "", None)
        last["choices"], last["usage"] = [], _openai_usage(plan)
        yield _sse(last), False
    yield _sse("[DONE]"), False


def openai_completion_json(plan: Plan) -> dict[str, Any]:
    out = _completion(plan, f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time()), plan.text,
                      "length" if plan.truncated else "stop")
    out["usage"] = _openai_usage(plan)
    return out


def _response_obj(plan: Plan, rid: str, created: int, body: dict[str, Any], status: str,
                  output: list[dict[str, Any]], usage: bool) -> dict[str, Any]:
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": rid, "object": "response", "created_at": created, "status": status,
        "error": None, "incomplete_details": incomplete,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"), "model": plan.model,
        "output": output, "parallel_tool_calls": True, "previous_response_id": None,
        "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
        "tool_choice": "auto", "tools": [], "metadata": body.get("metadata") or {},
        "usage": {
            "input_tokens": plan.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": plan.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": plan.prompt_tokens + plan.completion_tokens,
        } if usage else None,
    }


def _response_item(mid: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": []}
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [part] if status == "completed" or text else []}


def responses_frames(plan: Plan, body: dict[str, Any]) -> Iterator[Frame]:
    rid, mid, created = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}", int(time.time())
    seq = iter(range(1 << 30))

    def ev(kind: str, **data: Any) -> bytes:
        return _sse({"type": kind, "sequence_number": next(seq), **data}, event=kind)

    yield ev("response.created",
             response=_response_obj(plan, rid, created, body, "in_progress", [], False)), False
    yield ev("response.in_progress",
             response=_response_obj(plan, rid, created, body, "in_progress", [], False)), False
    yield ev("response.output_item.added", output_index=0,
             item=_response_item(mid, "", "in_progress")), False
    loc = {"item_id": mid, "output_index": 0, "content_index": 0}
    yield ev("response.content_part.added", **loc,
             part={"type": "output_text", "text": "", "annotations": []}), False
    for d in plan.deltas:
        yield ev("response.output_text.delta", **loc, delta=d, logprobs=[]), True
    text = plan.text
    yield ev("response.output_text.done", **loc, text=text, logprobs=[]), False
    yield ev("response.content_part.done", **loc,
             part={"type": "output_text", "text": text, "annotations": []}), False
    item = _response_item(mid, text, "incomplete" if plan.truncated else "completed")
    yield ev("response.output_item.done", output_index=0, item=item), False
    status = "incomplete" if plan.truncated else "completed"
    final = _response_obj(plan, rid, created, body, status, [item], True)
    yield ev(f"response.{status}", response=final), False


def responses_json(plan: Plan, body: dict[str, Any]) -> dict[str, Any]:
    status = "incomplete" if plan.truncated else "completed"
    item = _response_item(f"msg_{uuid.uuid4().hex}", plan.text, status)
    out = _response_obj(plan, f"resp_{uuid.uuid4().hex}", int(time.time()), body, status,
                        [item], True)
    out["output_text"] = plan.text
    return out


def _anthropic_stop(plan: Plan) -> str:
    return "max_tokens" if plan.truncated else "end_turn"


def anthropic_frames(plan: Plan, body: dict[str, Any]) -> Iterator[Frame]:
    message: dict[str, Any] = {
        "id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
        "model": plan.model, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": plan.prompt_tokens, "output_tokens": 1},
    }
    yield _sse({"type": "message_start", "message": message}, "message_start"), False
    yield _sse({"type": "content_block_start", "index": 0,
                "content_block": {"type": "text", "text": ""}}, "content_block_start"), False
    yield _sse({"type": "ping"}, "ping"), False
    for d in plan.deltas:
        yield _sse({"type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": d}}, "content_block_delta"), True
    yield _sse({"type": "content_block_stop", "index": 0}, "content_block_stop"), False
    yield _sse({"type": "message_delta",
                "delta": {"stop_reason": _anthropic_stop(plan), "stop_sequence": None},
                "usage": {"output_tokens": plan.completion_tokens}}, "message_delta"), False
    yield _sse({"type": "message_stop"}, "message_stop"), False


def anthropic_json(plan: Plan) -> dict[str, Any]:
    return {
        "id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
        "model": plan.model, "content": [{"type": "text", "text": plan.text}],
        "stop_reason": _anthropic_stop(plan), "stop_sequence": None,
        "usage": {"input_tokens": plan.prompt_tokens, "output_tokens": plan.completion_tokens},
    }


def _ollama_final(plan: Plan, started: float) -> dict[str, Any]:
    total = int((time.monotonic() - started) * 1e9)
    load = 850_000_000 if plan.cold else 0
    prompt_ns = 2_000_000 * max(1, plan.prompt_tokens // 10)
    return {
        "done": True, "done_reason": "length" if plan.truncated else "stop",
        "total_duration": total + load + prompt_ns, "load_duration": load,
        "prompt_eval_count": plan.prompt_tokens, "prompt_eval_duration": prompt_ns,
        "eval_count": plan.completion_tokens, "eval_duration": max(total, 1),
    }


def ollama_frames(plan: Plan, chat: bool, started: float) -> Iterator[Frame]:
    for d in plan.deltas:
        yield _ndjson(_ollama_piece(plan, chat, d) | {"done": False}), True
    final = _ollama_piece(plan, chat, "") | _ollama_final(plan, started)
    if not chat:
        final["context"] = list(range(1, plan.prompt_tokens + plan.completion_tokens + 1))
    yield _ndjson(final), False


def _ollama_piece(plan: Plan, chat: bool, text: str) -> dict[str, Any]:
    out: dict[str, Any] = {"model": plan.model, "created_at": _now_iso()}
    if chat:
        out["message"] = {"role": "assistant", "content": text}
    else:
        out["response"] = text
    return out


def ollama_json(plan: Plan, chat: bool, started: float) -> dict[str, Any]:
    final = _ollama_piece(plan, chat, plan.text) | _ollama_final(plan, started)
    if not chat:
        final["context"] = list(range(1, plan.prompt_tokens + plan.completion_tokens + 1))
    return final


# ---------------------------------------------------------------- server


class MockLLM:
    """Request handlers; one instance per app so tests can run several in one process."""

    def __init__(self, config: MockConfig | None = None) -> None:
        self.config = config or MockConfig()
        self.state = MockState()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._record])
        app.add_routes([
            web.get("/", self.root), web.get("/api/version", self.version),
            web.post("/v1/chat/completions", self.openai_chat),
            web.post("/v1/completions", self.openai_completions),
            web.post("/v1/responses", self.responses), web.get("/v1/models", self.models),
            web.post("/v1/messages", self.anthropic),
            web.post("/api/chat", self.ollama_chat), web.post("/api/generate", self.ollama_gen),
            web.get("/api/ps", self.ps), web.get("/api/tags", self.tags),
            web.get("/mock/stats", self.stats), web.post("/mock/reset", self.reset),
            web.get("/mock/log", self.request_log),
        ])
        return app

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Log each POST (a generation) with its model and when it started and ended, and
        count how many run at once: tests prove the proxy serialised a local GPU with it."""
        if request.method != "POST" or request.path.startswith("/mock/"):
            return await handler(request)
        state = self.state
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        entry: dict[str, Any] = {"path": request.path, "model": None, "start": time.time(),
                                 "end": None, "status": None}
        state.log.append(entry)
        try:
            resp = await handler(request)
            entry["status"] = resp.status
            return resp
        finally:
            entry["model"] = request.get(_MODEL_KEY)
            entry["limits"] = request.get(_LIMITS_KEY) or {}
            entry["end"] = time.time()
            state.in_flight -= 1

    # -- shared flow

    async def _body(self, request: web.Request, api: str) -> dict[str, Any] | web.Response:
        self.state.endpoints[request.path] += 1
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return bad_request(api, "invalid JSON body")
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            return bad_request(api, "model is required")
        self.state.requests[_base(body["model"])] += 1
        request[_MODEL_KEY] = body["model"]
        options = body.get("options") if isinstance(body.get("options"), dict) else {}
        request[_LIMITS_KEY] = {k: v for k, v in (
            ("max_tokens", body.get("max_tokens")),
            ("max_completion_tokens", body.get("max_completion_tokens")),
            ("num_ctx", options.get("num_ctx")), ("num_predict", options.get("num_predict")),
        ) if v is not None}
        return body

    def _plan(self, body: dict[str, Any], api: str, max_tokens: Any,
              keep_alive: float = DEFAULT_KEEP_ALIVE) -> Plan | web.Response:
        model = body["model"]
        base = _base(model)
        if base not in scripts.MODELS:
            return not_found(api, model)
        if base == "demo-error":
            self.state.streams["errors"] += 1
            return server_error(api)
        cold = self.state.load(base, keep_alive)
        prompt = prompt_text(body)
        deltas = scripts.split_deltas(scripts.answer_text(base, prompt), seed=prompt)
        deltas, truncated = scripts.truncate_deltas(
            deltas, max_tokens if isinstance(max_tokens, int) else None)
        delay = self.config.slow_delay if base == "demo-slow" else self.config.token_delay
        return Plan(model, max(1, scripts.estimate_tokens(prompt)), deltas, truncated, delay, cold)

    async def _stream(self, request: web.Request, frames: Iterator[Frame], content_type: str,
                      delay: float) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": content_type,
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        self.state.streams["started"] += 1
        try:
            for data, is_delta in frames:
                await resp.write(data)
                if is_delta:
                    await asyncio.sleep(delay)
            await resp.write_eof()
        except ConnectionResetError:
            # The client (or a breaker in the proxy) hung up mid-stream.
            self.state.streams["aborted"] += 1
            return resp
        except asyncio.CancelledError:
            self.state.streams["aborted"] += 1
            raise
        self.state.streams["completed"] += 1
        return resp

    async def _pace(self, plan: Plan) -> None:
        # A non-streamed answer still takes as long as generating it would.
        await asyncio.sleep(plan.delay * len(plan.deltas))

    # -- OpenAI

    async def openai_chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request, "openai")
        if isinstance(body, web.Response):
            return body
        plan = self._plan(body, "openai", body.get("max_completion_tokens", body.get("max_tokens")))
        if isinstance(plan, web.Response):
            return plan
        if body.get("stream"):
            return await self._stream(request, openai_chat_frames(plan, body),
                                      "text/event-stream", plan.delay)
        await self._pace(plan)
        return _json(openai_chat_json(plan))

    async def openai_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request, "openai")
        if isinstance(body, web.Response):
            return body
        plan = self._plan(body, "openai", body.get("max_tokens"))
        if isinstance(plan, web.Response):
            return plan
        if body.get("stream"):
            return await self._stream(request, openai_completion_frames(plan, body),
                                      "text/event-stream", plan.delay)
        await self._pace(plan)
        return _json(openai_completion_json(plan))

    async def responses(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request, "openai")
        if isinstance(body, web.Response):
            return body
        plan = self._plan(body, "openai", body.get("max_output_tokens"))
        if isinstance(plan, web.Response):
            return plan
        if body.get("stream"):
            return await self._stream(request, responses_frames(plan, body),
                                      "text/event-stream", plan.delay)
        await self._pace(plan)
        return _json(responses_json(plan, body))

    async def models(self, request: web.Request) -> web.Response:
        self.state.endpoints[request.path] += 1
        data = [{"id": n, "object": "model", "created": 1700000000, "owned_by": "library"}
                for n in scripts.MODELS]
        return _json({"object": "list", "data": data})

    # -- Anthropic

    async def anthropic(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request, "anthropic")
        if isinstance(body, web.Response):
            return body
        if not isinstance(body.get("max_tokens"), int):
            return bad_request("anthropic", "max_tokens: Field required")
        plan = self._plan(body, "anthropic", body["max_tokens"])
        if isinstance(plan, web.Response):
            return plan
        if body.get("stream"):
            return await self._stream(request, anthropic_frames(plan, body),
                                      "text/event-stream", plan.delay)
        await self._pace(plan)
        return _json(anthropic_json(plan))

    # -- Ollama

    async def ollama_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._ollama(request, chat=True)

    async def ollama_gen(self, request: web.Request) -> web.StreamResponse:
        return await self._ollama(request, chat=False)

    async def _ollama(self, request: web.Request, chat: bool) -> web.StreamResponse:
        started = time.monotonic()
        body = await self._body(request, "ollama")
        if isinstance(body, web.Response):
            return body
        keep_alive = parse_keep_alive(body.get("keep_alive"))
        model, base = body["model"], _base(body["model"])
        empty = not (body.get("messages") if chat else body.get("prompt"))
        if empty:
            # Ollama's load/unload idiom: no prompt, only keep_alive.
            if base not in scripts.MODELS:
                return not_found("ollama", model)
            if keep_alive == 0:
                self.state.loaded.pop(base, None)
                reason = "unload"
            else:
                self.state.load(base, keep_alive)
                reason = "load"
            piece = _ollama_piece(Plan(model, 0, [], False, 0.0), chat, "")
            return _json(piece | {"done": True, "done_reason": reason})
        options = body.get("options") or {}
        plan = self._plan(body, "ollama", options.get("num_predict"), keep_alive)
        if isinstance(plan, web.Response):
            return plan
        try:
            if body.get("stream", True):
                return await self._stream(request, ollama_frames(plan, chat, started),
                                          "application/x-ndjson", plan.delay)
            await self._pace(plan)
            return _json(ollama_json(plan, chat, started))
        finally:
            if keep_alive == 0:
                self.state.loaded.pop(base, None)

    async def ps(self, request: web.Request) -> web.Response:
        self.state.endpoints[request.path] += 1
        self.state.expire()
        models = []
        for name, expiry in self.state.loaded.items():
            info = scripts.MODELS[name]
            models.append({
                "name": f"{name}:latest", "model": f"{name}:latest", "size": info.size,
                "digest": info.digest, "details": _details(info),
                "expires_at": _local_iso(expiry), "size_vram": info.size_vram,
                "context_length": info.context_length,
            })
        return _json({"models": models})

    async def tags(self, request: web.Request) -> web.Response:
        self.state.endpoints[request.path] += 1
        models = [{"name": f"{i.name}:latest", "model": f"{i.name}:latest",
                   "modified_at": "2024-11-01T10:00:00Z", "size": i.size, "digest": i.digest,
                   "details": _details(i)} for i in scripts.MODELS.values()]
        return _json({"models": models})

    # -- misc

    async def root(self, request: web.Request) -> web.Response:
        return web.Response(text="Ollama is running")

    async def version(self, request: web.Request) -> web.Response:
        return _json({"version": "0.0.0-fleettop-mock"})

    async def stats(self, request: web.Request) -> web.Response:
        self.state.expire()
        s = self.state
        return _json({
            "requests": dict(s.requests), "total": sum(s.requests.values()),
            "endpoints": dict(s.endpoints), "loaded": sorted(s.loaded),
            "streams": {k: s.streams[k] for k in ("started", "completed", "aborted", "errors")},
            "in_flight": s.in_flight, "max_in_flight": s.max_in_flight,
        })

    async def request_log(self, request: web.Request) -> web.Response:
        return _json({"requests": list(self.state.log)})

    async def reset(self, request: web.Request) -> web.Response:
        self.state = MockState()
        return _json({"ok": True})


def _details(info: scripts.ModelInfo) -> dict[str, Any]:
    return {"parent_model": "", "format": "gguf", "family": info.family,
            "families": [info.family], "parameter_size": info.parameter_size,
            "quantization_level": info.quantization_level}


async def serve(host: str, port: int, config: MockConfig) -> None:
    """Run until SIGTERM/SIGINT, printing the one `listening` line the tests wait for."""
    runner = web.AppRunner(MockLLM(config).app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    print(f"mock-llm listening on http://{host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    """`fleettop mock-llm`: serve the scripted demo models on loopback."""
    parser = argparse.ArgumentParser(prog="fleettop mock-llm", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=11435, help="0 picks a free port")
    parser.add_argument("--token-delay", type=float, default=MockConfig.token_delay,
                        help="seconds between stream deltas (default %(default)s)")
    parser.add_argument("--slow-delay", type=float, default=MockConfig.slow_delay,
                        help="seconds between deltas for demo-slow (default %(default)s)")
    args = parser.parse_args(argv)
    try:
        asyncio.run(serve(args.host, args.port, MockConfig(args.token_delay, args.slow_delay)))
    except OSError as exc:
        print(f"mock-llm: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
