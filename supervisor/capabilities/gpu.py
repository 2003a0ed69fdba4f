"""The GPU lock in the supervisor's start path, and the GPU watchdogs of a running fleet.

`GpuStartGate`: an agent with `gpu: exclusive` takes the GPU lock before it starts (state
`waiting` while queued) and gives it back when it exits — crash or kill included: the exit
hook drops the ticket, and if fleettop itself dies the kernel frees the flock. A scheduled
agent whose wait times out is skipped with a `lock.timeout` event ("skipped this run, will
retry at the next schedule"); an always-on agent waits as long as it takes. (Requests of
`gpu: shared` agents wait at the proxy instead: fleettop.supervisor.gpu.gate.)

`GpuWatchdogs`: the VRAM evictor and the governor, run until the fleet stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleettop.supervisor.core.agent import AgentRuntime, AgentState
from fleettop.supervisor.core.capability import Capability, SkipStart
from fleettop.supervisor.gpu.lock import (
    ENV_LOCK_DIR,
    GpuLock,
    LockTimeout,
    fleet_lock_folder,
    status,
)

if TYPE_CHECKING:
    from fleettop.supervisor.config.fleet import AgentSpec
    from fleettop.supervisor.config.gpu import GpuSection
    from fleettop.supervisor.core.supervisor import Supervisor


class GpuStartGate(Capability):
    """`gpu: exclusive` agents hold the fleet's GPU lock for as long as they run."""

    name = "gpu_lock"

    def __init__(self, sup: Supervisor, folder: Path, *, timeout: float = 600.0) -> None:
        self.sup = sup
        self.folder = Path(folder)
        self.timeout = timeout
        self.locks: dict[str, GpuLock] = {}

    @classmethod
    def install(cls, sup: Supervisor, section: GpuSection | None = None) -> GpuStartGate:
        """Plug into a Supervisor; `section` is the fleet's `gpu:`."""
        gate = cls(sup, fleet_lock_folder(sup.state_dir, section),
                   timeout=section.lock_timeout if section is not None else 600.0)
        sup.add(gate)
        return gate

    def agent_env(self, spec: AgentSpec, env: dict[str, str]) -> None:
        env[ENV_LOCK_DIR] = str(self.folder)

    async def before_start(self, rt: AgentRuntime) -> None:
        if rt.spec.gpu != "exclusive" or rt.name in self.locks:
            return
        timeout = self.timeout if rt.spec.schedule else None
        lock = GpuLock(self.folder, name=rt.name, model=None, timeout=timeout)
        ahead = len(status(self.folder)["queue"]) + (1 if status(self.folder)["holder"] else 0)
        self.sup._set_state(rt, AgentState.WAITING, f"waiting for the GPU lock ({ahead} ahead)")
        self.sup.emit("lock.waiting", rt.name, "queued for the GPU lock", ahead=ahead,
                      folder=str(self.folder))
        try:
            await lock.acquire_async()
        except LockTimeout as exc:
            self.sup.emit("lock.timeout", rt.name, "skipped this run, will retry at the next "
                          "schedule", waited=round(exc.waited, 3), holder=exc.holder)
            raise SkipStart(f"GPU lock not granted within {exc.waited:.0f}s") from None
        if rt.stop_requested or rt.state is not AgentState.WAITING:
            lock.release()
            raise SkipStart("stopped while waiting for the GPU lock")
        self.locks[rt.name] = lock
        self.sup.emit("lock.acquired", rt.name, f"GPU lock after {lock.waited or 0:.1f}s",
                      waited=round(lock.waited or 0.0, 3), seq=lock.ticket.seq if lock.ticket
                      else None)

    def after_exit(self, rt: AgentRuntime) -> None:
        self.release(rt.name, "agent exited")

    def release(self, name: str, why: str) -> None:
        lock = self.locks.pop(name, None)
        if lock is None:
            return
        held = time.time() - (lock.acquired_at or time.time())
        lock.release()
        self.sup.emit("lock.released", name, why, held_s=round(held, 3))

    def agent_fields(self, name: str) -> dict[str, Any]:
        return {"gpu_lock": "held"} if name in self.locks else {}

    def snapshot_part(self) -> dict[str, Any]:
        st = status(self.folder)

        def who(t: dict[str, Any]) -> dict[str, Any]:
            return {**t, "agent": t.get("name")}

        holder = st.get("holder")
        return {"lock": {"holder": who(holder) if holder else None,
                         "queue": [who(t) for t in st.get("queue", [])],
                         "folder": st.get("folder")}}


class GpuWatchdogs(Capability):
    """The VRAM evictor and the governor, each a loop until the fleet stops."""

    name = "gpu_watchdogs"

    def __init__(self) -> None:
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def run(self, loop_of: Any) -> None:
        """Start one watchdog: `loop_of(stop_event)` is its coroutine."""
        self._tasks.append(asyncio.get_running_loop().create_task(loop_of(self._stop)))

    async def stop(self) -> None:
        self._stop.set()
        if self._tasks:  # each ends at its next wait; one stuck in a step is cancelled
            await asyncio.wait(self._tasks, timeout=1.0)
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await task
