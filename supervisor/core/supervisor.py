"""The supervisor: runs a fleet's agents as its own children, one cgroup each.

Everything happens on one asyncio loop, in the main thread: agents are spawned from it (so
PR_SET_PDEATHSIG is tied to the thread that lives as long as the supervisor), their exits
arrive through pidfds and their output through non-blocking pipes — no thread per child.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections import deque
from pathlib import Path
from typing import Any

from fleettop.supervisor.base import paths
from fleettop.supervisor.config.fleet import Fleet
from fleettop.supervisor.core import cgroups, freeze, health, proctree, schedule, spawn
from fleettop.supervisor.core.agent import AgentRuntime, AgentState, backoff_delay
from fleettop.supervisor.core.capability import Capability, SkipStart
from fleettop.supervisor.core.events import Event
from fleettop.supervisor.core.reaper import Reaper
from fleettop.supervisor.core.snapshot import fleet_snapshot


class Supervisor:
    def __init__(self, fleet: Fleet, *, state_dir: Path | None = None,
                 use_cgroups: bool = True) -> None:
        self.fleet = fleet
        self.fleet_id = paths.fleet_id(fleet.path or "fleet.yaml")
        self.state_dir = state_dir or paths.state_dir(fleet.path or "fleet.yaml",
                                                      fleet.state_dir)
        self.log_dir = self.state_dir / "logs"
        self.agents: dict[str, AgentRuntime] = {
            name: AgentRuntime(spec) for name, spec in fleet.agents.items()
        }
        self.failed_starts: dict[str, str] = {}
        """Agents whose start failed (no program, no such user, ...): the exit code says so."""
        self.capabilities: list[Capability] = []
        """What plugs into this fleet (proxy, telemetry, GPU gate, web view), in order."""
        self.externals: dict[int, dict[str, Any]] = {}
        self.events: deque[Event] = deque(maxlen=2000)
        self._subscribers: list[asyncio.Queue[Event]] = []
        self._use_cgroups = use_cgroups
        self.cgroup_tree: cgroups.CgroupTree | None = None
        self.cgroup_reason = "cgroups disabled"
        self.reaper: Reaper | None = None
        self.started_at = time.time()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._timers: dict[str, asyncio.TimerHandle | asyncio.Task[Any]] = {}
        self._pidfds: dict[str, int] = {}
        self._pipes: dict[str, list[int]] = {}
        self._exit_waiters: dict[str, asyncio.Event] = {}
        self._start_tasks: dict[str, asyncio.Task[Any]] = {}
        self._cpu_prev: dict[str, tuple[float, float]] = {}
        self._stats_cache: dict[str, tuple[float, dict[str, Any]]] = {}
        self._closing = False
        self.shutdown_requested = asyncio.Event()
        self.shutdown_mode = "stop"
        self.serve_token: str | None = None

    # ---- events -------------------------------------------------------------------------

    def add(self, capability: Capability) -> None:
        """Plug a capability in; it stops in reverse order of adding."""
        self.capabilities.append(capability)

    def emit(self, kind: str, agent: str | None = None, reason: str = "", **data: Any) -> Event:
        event = Event(kind, agent, reason, data)
        self.events.append(event)
        for q in list(self._subscribers):
            try:
                q.put_nowait(event)
            except asyncio.QueueFull:
                # A slow viewer loses its oldest events rather than growing our memory.
                with contextlib.suppress(asyncio.QueueEmpty):
                    q.get_nowait()
                with contextlib.suppress(asyncio.QueueFull):
                    q.put_nowait(event)
        return event

    def subscribe(self, maxsize: int = 1000) -> asyncio.Queue[Event]:
        q: asyncio.Queue[Event] = asyncio.Queue(maxsize=maxsize)
        self._subscribers.append(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[Event]) -> None:
        with contextlib.suppress(ValueError):
            self._subscribers.remove(q)

    def set_state(self, rt: AgentRuntime, new: AgentState, reason: str, **data: Any) -> None:
        """Move an agent through its state machine; every transition is an event."""
        old = rt.transition(new, reason)
        self.emit("agent.state", rt.name, reason, **{"from": old.value, "to": new.value}, **data)

    _set_state = set_state

    # ---- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Set up cgroups and the reaper, then start every enabled agent in dependency order."""
        removed = cgroups.cleanup_stale()
        for path in removed:
            self.emit("fleet.cleanup", None, "removed the cgroup of a dead fleettop",
                      cgroup=str(path))
        if self._use_cgroups:
            self.cgroup_tree, self.cgroup_reason = cgroups.CgroupTree.create(self.fleet_id)
        tree = self.cgroup_tree
        self.reaper = Reaper(tree.fleet_dir if tree else None, tree.v1_memory if tree else None)
        source = "cgroup" if self.cgroup_tree else "process-group"
        self.emit("fleet.started", None, self.cgroup_reason or f"agents in cgroups under "
                  f"{self.cgroup_tree.fleet_dir if self.cgroup_tree else ''}",
                  file=self.fleet.path, agents=len(self.agents), isolation=source)
        for level in self._levels():
            waits = {d for n in level for d in self.agents[n].spec.depends_on}
            await health.dependencies_ready(self, sorted(waits))
            starts = []
            for name in level:
                rt = self.agents[name]
                if not rt.spec.enabled:
                    rt.reason = "disabled in the fleet file"
                    continue
                if rt.spec.schedule:
                    schedule.schedule_next(self, rt)
                else:
                    starts.append(self._start_task(rt, "fleet start"))
            # A start can wait (for the GPU lock): the rest of its level goes on meanwhile,
            # and the next level waits only for its own dependencies, not for the queue.
            if starts:
                await asyncio.wait(starts, timeout=0)
                await asyncio.sleep(0)

    def _levels(self) -> list[list[str]]:
        """Agents grouped so each group's dependencies are all in earlier groups."""
        level: dict[str, int] = {}
        for name in self.fleet.start_order():
            deps = self.fleet.agents[name].depends_on
            level[name] = 1 + max((level[d] for d in deps), default=-1)
        out: list[list[str]] = [[] for _ in range(max(level.values(), default=-1) + 1)]
        for name, lvl in level.items():
            out[lvl].append(name)
        return out

    def _start_task(self, rt: AgentRuntime, why: str) -> asyncio.Task[Any]:
        """Start in a task of its own: a start hook may wait (for the GPU lock), and a stop
        must be able to cancel that wait."""
        task = self._spawn_task(self._start(rt, why))
        self._start_tasks[rt.name] = task
        return task

    async def _start_and_report(self, rt: AgentRuntime, why: str) -> dict[str, Any]:
        task = self._start_task(rt, why)
        await asyncio.wait([task], timeout=1.0)
        if rt.state is AgentState.WAITING:
            return {"ok": True, "state": rt.state.value, "reason": rt.reason}
        return {"ok": rt.state is AgentState.RUNNING, "state": rt.state.value,
                **({} if rt.state is AgentState.RUNNING else {"error": rt.reason})}

    async def _start(self, rt: AgentRuntime, why: str) -> None:
        if rt.state in (AgentState.RUNNING, AgentState.STARTING, AgentState.FROZEN,
                        AgentState.STOPPING):
            return
        rt.stop_requested = False
        for cap in self.capabilities:
            try:
                await cap.before_start(rt)
            except SkipStart as skip:
                self.emit("agent.skipped", rt.name, str(skip))
                if rt.spec.schedule:
                    if rt.state is not AgentState.SCHEDULED:
                        self._set_state(rt, AgentState.SCHEDULED, str(skip))
                    schedule.schedule_next(self, rt)
                return
        self._set_state(rt, AgentState.STARTING, why)
        try:
            spawn.spawn(self, rt)
        except Exception as exc:  # noqa: BLE001 - any spawn failure is reported, not raised
            rt.pid = None
            for cap in self.capabilities:  # e.g. give back a GPU lock taken for this start
                with contextlib.suppress(Exception):
                    cap.after_exit(rt)
            self._set_state(rt, AgentState.FAILED, f"cannot start: {exc}")
            self.failed_starts[rt.name] = str(exc)
            return
        self._set_state(rt, AgentState.RUNNING, why, pid=rt.pid, run=rt.run_id)
        rt.ready.clear()
        if rt.spec.ready is None:
            rt.ready.set()
        else:
            self._spawn_task(health.watch_ready(self, rt, rt.run_id))
        if rt.spec.health is not None:
            self._spawn_task(health.watch_health(self, rt, rt.run_id))
        if rt.spec.schedule:
            schedule.schedule_next(self, rt)  # the next slot is watched even while this run goes on

    def _on_exit(self, rt: AgentRuntime, pid: int) -> None:
        loop = asyncio.get_running_loop()
        pidfd = self._pidfds.pop(rt.name, None)
        if pidfd is not None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        try:
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
        except ChildProcessError:
            code = -1
        if rt.popen is not None:
            rt.popen.returncode = code
        spawn.drain_pipes(self, rt)
        if self.reaper:
            self.reaper.untrack(pid)
        rt.exit_code = code
        rt.pid = None
        ran_for = time.time() - rt.started_at
        desc = f"exit code {code}" if code >= 0 else f"killed by {signal.Signals(-code).name}"
        if rt.log is not None:
            rt.log.note(f"pid {pid} ended: {desc} after {ran_for:.1f}s")
        waiter = self._exit_waiters.pop(rt.name, None)
        for cap in self.capabilities:
            with contextlib.suppress(Exception):
                cap.after_exit(rt)
        self._after_exit(rt, code, ran_for, desc)
        if waiter:
            waiter.set()

    def _after_exit(self, rt: AgentRuntime, code: int, ran_for: float, desc: str) -> None:
        # The tree's other processes die with the run: an agent never leaves orphans.
        self._kill_leftovers(rt)
        if rt.stop_requested or rt.state is AgentState.STOPPING:
            self._set_state(rt, AgentState.STOPPED, f"stopped ({desc})", exit_code=code)
            return
        if rt.state is AgentState.FROZEN:
            # A frozen agent is never restarted by the policy: someone killed it on purpose.
            self._set_state(rt, AgentState.EXITED, f"{desc} while frozen", exit_code=code)
            return
        if rt.spec.schedule:
            self._set_state(rt, AgentState.SCHEDULED, f"last run: {desc}", exit_code=code)
            schedule.schedule_next(self, rt)
            return
        failed = code != 0
        policy = rt.spec.restart
        if ran_for >= rt.spec.backoff.reset_after:
            rt.attempt = 0
            rt.failures.clear()
        if policy == "no" or (policy == "on-failure" and not failed):
            self._set_state(rt, AgentState.EXITED, desc, exit_code=code)
            return
        now = time.time()
        rt.failures.append(now)
        if rt.start_limit_hit(now):
            limit = rt.spec.start_limit
            self._set_state(rt, AgentState.FAILED,
                            f"start limit hit: {limit.burst} exits in {limit.interval:g}s "
                            f"(last: {desc})", exit_code=code)
            return
        delay = backoff_delay(rt.spec, rt.attempt)
        rt.attempt += 1
        self._set_state(rt, AgentState.BACKOFF, f"{desc}; restarting in {delay:.1f}s",
                        exit_code=code, delay=delay)
        rt.next_run = time.time() + delay
        self._timers[rt.name] = asyncio.get_running_loop().call_later(
            delay, self._restart_from_backoff, rt)

    def _restart_from_backoff(self, rt: AgentRuntime) -> None:
        self._timers.pop(rt.name, None)
        if rt.state is AgentState.BACKOFF:
            rt.restarts += 1
            rt.next_run = None
            self._start_task(rt, f"restart #{rt.restarts} ({rt.spec.restart})")

    def _kill_leftovers(self, rt: AgentRuntime) -> None:
        if rt.cgroup is not None and rt.cgroup.exists():
            if cgroups.procs(rt.cgroup):
                if cgroups.is_frozen(rt.cgroup):
                    cgroups.thaw(rt.cgroup)
                cgroups.kill_all(rt.cgroup)
        elif rt.popen is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(rt.popen.pid, signal.SIGKILL)

    def _spawn_task(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- cron -----------------------------------------------------------------------------

    # ---- freeze / resume ----------------------------------------------------------------

    async def freeze_agent(self, name: str, reason: str, source: str = "user",
                           evidence: dict[str, Any] | None = None) -> dict[str, Any]:
        """The one freeze path, whoever asks (user, breaker, leak, spin, governor)."""
        rt = self._agent(name)
        # Freeze and resume of one agent never interleave: a resume that arrives while a
        # freeze waits for the kernel's confirmation must run after it, not be refused.
        async with rt.op_lock:
            return await freeze.freeze(self, rt, reason, source, evidence)

    async def resume_agent(self, name: str, reason: str = "",
                           source: str = "user") -> dict[str, Any]:
        rt = self._agent(name)
        async with rt.op_lock:
            return await freeze.resume(self, rt, reason, source)

    # ---- stop ---------------------------------------------------------------------------

    async def stop_agent(self, name: str, sig: str | None = None,
                         reason: str = "stopped by user") -> dict[str, Any]:
        rt = self._agent(name)
        timer = self._timers.pop(name, None)
        if timer is not None:
            timer.cancel()
        rt.stop_requested = True
        rt.next_run = None
        pending = self._start_tasks.pop(name, None)
        if pending is not None and not pending.done() and rt.pid is None:
            pending.cancel()  # e.g. stop waiting for the GPU lock (its ticket is withdrawn)
            await asyncio.wait([pending], timeout=2.0)
        if rt.pid is None:
            if rt.state not in (AgentState.STOPPED,):
                self._set_state(rt, AgentState.STOPPED, reason)
            return {"ok": True, "state": rt.state.value}
        if rt.state is not AgentState.STOPPING:
            self._set_state(rt, AgentState.STOPPING, reason)
        waiter = self._exit_waiters.get(name)
        signum = signal.Signals[f"SIG{sig or rt.spec.stop_signal}"]
        self._signal_tree(rt, signum)
        if rt.frozen_via:
            # A frozen task keeps its signal pending until thawed.
            if rt.cgroup is not None and rt.frozen_via == "cgroup":
                cgroups.thaw(rt.cgroup)
            elif rt.pid is not None:
                proctree.signal_tree(rt.pid, signal.SIGCONT)
            rt.frozen_via = None
        if waiter is not None:
            try:
                await asyncio.wait_for(waiter.wait(), rt.spec.stop_timeout)
            except TimeoutError:
                self.emit("agent.kill", name, f"still alive {rt.spec.stop_timeout:g}s after "
                          f"SIG{rt.spec.stop_signal}: SIGKILL")
                self._signal_tree(rt, signal.SIGKILL)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiter.wait(), 5.0)
        return {"ok": True, "state": rt.state.value}

    def _signal_tree(self, rt: AgentRuntime, sig: int) -> None:
        if rt.cgroup is not None and rt.cgroup.exists():
            cgroups.kill_all(rt.cgroup, sig)
        if rt.popen is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(rt.popen.pid, sig)

    async def restart_agent(self, name: str,
                            why: str = "restarted by user") -> dict[str, Any]:
        rt = self._agent(name)
        if rt.pid is not None:
            await self.stop_agent(name, reason="restart requested")
        rt.attempt = 0
        rt.restarts += 1
        return await self._start_and_report(rt, why)

    async def reload(self, fleet: Fleet) -> dict[str, Any]:
        """Apply a re-read fleet file: stop agents it no longer has, restart those whose entry
        changed (a frozen one keeps running frozen: its new entry applies at its next start),
        start new ones. Agents whose entry is the same are not touched. Fleet-wide sections
        (proxy, gpu, probes, ...) are read at start: a change there is reported, not applied."""
        old = self.fleet.agents
        removed = [n for n in reversed(self.fleet.start_order()) if n not in fleet.agents]
        changed = [n for n in fleet.start_order() if n in old and fleet.agents[n] != old[n]]
        added = [n for n in fleet.start_order() if n not in old]
        sections = [k for k in type(fleet).model_fields
                    if k not in ("agents", "path", "version")
                    and getattr(fleet, k, None) != getattr(self.fleet, k, None)]
        for name in removed:
            await self.stop_agent(name, reason="removed from the fleet file")
            self.agents.pop(name, None)
        self.fleet = fleet
        for cap in self.capabilities:  # e.g. the proxy learns new agents' settings
            try:
                await cap.after_reload(fleet)
            except Exception as exc:  # noqa: BLE001 - a capability never stops a reload
                self.emit("fleet.warning", None, f"{cap.name} failed to reload: {exc}")
        later: list[str] = []
        for name in changed:
            rt = self.agents[name]
            rt.spec = fleet.agents[name]
            if rt.state is AgentState.FROZEN:
                later.append(name)
            elif not rt.spec.enabled:
                await self.stop_agent(name, reason="disabled in the fleet file")
            elif rt.spec.schedule and rt.pid is None:
                await self.stop_agent(name, reason="schedule changed")
                schedule.schedule_next(self, rt)
            else:
                await self.restart_agent(name, why="its entry in the fleet file changed")
        for name in added:
            rt = self.agents[name] = AgentRuntime(fleet.agents[name])
            if not rt.spec.enabled:
                rt.reason = "disabled in the fleet file"
            elif rt.spec.schedule:
                schedule.schedule_next(self, rt)
            else:
                await health.dependencies_ready(self, sorted(rt.spec.depends_on))
                self._start_task(rt, "added to the fleet file")
        summary = {"added": added, "removed": removed, "changed": changed,
                   "frozen_apply_later": later, "needs_fleettop_restart": sections}
        parts = [f"{k} {', '.join(v)}" for k, v in (("added", added), ("removed", removed),
                                                     ("changed", changed)) if v]
        self.emit("fleet.reloaded", None, "; ".join(parts) or "no agent changed"
                  + (f"; restart fleettop to apply {', '.join(sections)}" if sections else ""),
                  **summary)
        return {"ok": True, **summary}

    async def start_agent(self, name: str) -> dict[str, Any]:
        rt = self._agent(name)
        if rt.pid is not None or rt.state is AgentState.WAITING:
            return {"ok": True, "already": True, "state": rt.state.value}
        timer = self._timers.pop(name, None)
        if timer is not None:
            timer.cancel()
        rt.attempt = 0
        rt.failures.clear()
        return await self._start_and_report(rt, "started by user")

    async def shutdown(self, frozen: str = "stop") -> None:
        """Stop every agent in reverse dependency order, then remove cgroups and the reaper."""
        if self._closing:
            return
        self._closing = True
        for timer in list(self._timers.values()):
            timer.cancel()
        self._timers.clear()
        if frozen == "resume":
            for rt in self.agents.values():
                if rt.state is AgentState.FROZEN:
                    await self.resume_agent(rt.name, "resumed for shutdown")
        for level in reversed(self._levels()):
            await asyncio.gather(*(self.stop_agent(n, reason="fleet shutdown")
                                   for n in level if self.agents[n].pid is not None))
        for rt in self.agents.values():
            if rt.state is not AgentState.STOPPED:
                with contextlib.suppress(Exception):
                    self._set_state(rt, AgentState.STOPPED, "fleet shutdown")
            self._kill_leftovers(rt)
            if rt.log is not None:
                rt.log.close()
        for fds in self._pipes.values():
            for fd in fds:
                with contextlib.suppress(Exception):
                    asyncio.get_running_loop().remove_reader(fd)
                    os.close(fd)
        self._pipes.clear()
        for cap in reversed(self.capabilities):
            try:
                await asyncio.wait_for(cap.stop(), 10.0)
            except Exception as exc:  # noqa: BLE001 - one stuck part must not keep the rest
                self.emit("fleet.warning", None, f"a component did not stop cleanly: {exc!r}")
        if self.cgroup_tree is not None:
            self.cgroup_tree.destroy()
        if self.reaper is not None:
            self.reaper.close()
        self.emit("fleet.stopped", None, "all agents stopped")

    # ---- status ----------------------------------------------------------------------------

    def _agent(self, name: str) -> AgentRuntime:
        try:
            return self.agents[name]
        except KeyError:
            raise KeyError(f"no agent named {name!r}") from None

    def snapshot(self) -> dict[str, Any]:
        """The whole fleet as plain dicts (core/snapshot.py)."""
        return fleet_snapshot(self)
