"""One agent's runtime: its explicit state machine, restart backoff and start limit."""

from __future__ import annotations

import asyncio
import enum
import random
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleettop.supervisor.config.fleet import AgentSpec

if TYPE_CHECKING:
    import subprocess

    from fleettop.supervisor.core.logs import AgentLog


class AgentState(enum.StrEnum):
    SCHEDULED = "scheduled"
    """Waiting for its next cron time."""
    WAITING = "waiting"
    """Waiting for something before it can start (dependencies, the GPU lock)."""
    STARTING = "starting"
    RUNNING = "running"
    FROZEN = "frozen"
    STOPPING = "stopping"
    STOPPED = "stopped"
    """Stopped on purpose; only a start command brings it back."""
    EXITED = "exited"
    BACKOFF = "backoff"
    FAILED = "failed"
    """Gave up: the start limit was hit, or it could not be started at all."""


# Which transitions are legal; anything else is a bug in the supervisor, caught loudly.
TRANSITIONS: dict[AgentState, set[AgentState]] = {
    AgentState.STOPPED: {AgentState.STARTING, AgentState.SCHEDULED, AgentState.WAITING},
    AgentState.SCHEDULED: {AgentState.STARTING, AgentState.WAITING, AgentState.STOPPED},
    AgentState.WAITING: {AgentState.STARTING, AgentState.STOPPED, AgentState.SCHEDULED,
                         AgentState.FAILED},
    AgentState.STARTING: {AgentState.RUNNING, AgentState.FAILED, AgentState.BACKOFF,
                          AgentState.STOPPED},
    AgentState.RUNNING: {AgentState.FROZEN, AgentState.STOPPING, AgentState.EXITED,
                         AgentState.BACKOFF, AgentState.FAILED, AgentState.SCHEDULED},
    AgentState.FROZEN: {AgentState.RUNNING, AgentState.STOPPING, AgentState.EXITED},
    AgentState.STOPPING: {AgentState.STOPPED},
    AgentState.EXITED: {AgentState.STARTING, AgentState.SCHEDULED, AgentState.STOPPED,
                        AgentState.WAITING},
    AgentState.BACKOFF: {AgentState.STARTING, AgentState.STOPPED, AgentState.WAITING},
    AgentState.FAILED: {AgentState.STARTING, AgentState.STOPPED, AgentState.SCHEDULED,
                        AgentState.WAITING},
}


class IllegalTransition(RuntimeError):
    pass


def backoff_delay(spec: AgentSpec, attempt: int, rng: random.Random | None = None) -> float:
    """Capped exponential delay with ± jitter: initial · factor^attempt, at most `max`."""
    b = spec.backoff
    base = min(b.max, b.initial * (b.factor ** max(attempt, 0)))
    jitter = (rng or random).uniform(-b.jitter, b.jitter) if b.jitter else 0.0
    return max(0.0, min(b.max, base * (1.0 + jitter)))


@dataclass
class AgentRuntime:
    spec: AgentSpec
    state: AgentState = AgentState.STOPPED
    reason: str = "not started"
    since: float = field(default_factory=time.time)
    pid: int | None = None
    popen: subprocess.Popen[bytes] | None = None
    cgroup: Path | None = None
    log: AgentLog | None = None
    restarts: int = 0
    exit_code: int | None = None
    started_at: float = 0.0
    next_run: float | None = None
    attempt: int = 0
    """Consecutive failed runs, for the backoff exponent; reset after a stable run."""
    failures: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    frozen_via: str | None = None
    """How it was frozen: "cgroup" or "signal" (resume must use the same)."""
    trip: dict[str, Any] | None = None
    stop_requested: bool = False
    run_id: int = 0
    op_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Serialises freeze and resume of this agent."""
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the current run passes its readiness probe (at once when it has none)."""

    @property
    def name(self) -> str:
        return self.spec.name

    def transition(self, new: AgentState, reason: str) -> AgentState:
        old = self.state
        if new is not old and new not in TRANSITIONS[old]:
            raise IllegalTransition(f"{self.name}: {old.value} → {new.value} ({reason})")
        self.state, self.reason, self.since = new, reason, time.time()
        return old

    def pids(self) -> list[int]:
        """Every pid of the agent's tree: the cgroup's, else the process group's."""
        from fleettop.supervisor.core import cgroups, proctree

        if self.cgroup is not None and self.cgroup.exists():
            try:
                pids = cgroups.procs(self.cgroup)
            except OSError:
                pids = []
            # Right after spawn the child may not have joined its cgroup yet.
            if pids or self.pid is None:
                return sorted(pids)
        if self.pid is None:
            return []
        return proctree.tree_pids(self.pid)

    def start_limit_hit(self, now: float) -> bool:
        window = self.spec.start_limit.interval
        recent = [t for t in self.failures if now - t <= window]
        return len(recent) >= self.spec.start_limit.burst
