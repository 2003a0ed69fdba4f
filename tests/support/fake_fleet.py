"""A deterministic fake `FleetClient`: every agent state, a lock queue, GPUs, leak fits, a trip.

Commands are recorded in `commands` and applied to the fake state, so tests can assert both on
what the UI sent and on what it then shows.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from typing import Any

NOW = 1_700_000_000.0
MIB = 1024 * 1024
GIB = 1024 * MIB

LOOP = "I will now check the file again to make sure. "
PROSE = ("The report lists the nightly jobs, their owners and what each one reads. "
         "Summaries go to the shared folder; failures page the on-call engineer. ")


def tripped_text() -> tuple[str, int, int]:
    """≥ 8 KB of generated text ending in a loop; returns (text, span_start, span_end)."""
    head = PROSE * 70
    start = len(head)
    text = head + LOOP * 40
    return text, start, len(text)


STATES = [
    # name, state, extra
    ("summarizer", "running", {}),
    ("coder", "frozen", {"trip": True}),
    ("indexer", "frozen", {"reason": "user"}),
    ("embedder", "waiting", {"reason": "GPU lock"}),
    ("nightly-report", "scheduled", {"next_run": NOW + 3600}),
    ("crawler", "backoff", {"reason": "exit 1, retry in 8s"}),
    ("translator", "exited", {"exit_code": 0}),
    ("scraper", "exited", {"exit_code": 3}),
    ("mailer", "failed", {"reason": "5 restarts in 60s"}),
    ("planner", "starting", {}),
    ("vision", "running", {}),
    ("ocr", "stopped", {}),
]


class FakeFleet:
    """In-memory stand-in for `fleettop.supervisor.control.client.FleetClient`."""

    def __init__(self, n_agents: int | None = None, *, gpu: bool = True,
                 readonly: bool = False, lock: bool = True, leaks: bool = True,
                 viewer: bool = False) -> None:
        self.readonly = readonly
        self.viewer = viewer
        self.commands: list[dict[str, Any]] = []
        """Every command received, in order."""
        self.snapshots = 0
        self.now = NOW
        self.gpu = gpu
        self.with_lock = lock
        self.agents: list[dict[str, Any]] = []
        self._queues: list[asyncio.Queue[dict[str, Any]]] = []
        self.events_log: list[dict[str, Any]] = []
        self.fail_next: str | None = None
        """When set, the next command replies ok=false with this error."""
        n = len(STATES) if n_agents is None else n_agents
        for i in range(n):
            name, state, extra = STATES[i] if i < len(STATES) else (
                f"worker-{i:03d}", "running", {})
            self.agents.append(self._agent(i, name, state, extra, leaks))
        for i, (kind, agent, reason) in enumerate([
            ("agent.state", "summarizer", "started"),
            ("lock.acquired", "vision", "qwen2.5:7b"),
            ("gpu.evicted", None, "llama3:8b idle 300s"),
            ("breaker.trip", "coder", "token loop: 40 repeats"),
            ("agent.frozen", "coder", "breaker: token loop"),
            ("agent.frozen", "indexer", "user"),
            ("governor.level", None, "level 1: shrink context"),
        ]):
            self.events_log.append({"ts": NOW - 300 + i * 30, "kind": kind, "agent": agent,
                                    "reason": reason, "data": {}})

    def _agent(self, i: int, name: str, state: str, extra: dict[str, Any],
               leaks: bool) -> dict[str, Any]:
        live = state in ("running", "frozen", "waiting", "starting")
        a: dict[str, Any] = {
            "name": name, "state": state, "reason": extra.get("reason", ""),
            "pid": 4100 + i * 7 if live else None,
            "pids": [4100 + i * 7, 4101 + i * 7] if live else [],
            "cpu_percent": (12.5 + i % 7) if state == "running" else 0.0,
            "rss_bytes": (180 + 13 * i) * MIB if live else None,
            "source": "ebpf" if i % 3 else "procfs", "restarts": i % 2,
            "exit_code": extra.get("exit_code"), "next_run": extra.get("next_run"),
            "since": NOW - 600, "priority": 0,
            "tokens_per_s": 30.0 + i if state == "running" else 0.0,
            "requests": 10 * i, "cost_usd": 0.013 * i, "loop_score": 0.05 * (i % 4),
            "tokens_in": 1000 * i, "tokens_out": 800 * i, "last_model": "qwen2.5:7b",
            "vram_bytes": 900 * MIB if i % 4 == 0 and live else None,
            "ctx_switches_per_s": 120.0 + i, "faults_per_s": 3.0, "net_tx_bytes": 5000 * i,
            "net_rx_bytes": 90000 * i, "nprocs": 2 if live else 0,
            "last_text": PROSE * 60 if live else None,
            "last_requests": [{"ts": "12:00:01", "model": "qwen2.5:7b", "status": 200,
                               "tokens": 512, "authorization": "[redacted]"}],
            "log_tail": [f"{name}: line {k}" for k in range(3)],
        }
        if extra.get("trip"):
            text, s, e = tripped_text()
            a["last_text"] = text
            a["loop_score"] = 0.97
            a["trip"] = {"kind": "token_loop", "reason": "token loop: 40 repeats of 48 chars",
                         "evidence": {"span_start": s, "span_end": e, "repeats": 40,
                                      "hamming": 0}}
        if leaks and i in (0, 2):
            a["leak_slope_bytes_per_s"] = 2.5 * MIB / 60 if i == 0 else 0.3 * MIB / 60
            a["leak_r2"] = 0.98 if i == 0 else 0.41
            a["leak_time_to_limit_s"] = 420.0 if i == 0 else None
        return a

    # -- FleetClient ------------------------------------------------------------------------

    async def snapshot(self) -> dict[str, Any]:
        self.snapshots += 1
        snap: dict[str, Any] = {
            "version": 1, "now": self.now,
            "fleet": {"file": "fleet.yaml", "name": "demo", "started_at": NOW - 900,
                      "cgroup_root": None, "source": "fake"},
            "agents": copy.deepcopy(self.agents),
            "events": list(self.events_log[-200:]),
            "components": [],
            "governor": {"level": 1, "reason": "cache pressure"},
        }
        if self.with_lock:
            snap["lock"] = {
                "holder": {"agent": "vision", "model": "qwen2.5:7b", "since": self.now - 42},
                "queue": [{"agent": "embedder", "model": "bge-m3", "since": self.now - 30},
                          {"agent": "planner", "model": "llama3:8b", "since": self.now - 5}],
            }
        else:
            snap["lock_reason"] = "gpu lock disabled in fleet.yaml"
        if self.gpu:
            snap["gpus"] = [{"index": 0, "name": "RTX 3060", "used_bytes": int(4.5 * GIB),
                             "total_bytes": 6 * GIB, "util_percent": 63.0,
                             "processes": [{"pid": 4177, "agent": "vision",
                                            "used_bytes": 4 * GIB}]}]
        else:
            snap["gpus"] = []
            snap["gpu_reason"] = "no GPU: NVML library not found"
        snap["leaks"] = {
            a["name"]: {"samples": [a["rss_bytes"] - (20 - k) * 2.5 * MIB for k in range(20)]}
            for a in self.agents if a.get("leak_slope_bytes_per_s") and a.get("rss_bytes")}
        return snap

    async def command(self, req: dict[str, Any]) -> dict[str, Any]:
        self.commands.append(dict(req))
        if self.fail_next:
            err, self.fail_next = self.fail_next, None
            return {"ok": False, "error": err}
        cmd = req.get("cmd")
        if cmd == "logs":
            n = int(req.get("n", 100))
            return {"ok": True, "lines": [f"{req.get('name')} log line {k}" for k in range(n)]}
        if cmd == "shutdown":
            return {"ok": True}
        if "pid" in req:
            return {"ok": True, "pid": req["pid"]}
        agent = next((a for a in self.agents if a["name"] == req.get("name")), None)
        if agent is None:
            return {"ok": False, "error": f"no agent {req.get('name')!r}"}
        new = {"freeze": "frozen", "resume": "running", "stop": "stopped",
               "start": "running", "restart": "running"}.get(str(cmd))
        if new is None:
            return {"ok": False, "error": f"unknown command {cmd!r}"}
        self.set_state(agent["name"], new, reason="user")
        if cmd == "resume":
            agent.pop("trip", None)
        return {"ok": True}

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._queues.append(q)
        try:
            while True:
                yield await q.get()
        finally:
            self._queues.remove(q)

    # -- test helpers -----------------------------------------------------------------------

    def set_state(self, name: str, state: str, reason: str = "") -> None:
        """Change an agent's state as the supervisor would, emitting `agent.state`."""
        agent = next(a for a in self.agents if a["name"] == name)
        old, agent["state"], agent["reason"] = agent["state"], state, reason
        self.now += 1
        ev = {"ts": self.now, "kind": "agent.state", "agent": name, "reason": reason,
              "data": {"from": old, "to": state}}
        self.events_log.append(ev)
        for q in self._queues:
            q.put_nowait(ev)

    def tick(self) -> None:
        """Move every live agent's numbers a little (what a real fleet does between polls)."""
        self.now += 1
        for i, a in enumerate(self.agents):
            if a["state"] == "running":
                a["cpu_percent"] = float((i * 7 + int(self.now)) % 90)
                a["rss_bytes"] = (a["rss_bytes"] or 0) + (MIB if i % 5 == 0 else 0)
                a["tokens_per_s"] = float((i + int(self.now)) % 60)
                a["requests"] += 1
