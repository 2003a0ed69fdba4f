"""The token proxy and its circuit breaker as a capability of the supervisor.

- `proxy_env(...)` builds what an agent needs to go through the proxy: HTTP(S)_PROXY in both
  cases with a per-run token, a NO_PROXY that does not exempt loopback, and CA trust for the
  fleettop CA (a bundle of certifi's roots + the CA: SSL_CERT_FILE *replaces* the trust store).
- `ProxyBreaker` writes the proxy's config once (`ProxyConfig`), runs the proxy process
  (`fleettop.probes.proxy.process.ProxyProcess`), gives each agent its env, and turns the
  proxy's reports into `supervisor.emit(...)` and `supervisor.freeze_agent(...,
  source="breaker")` calls. Stats (`proxy.stats`, every second per agent) are kept for the
  agent's row, not emitted as events, so they never flood the event ring. A resume lifts the
  agent's block once, just before the thaw.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import certifi

from fleettop.probes.proxy.config import ProxyConfig
from fleettop.probes.proxy.process import ProxyProcess
from fleettop.supervisor.base.files import atomic_write, atomic_write_json
from fleettop.supervisor.config.proxy import ProxySection
from fleettop.supervisor.core.capability import Capability

if TYPE_CHECKING:
    from fleettop.supervisor.config.fleet import AgentSpec, Fleet
    from fleettop.supervisor.core.supervisor import Supervisor

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


class ProxyBreaker(Capability):
    """Runs the proxy process for one supervisor and relays between them."""

    name = "proxy"

    def __init__(self, supervisor: Supervisor, config: ProxyConfig, state_dir: Path,
                 python: str = sys.executable) -> None:
        self.sup = supervisor
        self.config = config
        self.state_dir = Path(state_dir)
        self.gpu_state: dict[str, Any] = {}
        self.tokens: dict[str, str] = {}
        self.stats: dict[str, dict[str, Any]] = {}
        self.reverse_ports: dict[str, int] = {}
        self.ca_cert: Path | None = None
        self.bundle: Path | None = None
        self.relay = ""  # how the running proxy relays (proxy.ready)
        self.texts: dict[str, str] = {}
        self.requests: dict[str, list[Any]] = {}
        self._chars: dict[str, int] = {}
        self._rates: dict[str, float] = {}
        self._last_out: dict[str, tuple[float, float]] = {}
        self.relaxed: dict[str, tuple[str, float]] = {}
        """Agents resumed with a lower breaker: (policy, until)."""
        self.tokens_file = self.state_dir / "proxy-tokens.json"
        self.config_file = self.state_dir / "proxy-config.json"
        self.process = ProxyProcess(
            self.state_dir, self.config_file, self.tokens_file, host=config.proxy.host,
            port=config.proxy.port, on_report=self.handle, on_notice=self._notice,
            on_ready=self._on_ready, restart_backoff=config.proxy.restart_backoff,
            python=python)

    @classmethod
    def for_fleet(cls, sup: Supervisor) -> ProxyBreaker:
        return cls(sup, ProxyConfig.from_fleet(sup.fleet, sup.state_dir), sup.state_dir / "proxy")

    @property
    def proxy(self) -> ProxySection:
        return self.config.proxy

    @property
    def port(self) -> int | None:
        return self.process.port

    # --- the capability ------------------------------------------------------------------
    def agent_env(self, spec: AgentSpec, env: dict[str, str]) -> None:
        name = spec.name
        if self.port is None or not spec.proxy:
            return
        token = secrets.token_hex(16)  # fresh per agent and run
        self.tokens[name] = token
        atomic_write_json(self.tokens_file, self.tokens, mode=0o600)
        env.update(proxy_env(name, token, self.port, host=self.proxy.host, bundle=self.bundle,
                             ca_cert=self.ca_cert, base_env=env))
        if name in self.reverse_ports:
            env["FLEETTOP_BASE_URL"] = f"http://{self.proxy.host}:{self.reverse_ports[name]}"
        self.release(name)  # a (re)started agent starts unblocked

    def relax_breaker(self, name: str, policy: str, until: float) -> bool:
        if name not in self.tokens and name not in self.stats:
            return False  # this agent does not go through the proxy
        self.relaxed[name] = (policy, until)
        self.send({"cmd": "relax", "agent": name, "policy": policy, "until": until})
        self.sup.emit("breaker.relaxed", name, f"breaker {policy} until "
                      + time.strftime("%H:%M:%S", time.localtime(until)),
                      policy=policy, until=until)
        return True

    async def before_resume(self, name: str) -> None:
        # Lift the block before the thaw, so a resumed agent's next request isn't a 429.
        self.release(name)

    async def after_reload(self, fleet: Fleet) -> None:
        """New per-agent settings after a fleet reload: rewrite the config, tell the proxy.
        The fleet-wide `proxy:` and `breaker:` sections are read at start only."""
        new = ProxyConfig.from_fleet(fleet, self.sup.state_dir)
        self.config = new.model_copy(update={"proxy": self.config.proxy,
                                             "breaker": self.config.breaker,
                                             "reverse": self.config.reverse})
        self.config.write(self.config_file)
        self.send({"cmd": "reload"})

    def agent_fields(self, name: str) -> dict[str, Any]:
        relaxed = self.relaxed.get(name)
        extra: dict[str, Any] = {}
        if relaxed is not None and relaxed[1] > time.time():
            extra["breaker_relaxed"] = {"policy": relaxed[0], "until": relaxed[1]}
        stats = self.stats.get(name)
        if not stats:
            return extra
        out: dict[str, Any] = {"proxy": {k: stats.get(k) for k in _STAT_FIELDS
                                         if k != "text_tail"}}
        # The flat per-agent fields the UI, the web view and /metrics read.
        out.update(tokens_in=stats.get("tokens_in"), tokens_out=stats.get("tokens_out"),
                   cost_usd=stats.get("cost"), requests=stats.get("requests"),
                   req_per_min=stats.get("req_per_min"), last_model=stats.get("last_model"),
                   blocked=stats.get("blocked"), tokens_per_s=self._rates.get(name),
                   trips=stats.get("trips"), loop_score=stats.get("loop_score"),
                   last_text=self.texts.get(name, ""),
                   last_requests=self.requests.get(name, []))
        return {**out, **extra}

    def component(self) -> dict[str, Any]:
        """The proxy's row in the snapshot's `components` list."""
        return {"state": "running" if self.process.alive else "stopped",
                "pid": self.process.pid, "port": self.port,
                "reverse": dict(self.reverse_ports), "restarts": self.process.restarts,
                "relay": self.relay,
                "blocked": sorted(a for a, s in self.stats.items() if s.get("blocked")),
                "detail": f"{self.proxy.host}:{self.port} ({self.relay})",
                **({"gpu": self.gpu_state} if self.gpu_state else {})}

    async def start(self, ready_s: float = 30.0) -> dict[str, Any]:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.config.write(self.config_file)
        atomic_write_json(self.tokens_file, self.tokens, mode=0o600)
        return await self.process.start(ready_s)

    async def stop(self) -> None:
        await self.process.stop()

    # --- the proxy's reports -------------------------------------------------------------
    def _on_ready(self, ready: dict[str, Any]) -> None:
        self.reverse_ports = {k: int(v) for k, v in (ready.get("reverse") or {}).items()}
        self.ca_cert = Path(ready["ca_cert"])
        relay = "one piece per read" if ready.get("merge_reads") else "chunk by chunk"
        self.relay = f"{relay}, {ready.get('event_loop') or 'asyncio'}"
        self.bundle = write_ca_bundle(self.ca_cert, self.state_dir / "ca-bundle.pem")
        self.sup.emit("proxy.started",
                      reason=f"proxy on {self.proxy.host}:{self.port} ({self.relay})",
                      port=self.port, pid=ready.get("pid"), reverse=self.reverse_ports)

    def _notice(self, kind: str, reason: str, data: dict[str, Any]) -> None:
        self.sup.emit(kind, reason=reason, **data)

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

    async def handle(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        agent = str(event.get("agent") or "")
        if kind in ("proxy.stats", "proxy.dump") and agent:
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
        if name not in self.sup.agents:
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

    # --- commands ------------------------------------------------------------------------
    def send(self, cmd: dict[str, Any]) -> None:
        self.process.send(cmd)

    def release(self, name: str) -> None:
        self.send({"cmd": "release", "agent": name})

    def dump(self, name: str) -> None:
        self.send({"cmd": "dump", "agent": name})
