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
import json
import signal
import sys
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from fleettop.supervisor.demo import scripts
from fleettop.supervisor.demo.formats import (
    DEFAULT_KEEP_ALIVE,
    FOREVER,
    Frame,
    Plan,
    anthropic_frames,
    anthropic_json,
    bad_request,
    base_model,
    json_response,
    local_iso,
    not_found,
    ollama_frames,
    ollama_json,
    ollama_piece,
    openai_chat_frames,
    openai_chat_json,
    openai_completion_frames,
    openai_completion_json,
    parse_keep_alive,
    prompt_text,
    responses_frames,
    responses_json,
    server_error,
)

# Per-request storage for the request log (typed keys where this aiohttp has them).
_MODEL_KEY: Any = web.RequestKey("mock_model", str) if hasattr(web, "RequestKey") else "mock_model"
_LIMITS_KEY: Any = (web.RequestKey("mock_limits", dict) if hasattr(web, "RequestKey")
                    else "mock_limits")


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
        self.state.requests[base_model(body["model"])] += 1
        request[_MODEL_KEY] = body["model"]
        options: dict[str, Any] = body["options"] if isinstance(body.get("options"), dict) else {}
        request[_LIMITS_KEY] = {k: v for k, v in (
            ("max_tokens", body.get("max_tokens")),
            ("max_completion_tokens", body.get("max_completion_tokens")),
            ("num_ctx", options.get("num_ctx")), ("num_predict", options.get("num_predict")),
        ) if v is not None}
        return body

    def _plan(self, body: dict[str, Any], api: str, max_tokens: Any,
              keep_alive: float = DEFAULT_KEEP_ALIVE) -> Plan | web.Response:
        model = body["model"]
        base = base_model(model)
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
        return json_response(openai_chat_json(plan))

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
        return json_response(openai_completion_json(plan))

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
        return json_response(responses_json(plan, body))

    async def models(self, request: web.Request) -> web.Response:
        self.state.endpoints[request.path] += 1
        data = [{"id": n, "object": "model", "created": 1700000000, "owned_by": "library"}
                for n in scripts.MODELS]
        return json_response({"object": "list", "data": data})

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
        return json_response(anthropic_json(plan))

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
        model, base = body["model"], base_model(body["model"])
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
            piece = ollama_piece(Plan(model, 0, [], False, 0.0), chat, "")
            return json_response(piece | {"done": True, "done_reason": reason})
        options = body.get("options") or {}
        plan = self._plan(body, "ollama", options.get("num_predict"), keep_alive)
        if isinstance(plan, web.Response):
            return plan
        try:
            if body.get("stream", True):
                return await self._stream(request, ollama_frames(plan, chat, started),
                                          "application/x-ndjson", plan.delay)
            await self._pace(plan)
            return json_response(ollama_json(plan, chat, started))
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
                "expires_at": local_iso(expiry), "size_vram": info.size_vram,
                "context_length": info.context_length,
            })
        return json_response({"models": models})

    async def tags(self, request: web.Request) -> web.Response:
        self.state.endpoints[request.path] += 1
        models = [{"name": f"{i.name}:latest", "model": f"{i.name}:latest",
                   "modified_at": "2024-11-01T10:00:00Z", "size": i.size, "digest": i.digest,
                   "details": _details(i)} for i in scripts.MODELS.values()]
        return json_response({"models": models})

    # -- misc

    async def root(self, request: web.Request) -> web.Response:
        return web.Response(text="Ollama is running")

    async def version(self, request: web.Request) -> web.Response:
        return json_response({"version": "0.0.0-fleettop-mock"})

    async def stats(self, request: web.Request) -> web.Response:
        self.state.expire()
        s = self.state
        return json_response({
            "requests": dict(s.requests), "total": sum(s.requests.values()),
            "endpoints": dict(s.endpoints), "loaded": sorted(s.loaded),
            "streams": {k: s.streams[k] for k in ("started", "completed", "aborted", "errors")},
            "in_flight": s.in_flight, "max_in_flight": s.max_in_flight,
        })

    async def request_log(self, request: web.Request) -> web.Response:
        return json_response({"requests": list(self.state.log)})

    async def reset(self, request: web.Request) -> web.Response:
        self.state = MockState()
        return json_response({"ok": True})


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
