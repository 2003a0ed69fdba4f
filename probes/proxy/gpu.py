"""fleettop's second mitmproxy addon: the GPU at the proxy — router, lock gate, context caps.

It runs after `FleettopProxy` (which authenticates the agent, parses the body, and may have
answered already: 407, 429) and works on each LLM request in order:

1. Route. `"model": "route:TASK"` — or any model sent to the virtual host `router.fleettop`
   (`base_url="http://router.fleettop/v1"`) — is rewritten to the model the fleet's `routes:`
   pick now (router.route: hardware, GPU queue, servers up, budgets), and the request is sent
   to that model's server. No candidate fits → 503 with every candidate's verdict.
2. Gate. A request from a `gpu: shared` agent to a server in `gpu.backends` waits for the
   fleet's GPU lock on the agent's behalf (gpu_link.GpuGate: batch by model, `batch_max_wait`,
   never switch models with a request in flight). Not admitted within `gpu.lock_timeout` → 503.
   `gpu: exclusive` agents hold the lock for their whole run and go straight through.
3. Cap. While the governor's level calls for `shrink_context`, new requests to local servers
   get `num_ctx` / `max_tokens` capped (governor.shrink_request).
4. Activity. Requests to GPU servers are recorded in the activity file the VRAM watchdog reads
   to know which models are idle (evictor.ActivityTracker): in flight is never evicted.

Config: the `gpu` object of the proxy's config file (written by proxy_link.ProxyLink):
`{lock_dir, lock_timeout, batch_max_wait, max_in_flight, backends: [url], agents: {name:
mode}, governor_state, activity, models, routes, hardware}`. Everything that goes wrong here
answers the one request with a JSON error naming fleettop; nothing escapes into mitmproxy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from mitmproxy import http

from fleettop.probes.proxy.config import GpuConfig
from fleettop.supervisor.gpu import router
from fleettop.supervisor.gpu.evictor import ActivityTracker
from fleettop.supervisor.gpu.gate import GateRequest, GpuGate
from fleettop.supervisor.gpu.governor import read_state, shrink_request
from fleettop.supervisor.gpu.lock import LockTimeout, status

log = logging.getLogger("fleettop.proxy.gpu")
Report = Callable[[dict[str, Any]], None]
ROUTER_HOST = "router.fleettop"
_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}
_DOWN_TTL = 3.0  # seconds a server's up/down verdict is reused
_HW_TTL = 2.0  # seconds the hardware (VRAM free) is reused
_QUEUE_TTL = 0.5  # seconds the lock queue length is reused


def _origin(url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, path) with default ports filled in."""
    u = urlsplit(url)
    scheme = (u.scheme or "http").lower()
    port = u.port or (443 if scheme == "https" else 80)
    return scheme, (u.hostname or "").lower(), port, u.path.rstrip("/")


def upstream_url(base: str, path: str) -> str:
    """The URL for a request whose API path is `path` (`/v1/chat/completions`, `/api/chat`)
    on the server at `base` (`http://h:11434`, `http://h:8000/v1`, `https://h/api/v1`): an
    OpenAI-style base's trailing `/v1` is the request's own `/v1`."""
    base = base.rstrip("/")
    if base.endswith("/v1") and (path.startswith("/v1/") or path.startswith("/api/")):
        base = base[:-3]
    return base + path


@dataclass(slots=True)
class _Spend:
    window_start: float
    requests: int = 0
    tokens: int = 0
    usd: float = 0.0


@dataclass(slots=True)
class _Pass:
    """What this addon did to one flow, undone when it ends."""

    agent: str
    gate: GpuGate | None = None
    slot: GateRequest | None = None
    activity: tuple[str, str] | None = None
    routed: str | None = None  # model entry name the router chose
    waited: float = 0.0


class FleettopGpu:
    def __init__(self, report: Report | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.report: Report = report or (lambda event: None)
        self.clock = clock
        self.cfg = GpuConfig()
        self.gates: dict[str, GpuGate] = {}  # one per lock folder (one folder per fleet)
        self.tracker = ActivityTracker(None)
        self.spend: dict[str, _Spend] = {}
        self.last_choice: dict[str, str] = {}
        self.shrunk_level: dict[str, int] = {}
        self._down: dict[tuple[str, int], tuple[float, bool]] = {}
        self._hw: tuple[float, router.Hardware] | None = None
        self._queue: tuple[float, int] = (-1e9, 0)
        self._gov: tuple[int, Any] = (-1, None)
        self._nvml: Any = None
        self._stats_task: asyncio.Task[None] | None = None
        self.counts = {"routed": 0, "gated": 0, "waited_s": 0.0, "shrunk": 0, "timeouts": 0,
                       "no_route": 0}

    # --- lifecycle -----------------------------------------------------------------------
    def running(self) -> None:
        self._stats_task = asyncio.get_running_loop().create_task(self._stats_loop())

    def done(self) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()

    async def _stats_loop(self) -> None:
        last = None
        while True:
            await asyncio.sleep(self.cfg.stats_interval)
            if not self.cfg.backends and not self.cfg.routes.root:
                continue
            out = self.stats()
            key = json.dumps({k: v for k, v in out.items() if k != "ts"}, sort_keys=True,
                             default=str)
            if key != last:  # only what changed: an idle gate is silent
                last = key
                self.report(out)

    # --- config --------------------------------------------------------------------------
    def apply_config(self, cfg: GpuConfig) -> None:
        """At start and on `reload`: a gate with requests queued or in flight is kept (new
        limits)."""
        self.cfg = cfg
        if self.tracker.path != self.cfg.activity:
            self.tracker = ActivityTracker(self.cfg.activity)
        for folder, gate in list(self.gates.items()):
            if self.cfg.lock_dir is not None and folder == str(self.cfg.lock_dir):
                gate.max_wait = self.cfg.batch_max_wait
                gate.max_in_flight = self.cfg.max_in_flight
            elif not gate.queue and not gate.in_flight:
                del self.gates[folder]

    @property
    def gate(self) -> GpuGate | None:
        folder = self.cfg.lock_dir
        if folder is None:
            return None
        gate = self.gates.get(str(folder))
        if gate is None:
            gate = GpuGate(folder, max_wait=self.cfg.batch_max_wait,
                           max_in_flight=self.cfg.max_in_flight, clock=self.clock)
            self.gates[str(folder)] = gate
        return gate

    # --- hooks ---------------------------------------------------------------------------
    async def request(self, flow: http.HTTPFlow) -> None:
        name = flow.metadata.get("fleettop_agent")
        if name is None or flow.response is not None:
            return
        st = flow.metadata.get("fleettop_flow")
        body = getattr(st, "body", None)
        generation = body is not None
        if body is None and flow.request.method == "POST" and self._gpu_backend(
                flow.request.url) is not None:
            body = _json_body(flow)  # embeddings and the like load models too
        if not isinstance(body, dict) or flow.request.method != "POST":
            if flow.request.host == ROUTER_HOST:
                flow.response = self._router_answer(flow)
            return
        try:
            await self._handle(flow, name, body, generation)
        except Exception as exc:  # never break the relay: one request gets the error
            log.exception("fleettop gpu addon: request handling failed")
            self._finish(flow)
            flow.response = _error(502, "fleettop_gpu", f"fleettop proxy: {exc}")

    async def _handle(self, flow: http.HTTPFlow, name: str, body: dict[str, Any],
                      generation: bool = True) -> None:
        changed = False
        p = _Pass(name)
        flow.metadata["fleettop_gpu"] = p
        model = body.get("model")
        task = router.task_of(model)
        if task is None and flow.request.host == ROUTER_HOST and isinstance(model, str):
            task = model
        if task is not None:
            choice = await self._route(name, task)
            if choice is None:
                flow.response = self._no_route(task)
                return
            router.apply_choice(body, choice)
            flow.request.url = upstream_url(choice.url, flow.request.path)
            self._authorise(flow, choice.entry)
            p.routed = choice.name
            self.counts["routed"] += 1
            changed = True
        model = str(body["model"]) if isinstance(body.get("model"), str) else "?"
        backend = self._gpu_backend(flow.request.url)
        gate = self.gate
        if backend is not None and gate is not None and self.cfg.agents.get(name) == "shared":
            t0 = self.clock()
            try:
                p.slot = await gate.enter(name, model, self.cfg.lock_timeout)
            except LockTimeout as exc:
                self.counts["timeouts"] += 1
                self.report({"event": "gpu.timeout", "agent": name, "model": model,
                             "waited": round(exc.waited, 3), "ts": time.time(),
                             "reason": f"request not admitted to the GPU within "
                                       f"{self.cfg.lock_timeout:.0f}s"})
                flow.response = _error(503, "fleettop_gpu_busy",
                                       f"fleettop: the GPU stayed busy for {exc.waited:.0f}s; "
                                       "try again later", retry_after=30)
                return
            p.gate = gate
            p.waited = self.clock() - t0
            self.counts["gated"] += 1
            self.counts["waited_s"] += p.waited
            if p.waited >= 0.5:
                self.report({"event": "gpu.waited", "agent": name, "model": model,
                             "waited": round(p.waited, 3), "ts": time.time(),
                             "reason": f"waited {p.waited:.1f}s for the GPU"})
        if generation and (backend is not None or self._is_local(flow.request.url)):
            changed |= self._shrink(name, body)
        if backend is not None:
            p.activity = (backend, model)
            self.tracker.begin(backend, model)
        if changed:
            flow.request.content = json.dumps(body).encode()

    def response(self, flow: http.HTTPFlow) -> None:
        self._finish(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._finish(flow)

    def _finish(self, flow: http.HTTPFlow) -> None:
        p: _Pass | None = flow.metadata.pop("fleettop_gpu", None)
        if p is None:
            return
        if p.slot is not None and p.gate is not None:
            p.gate.leave(p.slot)
        if p.activity is not None:
            self.tracker.end(*p.activity)
        if p.routed is not None:
            self._book(p.routed, flow)

    # --- routing -------------------------------------------------------------------------
    async def _route(self, agent: str, task: str) -> router.Choice | None:
        cfg = self.cfg
        rt = cfg.routes.root.get(task)
        names = rt.use if rt is not None else ([task] if task in cfg.models.root else [])
        entries = {n: cfg.models.root[n] for n in names if n in cfg.models.root}
        ups = await asyncio.gather(*(self._up(e.url) for e in entries.values()))
        load = router.Load(gpu_queue=self._queue_len(),
                           down={n for n, up in zip(entries, ups, strict=True) if not up},
                           loaded=self._loaded(entries), spent=self._spent())
        try:
            choice = router.route(task, self._hardware(), cfg.models, cfg.routes, load)
        except router.NoRoute as exc:
            self.counts["no_route"] += 1
            self.report({"event": "route.failed", "agent": agent, "task": task,
                         "reason": str(exc), "ts": time.time(),
                         "verdicts": [{"candidate": c, "verdict": v} for c, v in exc.verdicts]})
            self.last_choice.pop(task, None)
            return None
        if self.last_choice.get(task) != choice.name:
            self.last_choice[task] = choice.name
            why = "; ".join(f"{c}: {v}" for c, v in choice.verdicts[:-1])
            self.report({"event": "route.changed", "agent": agent, "task": task,
                         "ts": time.time(), **choice.to_json(),
                         "reason": f"{task} → {choice.name}" + (f" ({why})" if why else "")})
        return choice

    def _router_answer(self, flow: http.HTTPFlow) -> http.Response:
        """The virtual router host answers what is not a generation itself: its task list
        (`GET /v1/models`, `GET /api/tags`), or a clear 400."""
        path = flow.request.path.split("?")[0].rstrip("/")
        tasks = sorted(self.cfg.routes.root)
        if flow.request.method == "GET" and path.endswith("/models"):
            data = {"object": "list", "data": [{"id": t, "object": "model", "created": 0,
                                                "owned_by": "fleettop-router"} for t in tasks]}
        elif flow.request.method == "GET" and path.endswith("/api/tags"):
            data = {"models": [{"name": t, "model": t} for t in tasks]}
        else:
            return _error(400, "fleettop_router", "fleettop router: send a JSON LLM request "
                          "whose model is a task from routes: (" + ", ".join(tasks) + ")")
        return http.Response.make(200, json.dumps(data).encode(),
                                  {"content-type": "application/json"})

    def _no_route(self, task: str) -> http.Response:
        rt = self.cfg.routes.root.get(task)
        known = ", ".join(sorted(self.cfg.routes.root)) or "none"
        msg = (f"fleettop router: no model for task {task!r} now"
               if rt is not None or task in self.cfg.models.root
               else f"fleettop router: unknown task {task!r} (routes: {known})")
        return _error(503 if rt is not None else 400, "fleettop_no_route", msg)

    async def _up(self, url: str) -> bool:
        _, host, port, _ = _origin(url)
        key = (host, port)
        now = self.clock()
        cached = self._down.get(key)
        if cached is not None and now - cached[0] < _DOWN_TTL:
            return cached[1]
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 0.5)
            writer.close()
            up = True
        except (OSError, TimeoutError):
            up = False
        self._down[key] = (self.clock(), up)
        return up

    def _hardware(self) -> router.Hardware:
        if self.cfg.hardware is not None:
            return router.Hardware(**self.cfg.hardware)
        now = self.clock()
        if self._hw is not None and now - self._hw[0] < _HW_TTL:
            return self._hw[1]
        if self._nvml is None:
            self._nvml = _open_nvml() or False
        hw = router.detect_hardware(self._nvml or _NoGpu())
        self._hw = (now, hw)
        return hw

    def _queue_len(self) -> int:
        now = self.clock()
        if self.cfg.lock_dir is None:
            return 0
        if now - self._queue[0] >= _QUEUE_TTL:
            self._queue = (now, len(status(self.cfg.lock_dir)["queue"]))
        gate = self.gates.get(str(self.cfg.lock_dir))
        return self._queue[1] + (len(gate.queue) if gate is not None else 0)

    def _loaded(self, entries: dict[str, Any]) -> set[str]:
        gate = self.gates.get(str(self.cfg.lock_dir)) if self.cfg.lock_dir else None
        loaded = gate.loaded if gate is not None else None
        return {n for n, e in entries.items() if loaded and (e.model or n) == loaded}

    def _spent(self) -> dict[str, router.Spend]:
        now = time.time()
        out = {}
        for name, s in self.spend.items():
            entry = self.cfg.models.root.get(name)
            period = entry.budget.period if entry is not None and entry.budget else 86400.0
            if now - s.window_start >= period:
                s.window_start, s.requests, s.tokens, s.usd = now, 0, 0, 0.0
            out[name] = router.Spend(s.requests, s.tokens, s.usd)
        return out

    def _book(self, name: str, flow: http.HTTPFlow) -> None:
        s = self.spend.setdefault(name, _Spend(time.time()))
        st = flow.metadata.get("fleettop_flow")
        tokens = int(getattr(st, "booked_in", 0) or 0) + int(getattr(st, "booked_out", 0) or 0)
        entry = self.cfg.models.root.get(name)
        s.requests += 1
        s.tokens += tokens
        s.usd += tokens * (entry.cost if entry is not None else 0.0) / 1e6

    @staticmethod
    def _authorise(flow: http.HTTPFlow, entry: Any) -> None:
        """The chosen model's API key (from the proxy's environment) replaces the agent's."""
        if not entry.api_key_env:
            return
        key = os.environ.get(entry.api_key_env)
        if not key:
            return
        if entry.backend == "anthropic":
            flow.request.headers.pop("authorization", None)
            flow.request.headers["x-api-key"] = key
        else:
            flow.request.headers.pop("x-api-key", None)
            flow.request.headers["authorization"] = f"Bearer {key}"

    # --- gate, caps ----------------------------------------------------------------------
    def _gpu_backend(self, url: str) -> str | None:
        """The configured GPU server this URL goes to (its base URL), if any."""
        scheme, host, port, path = _origin(url)
        for base in self.cfg.backends:
            b_scheme, b_host, b_port, b_path = _origin(base)
            if (b_scheme, b_port) != (scheme, port) or not _same_host(b_host, host):
                continue
            root = b_path[:-3] if b_path.endswith("/v1") else b_path
            if path == root or path.startswith(root + "/"):
                return base.rstrip("/")
        return None

    @staticmethod
    def _is_local(url: str) -> bool:
        return _origin(url)[1] in _LOCAL_HOSTS

    def _governor(self) -> Any:
        path = self.cfg.governor_state
        if path is None:
            return None
        try:
            mtime = os.stat(path).st_mtime_ns
        except OSError:
            return None
        if mtime != self._gov[0]:
            self._gov = (mtime, read_state(path))
        return self._gov[1]

    def _shrink(self, agent: str, body: dict[str, Any]) -> bool:
        gov = self._governor()
        if gov is None or not gov.level or (gov.num_ctx_cap is None
                                            and gov.max_tokens_cap is None):
            self.shrunk_level.pop(agent, None)
            return False
        changes = shrink_request(body, gov.num_ctx_cap, gov.max_tokens_cap)
        if not changes:
            return False
        self.counts["shrunk"] += 1
        if self.shrunk_level.get(agent) != gov.level:  # one event per agent and level
            self.shrunk_level[agent] = gov.level
            self.report({"event": "governor.shrunk", "agent": agent, "level": gov.level,
                         "changes": {k: list(v) for k, v in changes.items()}, "ts": time.time(),
                         "reason": f"level {gov.level}: capped "
                                   + ", ".join(f"{k} {o}→{n}" for k, (o, n) in changes.items())})
        return True

    def stats(self) -> dict[str, Any]:
        gate = self.gates.get(str(self.cfg.lock_dir)) if self.cfg.lock_dir else None
        return {"event": "proxy.gpu", "ts": time.time(),
                "gate": gate.describe() if gate is not None else None,
                "routes": dict(self.last_choice),
                **{k: round(v, 3) if isinstance(v, float) else v for k, v in self.counts.items()}}


class _NoGpu:
    def read_memory(self) -> None:
        return None


def _open_nvml() -> Any:
    from fleettop.probes.sensors.nvml import open_nvml

    return open_nvml()


def _json_body(flow: http.HTTPFlow) -> dict[str, Any] | None:
    """A JSON object body with a model (an endpoint the wire parsers don't know), else None."""
    try:
        body = json.loads(flow.request.get_content(strict=False) or b"")
    except (ValueError, UnicodeDecodeError):
        return None
    return body if isinstance(body, dict) and isinstance(body.get("model"), str) else None


def _same_host(a: str, b: str) -> bool:
    return a == b or (a in _LOCAL_HOSTS and b in _LOCAL_HOSTS)


def _error(status_code: int, kind: str, message: str,
           retry_after: int | None = None) -> http.Response:
    headers = {"content-type": "application/json"}
    if retry_after is not None:
        headers["retry-after"] = str(retry_after)
    body = {"error": {"type": kind, "message": message}}
    return http.Response.make(status_code, json.dumps(body).encode(), headers)
