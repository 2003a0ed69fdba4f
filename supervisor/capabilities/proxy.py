"""The supervisor's side of the token proxy: agent env, the proxy process, its reports.

- `proxy_env(...)` builds what an agent needs to go through the proxy: HTTP(S)_PROXY in both
  cases with a per-run token, a NO_PROXY that does not exempt loopback, and CA trust for the
  fleettop CA (a bundle of certifi's roots + the CA: SSL_CERT_FILE *replaces* the trust store).
- `ProxyLink` starts `python -m fleettop.probes.proxy.main`, restarts it if it dies, registers
  `env_hook`/`status_hook` on the supervisor, and turns the proxy's JSON-line reports into
  `supervisor.emit(...)` and `supervisor.freeze_agent(..., source="breaker")` calls. Stats
  (`proxy.stats`, every second per agent) are kept for `status_hook`, not emitted as events, so
  they never flood the event ring. An `agent.resumed` event releases that agent's block.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import certifi

from fleettop.supervisor.base import jsonlines
from fleettop.supervisor.base.files import atomic_write, atomic_write_json
from fleettop.supervisor.config.proxy import BreakerSection, ProxySection

_LOOPBACK = {"localhost", "127.0.0.1", "::1", "[::1]", "127.0.0.0/8", "0.0.0.0", "*"}
_GPU_EVENTS = {"gpu.waited", "gpu.timeout", "route.changed", "route.failed", "governor.shrunk"}
"""Reports from the proxy's GPU addon that become fleet events as they are."""
_STAT_FIELDS = ("tokens_in", "tokens_out", "cost", "req_per_min", "requests", "last_model",
                "blocked", "active_streams", "trips", "loop_score", "text_tail")


def write_ca_bundle(ca_cert: Path, out: Path) -> Path:
    """certifi's roots + the fleettop CA, for SSL_CERT_FILE / REQUESTS_CA_BUNDLE."""
    data = Path(certifi.where()).read_bytes().rstrip() + b"\n" + ca_cert.read_bytes()
    return atomic_write(out, data)


def proxy_env(agent: str, token: str, port: int, *, host: str = "127.0.0.1",
              bundle: Path | None = None, ca_cert: Path | None = None,
              base_env: dict[str, str] | None = None) -> dict[str, str]:
    """The variables that point one agent at the proxy (merge them into its env)."""
    url = f"http://{agent}:{token}@{'[' + host + ']' if ':' in host else host}:{port}"
    env = {k: url for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")}
    base = base_env if base_env is not None else dict(os.environ)
    keep = [h for h in (base.get("NO_PROXY") or base.get("no_proxy") or "").split(",")
            if h.strip() and h.strip().lower() not in _LOOPBACK]
    env["NO_PROXY"] = env["no_proxy"] = ",".join(keep)  # loopback backends go through us too
    if bundle is not None:
        env["SSL_CERT_FILE"] = env["REQUESTS_CA_BUNDLE"] = env["CURL_CA_BUNDLE"] = str(bundle)
    if ca_cert is not None:
        env["NODE_EXTRA_CA_CERTS"] = str(ca_cert)
    env["FLEETTOP_AGENT"] = agent
    return env


class ProxyLink:
    """Runs the proxy process for one supervisor and relays between them."""

    def __init__(self, supervisor: Any, proxy: ProxySection, breaker: BreakerSection,
                 state_dir: Path, agent_breakers: dict[str, Any] | None = None,
                 python: str = sys.executable, gpu: dict[str, Any] | None = None) -> None:
        self.sup = supervisor
        self.proxy = proxy
        self.breaker = breaker
        self.state_dir = Path(state_dir)
        self.agent_breakers = {k: v for k, v in (agent_breakers or {}).items() if v is not None}
        self.python = python
        self.gpu = gpu or {}
        """The GPU addon's config (probes/proxy/gpu.py): lock folder, GPU backends, agents'
        gpu modes, governor state and activity files, models and routes."""
        self.gpu_state: dict[str, Any] = {}
        self.tokens: dict[str, str] = {}
        self.stats: dict[str, dict[str, Any]] = {}
        self.port: int | None = None
        self.reverse_ports: dict[str, int] = {}
        self.ca_cert: Path | None = None
        self.bundle: Path | None = None
        self.restarts = 0
        self._proc: asyncio.subprocess.Process | None = None
        self._ready: asyncio.Future[dict[str, Any]] | None = None
        self.relay = ""  # how the running proxy relays (proxy.ready)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopping = False
        self.texts: dict[str, str] = {}
        self.requests: dict[str, list[Any]] = {}
        self._chars: dict[str, int] = {}
        self._rates: dict[str, float] = {}
        self._last_out: dict[str, tuple[float, float]] = {}
        self.tokens_file = self.state_dir / "proxy-tokens.json"
        self.config_file = self.state_dir / "proxy-config.json"

    # --- wiring into the supervisor ------------------------------------------------------
    def register(self) -> None:
        self.sup.env_hooks.append(self.env_hook)
        self.sup.status_hooks.append(self.status_hook)
        # Lift the block before the thaw, so a resumed agent's next request isn't a 429.
        resume_hooks = getattr(self.sup, "resume_hooks", None)
        if resume_hooks is not None:
            resume_hooks.append(self.release)

    def env_hook(self, spec: Any, env: dict[str, str]) -> None:
        name = spec.name if hasattr(spec, "name") else str(spec)
        if self.port is None or not getattr(spec, "proxy", True):
            return
        token = secrets.token_hex(16)  # fresh per agent and run
        self.tokens[name] = token
        self._write_private(self.tokens_file, self.tokens)
        env.update(proxy_env(name, token, self.port, host=self.proxy.host, bundle=self.bundle,
                             ca_cert=self.ca_cert, base_env=env))
        if name in self.reverse_ports:
            env["FLEETTOP_BASE_URL"] = f"http://{self.proxy.host}:{self.reverse_ports[name]}"
        self.release(name)  # a (re)started agent starts unblocked

    def status_hook(self, name: str) -> dict[str, Any]:
        stats = self.stats.get(name)
        if not stats:
            return {}
        out = {"proxy": {k: stats.get(k) for k in _STAT_FIELDS if k != "text_tail"}}
        # The flat per-agent fields the UI, the web view and /metrics read.
        out.update(tokens_in=stats.get("tokens_in"), tokens_out=stats.get("tokens_out"),
                   cost_usd=stats.get("cost"), requests=stats.get("requests"),
                   req_per_min=stats.get("req_per_min"), last_model=stats.get("last_model"),
                   blocked=stats.get("blocked"), tokens_per_s=self._rates.get(name),
                   trips=stats.get("trips"), loop_score=stats.get("loop_score"),
                   last_text=self.texts.get(name, ""),
                   last_requests=self.requests.get(name, []))
        return out

    def _remember(self, name: str, event: dict[str, Any]) -> None:
        """Rebuild each agent's last ~16 KiB of text from the 1 KiB tails in its reports."""
        if event.get("event") == "proxy.dump" and isinstance(event.get("text"), str):
            self.texts[name] = event["text"]
            self.requests[name] = list(event.get("recent_requests") or [])
            self._chars[name] = int(event.get("text_chars") or 0)
            return
        total = int(event.get("text_chars") or 0)
        prev = self._chars.get(name, 0)
        tail = event.get("text_tail")
        if isinstance(tail, str) and total > prev:
            new = total - prev
            text = self.texts.get(name, "")
            text = text + tail[-new:] if new <= len(tail) else text + "\n[…]\n" + tail
            self.texts[name] = text[-self.proxy.ring_bytes:]
        self._chars[name] = total
        now = float(event.get("ts") or 0.0)
        out = float(event.get("tokens_out") or 0)
        last = self._last_out.get(name)
        if last is not None and now > last[0]:
            self._rates[name] = round(max(0.0, out - last[1]) / (now - last[0]), 1)
        self._last_out[name] = (now, out)

    def component(self) -> dict[str, Any]:
        """The proxy's row in the snapshot's `components` list."""
        proc = self._proc
        alive = proc is not None and proc.returncode is None
        return {"name": "proxy", "state": "running" if alive else "stopped",
                "pid": proc.pid if proc is not None else None, "port": self.port,
                "reverse": dict(self.reverse_ports), "restarts": self.restarts,
                "relay": self.relay,
                "blocked": sorted(a for a, s in self.stats.items() if s.get("blocked")),
                **({"gpu": self.gpu_state} if self.gpu_state else {})}

    # --- process -------------------------------------------------------------------------
    def reload(self, agent_breakers: dict[str, Any], gpu: dict[str, Any] | None) -> None:
        """New per-agent settings after a fleet reload: rewrite the config, tell the proxy."""
        self.agent_breakers = {k: v for k, v in agent_breakers.items() if v is not None}
        if gpu is not None:
            self.gpu = gpu
        self._write_private(self.config_file, self._config())
        self.send({"cmd": "reload"})

    def _config(self) -> dict[str, Any]:
        return {
            "proxy": self.proxy.model_dump(mode="json"),
            "breaker": self.breaker.model_dump(mode="json"),
            "agents": {k: v.model_dump(mode="json", exclude_none=True)
                       for k, v in self.agent_breakers.items()},
            "reverse": {a: {"upstream": u, "port": (self.proxy.reverse_base_port + i
                                                    if self.proxy.reverse_base_port else 0)}
                        for i, (a, u) in enumerate(sorted(self.proxy.reverse.items()))},
            "gpu": self.gpu,
            # Known once the proxy is up (it picks the reverse ports); kept across a reload.
            **({"reverse_ports": {str(p): a for a, p in self.reverse_ports.items()}}
               if self.reverse_ports else {}),
        }

    async def start(self, ready_s: float = 30.0) -> dict[str, Any]:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._write_private(self.config_file, self._config())
        self._write_private(self.tokens_file, self.tokens)
        ready = await self._spawn(ready_s)
        self._spawn_task(self._supervise())
        self._spawn_task(self._follow_supervisor())
        return ready

    async def _spawn(self, ready_s: float) -> dict[str, Any]:
        self._ready = asyncio.get_running_loop().create_future()
        args = [self.python, "-m", "fleettop.probes.proxy.main", "--state-dir",
                str(self.state_dir), "--config", str(self.config_file), "--tokens",
                str(self.tokens_file), "--host", self.proxy.host,
                "--port", str(self.port or self.proxy.port)]
        self._proc = await asyncio.create_subprocess_exec(
            *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, limit=16 * 1024 * 1024)
        self._spawn_task(self._read(self._proc))
        ready = await asyncio.wait_for(self._ready, ready_s)
        self.port = int(ready["port"])
        self.reverse_ports = {k: int(v) for k, v in (ready.get("reverse") or {}).items()}
        self.ca_cert = Path(ready["ca_cert"])
        relay = "one piece per read" if ready.get("merge_reads") else "chunk by chunk"
        self.relay = f"{relay}, {ready.get('event_loop') or 'asyncio'}"
        self.bundle = write_ca_bundle(self.ca_cert, self.state_dir / "ca-bundle.pem")
        self.sup.emit("proxy.started",
                      reason=f"proxy on {self.proxy.host}:{self.port} ({self.relay})",
                      port=self.port, pid=ready.get("pid"), reverse=self.reverse_ports)
        return ready

    async def _supervise(self) -> None:
        while not self._stopping:
            proc = self._proc
            if proc is None:
                return
            code = await proc.wait()
            if self._stopping:
                return
            self.sup.emit("proxy.exited", reason=f"proxy exited with {code}; restarting",
                          exit_code=code)
            await asyncio.sleep(self.proxy.restart_backoff * min(2 ** self.restarts, 30))
            self.restarts += 1
            try:
                await self._spawn(30.0)  # same port: agents' env stays valid
            except (TimeoutError, OSError) as exc:
                self.sup.emit("proxy.failed", reason=f"proxy restart failed: {exc}")

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            event = jsonlines.decode(line)
            if event is None:
                continue
            try:
                await self.handle(event)
            except Exception as exc:  # a report must never kill the link
                self.sup.emit("proxy.error", reason=f"cannot handle proxy report: {exc}")

    async def handle(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        agent = event.get("agent")
        if kind == "proxy.ready":
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(event)
        elif kind in ("proxy.stats", "proxy.dump"):
            self.stats[agent] = event
            self._remember(agent, event)
        elif kind == "breaker.trip":
            await self._on_trip(event)
        elif kind == "proxy.released":
            self.sup.emit("breaker.released", agent=agent, reason="proxy block cleared")
        elif kind == "proxy.gpu":
            self.gpu_state = {k: v for k, v in event.items() if k != "event"}
        elif kind in _GPU_EVENTS:
            data = {k: v for k, v in event.items() if k not in ("event", "agent", "reason", "ts")}
            self.sup.emit(kind, agent=agent, reason=str(event.get("reason") or ""), **data)

    async def _on_trip(self, event: dict[str, Any]) -> None:
        name, policy = event["agent"], event.get("policy", "block")
        evidence = {"kind": event.get("kind"), "policy": policy, **(event.get("evidence") or {}),
                    "at_char": event.get("at_char"), "at_request": event.get("at_request"),
                    "incident": event.get("incident"), "text_tail": event.get("text_tail")}
        reason = f"{event.get('kind')}: {event.get('reason')}"
        self.sup.emit("breaker.trip", agent=name, reason=reason, trip_kind=event.get("kind"),
                      policy=policy, evidence=evidence, incident=event.get("incident"),
                      proxy_mono_ns=event.get("mono_ns"), link_mono_ns=time.monotonic_ns())
        if name not in getattr(self.sup, "agents", {name: None}):
            return
        try:
            if policy == "freeze":
                await self.sup.freeze_agent(name, reason=reason, source="breaker",
                                            evidence=evidence)
            elif policy == "kill":
                await self.sup.stop_agent(name)
        finally:
            # The whole ring and the recent requests, for the inspector: after the freeze,
            # which the dump request (~0.1 ms) and its large reply would only delay.
            self.dump(name)

    async def _follow_supervisor(self) -> None:
        subscribe = getattr(self.sup, "subscribe", None)
        if subscribe is None:
            return
        # Unbounded: Supervisor queues drop their oldest event when full, and a dropped
        # `agent.resumed` would leave that agent blocked (429) after its resume. This task
        # drains the queue at once, so it only grows while the event loop is starved.
        try:
            queue = subscribe(maxsize=0)
        except TypeError:  # a supervisor without the maxsize parameter
            queue = subscribe()
        try:
            while True:
                ev = await queue.get()
                if getattr(ev, "kind", None) == "agent.resumed" and ev.agent:
                    self.release(ev.agent)
        finally:
            with contextlib.suppress(Exception):
                self.sup.unsubscribe(queue)

    # --- commands ------------------------------------------------------------------------
    def send(self, cmd: dict[str, Any]) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None or proc.returncode is not None:
            return
        with contextlib.suppress(ConnectionError, RuntimeError):
            proc.stdin.write(jsonlines.encode(cmd))

    def release(self, name: str) -> None:
        self.send({"cmd": "release", "agent": name})

    def dump(self, name: str) -> None:
        self.send({"cmd": "dump", "agent": name})

    async def stop(self) -> None:
        self._stopping = True
        proc = self._proc
        if proc is not None and proc.returncode is None:
            if proc.stdin is not None:
                proc.stdin.close()  # EOF: the proxy shuts down cleanly
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        for task in list(self._tasks):
            task.cancel()

    # --- helpers -------------------------------------------------------------------------
    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    def _write_private(path: Path, data: Any) -> None:
        atomic_write_json(path, data, mode=0o600)
