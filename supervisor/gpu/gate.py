"""The GPU gate inside the proxy: requests to a local-GPU backend wait for the GPU lock.

Requests for the model already loaded go first (batch by model), but none waits longer than
`max_wait`; the model is only switched once nothing is in flight; the file lock is given back
when the gate is idle, and after `max_wait` of holding when anyone else is queued for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleettop.supervisor.gpu.lock import GpuLock, LockTimeout, status


@dataclass(slots=True)
class GateRequest:
    agent: str
    model: str
    queued_at: float
    admitted: asyncio.Future[None] = field(repr=False)
    admitted_at: float | None = None
    left: bool = False


def pick_next(queue: list[GateRequest], loaded: str | None, now: float,
              max_wait: float) -> GateRequest | None:
    """Oldest request if it has waited `max_wait`; else the oldest for the loaded model; else
    the oldest. Pure: the ordering rule, tested alone."""
    if not queue:
        return None
    if now - queue[0].queued_at >= max_wait:
        return queue[0]
    return next((r for r in queue if r.model == loaded), queue[0])


class GpuGate:
    """One per proxy process; `async with gate.slot(agent, model, wait=...)` per request."""

    def __init__(self, folder: Path, *, max_wait: float = 30.0, max_in_flight: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.folder = Path(folder)
        self.max_wait = max_wait
        self.max_in_flight = max_in_flight
        self.clock = clock
        self.queue: list[GateRequest] = []
        self.loaded: str | None = None
        self.in_flight = 0
        self.lock: GpuLock | None = None
        self.held_since = 0.0
        self._changed = asyncio.Event()
        self._pump_task: asyncio.Task[None] | None = None

    @contextlib.asynccontextmanager
    async def slot(self, agent: str, model: str,
                   wait: float | None = None) -> AsyncIterator[None]:
        """Admission for one request; raises LockTimeout after `wait` seconds queued."""
        req = await self.enter(agent, model, wait)
        try:
            yield
        finally:
            self.leave(req)

    async def enter(self, agent: str, model: str, wait: float | None = None) -> GateRequest:
        """Queue one request and wait for its turn (the proxy's request hook); give the
        result to `leave` when the response is over. Raises LockTimeout after `wait` s."""
        loop = asyncio.get_running_loop()
        req = GateRequest(agent, model, self.clock(), loop.create_future())
        self.queue.append(req)
        self._kick()
        try:
            await asyncio.wait_for(asyncio.shield(req.admitted), wait)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if req.admitted.done() and not req.admitted.cancelled():
                req.left = True
                self.in_flight -= 1
            else:
                req.admitted.cancel()
                if req in self.queue:
                    self.queue.remove(req)
            self._kick()
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise LockTimeout(self.clock() - req.queued_at, None, None) from None
        req.admitted_at = self.clock()
        return req

    def leave(self, req: GateRequest) -> None:
        """The request's response is over (or failed); idempotent."""
        if req.left or not req.admitted.done() or req.admitted.cancelled():
            return
        req.left = True
        self.in_flight -= 1
        self._kick()

    def describe(self) -> dict[str, Any]:
        """What the gate is doing now, for reports."""
        now = self.clock()
        return {"loaded": self.loaded, "in_flight": self.in_flight,
                "holding": self.lock is not None,
                "queue": [{"agent": r.agent, "model": r.model,
                           "waited_s": round(now - r.queued_at, 3)} for r in self.queue]}

    def _kick(self) -> None:
        self._changed.set()
        if self._pump_task is None or self._pump_task.done():
            self._pump_task = asyncio.get_running_loop().create_task(self._pump())

    async def _wait_change(self) -> None:
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), 0.5)

    def _others_waiting(self) -> bool:
        return bool(status(self.folder)["queue"])

    async def _pump(self) -> None:
        while self.queue or self.in_flight:
            nxt = pick_next(self.queue, self.loaded, self.clock(), self.max_wait)
            if nxt is None:
                await self._wait_change()
                continue
            switching = nxt.model != self.loaded
            overdue = self.lock is not None and self.clock() - self.held_since >= self.max_wait
            if switching or overdue or self.in_flight >= self.max_in_flight:
                if self.in_flight:
                    await self._wait_change()  # never evict a model with a request in flight
                    continue
                if self.lock is not None and (switching or self._others_waiting()):
                    self._release()
            if self.lock is None:
                lock = GpuLock(self.folder, name=f"proxy:{nxt.agent}", model=nxt.model)
                await lock.acquire_async()
                self.lock, self.held_since = lock, self.clock()
            if nxt not in self.queue:  # timed out while we waited for the file lock
                continue
            self.queue.remove(nxt)
            self.loaded = nxt.model
            self.in_flight += 1
            nxt.admitted.set_result(None)
        self._release()

    async def idle(self) -> None:
        """Until the gate has nothing queued or in flight and has let the file lock go."""
        while self._pump_task is not None and not self._pump_task.done():
            await asyncio.wait({self._pump_task})

    def _release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None
