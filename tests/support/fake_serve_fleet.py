"""A small deterministic FleetClient for the serve tests and bench.

It implements the viewer interface from the contract (snapshot / command / events /
readonly) with no processes: agents are dicts, freeze/resume flip their state and emit the
same events the supervisor would.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import AsyncIterator
from typing import Any

_STATE_CYCLE = ("running", "running", "running", "waiting", "scheduled", "running", "backoff",
                "running", "exited", "frozen")


def make_agent(i: int, name: str | None = None) -> dict[str, Any]:
    name = name or f"agent-{i:02d}"
    return {
        "name": name, "state": _STATE_CYCLE[i % len(_STATE_CYCLE)], "reason": "",
        "pid": 1000 + i, "pids": [1000 + i], "cpu_percent": float(i % 5) * 10.0,
        "rss_bytes": (64 + i) * 1024 * 1024, "source": "fake", "restarts": i % 3,
        "exit_code": None, "next_run": None, "since": 1_700_000_000.0 + i, "priority": 0,
        "tokens_in": 100 * i, "tokens_out": 40 * i, "tokens_per_s": float(i % 9),
        "requests": 3 * i, "cost_usd": 0.001 * i, "vram_bytes": (i % 4) * 256 * 1024 * 1024,
        "loop_score": 0.0, "nprocs": 1 + i % 2, "net_tx_bytes": 10 * i, "net_rx_bytes": 20 * i,
    }


class FakeFleetClient:
    """Deterministic fake fleet: `n` agents, a GPU lock with a queue, one GPU, a governor."""

    def __init__(self, n: int = 3, *, readonly: bool = False) -> None:
        self.readonly = readonly
        self.viewer = False
        self.agents: list[dict[str, Any]] = [make_agent(i) for i in range(n)]
        self.commands: list[dict[str, Any]] = []
        self.recent: list[dict[str, Any]] = []
        self.lock: dict[str, Any] = {
            "holder": self.agents[0]["name"],
            "queue": [{"agent": a["name"], "waited_s": 1.5 * k}
                      for k, a in enumerate(self.agents[1:3], start=1)],
        }
        self.gpus: list[dict[str, Any]] = [{
            "index": 0, "name": "Fake GPU 6GB", "used_bytes": 2 * 1024**3,
            "total_bytes": 6 * 1024**3, "util_percent": 37.0,
            "processes": [{"pid": 1000, "agent": self.agents[0]["name"],
                           "used_bytes": 2 * 1024**3}],
        }]
        self.governor: dict[str, Any] = {"level": 1, "reason": "cache pressure"}
        self._subscribers: list[asyncio.Queue[dict[str, Any]]] = []
        self.snapshot_calls = 0

    # -- FleetClient -----------------------------------------------------------------------
    async def snapshot(self) -> dict[str, Any]:
        self.snapshot_calls += 1
        return copy.deepcopy({
            "version": 1,
            "fleet": {"file": "fake.yaml", "name": "fake", "started_at": 1_700_000_000.0,
                      "cgroup_root": None, "source": "fake"},
            "agents": self.agents, "events": self.recent[-200:], "components": [],
            "lock": self.lock, "gpus": self.gpus, "governor": self.governor,
        })

    async def command(self, req: dict[str, Any]) -> dict[str, Any]:
        self.commands.append(dict(req))
        cmd, name = req.get("cmd"), req.get("name")
        agent = self.find(name)
        if cmd in ("freeze", "resume"):
            if agent is None:
                return {"ok": False, "error": f"unknown agent {name!r}"}
            old = agent["state"]
            agent["state"] = "frozen" if cmd == "freeze" else "running"
            self.emit("agent.frozen" if cmd == "freeze" else "agent.resumed", name,
                      req.get("reason", ""))
            self.emit("agent.state", name, "", **{"from": old, "to": agent["state"]})
            return {"ok": True, "name": name, "state": agent["state"]}
        if cmd == "status":
            return {"ok": True, **(await self.snapshot())}
        return {"ok": False, "error": f"unsupported command {cmd!r}"}

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._subscribers.append(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            self._subscribers.remove(queue)

    # -- test helpers ----------------------------------------------------------------------
    def find(self, name: object) -> dict[str, Any] | None:
        return next((a for a in self.agents if a["name"] == name), None)

    def emit(self, kind: str, agent: str | None = None, reason: str = "",
             **data: Any) -> dict[str, Any]:
        event = {"ts": time.time(), "kind": kind, "agent": agent, "reason": reason,
                 "data": data}
        self.recent.append(event)
        del self.recent[:-200]
        for queue in self._subscribers:
            queue.put_nowait(event)
        return event

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def tick(self, step: int) -> None:
        """Move every number a little, deterministically from `step`."""
        for i, a in enumerate(self.agents):
            if a["state"] == "frozen":
                continue
            a["cpu_percent"] = float((i * 7 + step * 3) % 100)
            a["rss_bytes"] += 4096 * ((i + step) % 3)
            a["tokens_out"] += (i + step) % 5
            a["tokens_per_s"] = float((i + step) % 11)
        self.gpus[0]["util_percent"] = float(step % 100)
