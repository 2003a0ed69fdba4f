"""The supervisor: runs a fleet's agents as its own children, one cgroup each.

Everything happens on one asyncio loop, in the main thread: agents are spawned from it (so
PR_SET_PDEATHSIG is tied to the thread that lives as long as the supervisor), their exits
arrive through pidfds and their output through non-blocking pipes — no thread per child.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from croniter import croniter

from fleettop.supervisor.base import paths
from fleettop.supervisor.config.fleet import AgentSpec, Fleet
from fleettop.supervisor.core import cgroups, proctree
from fleettop.supervisor.core.agent import AgentRuntime, AgentState, backoff_delay
from fleettop.supervisor.core.capability import Capability, SkipStart
from fleettop.supervisor.core.events import Event
from fleettop.supervisor.core.logs import AgentLog
from fleettop.supervisor.core.reaper import Reaper

PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
# Joining the cgroup, dropping privileges and PR_SET_PDEATHSIG must happen between fork and
# exec. A Python preexec_fn does that but forces fork() of the whole supervisor and runs
# Python in the child (~7 ms a spawn); `sh` + util-linux `setpriv` do it after a vfork
# (~1 ms), so 200 agents start in a fraction of the time. preexec_fn stays as the fallback.
_SETPRIV = shutil.which("setpriv")
# sh -c SCRIPT sh CGPROCS... -- CMD...: join each cgroup (writing 0 moves the writer), exec.
_JOIN_CGROUPS = ('for f; do [ "$f" = -- ] && break; echo 0 > "$f" || exit 126; shift; done; '
                 'shift; exec "$@"')


def _setpriv_usable() -> bool:
    if _SETPRIV is None or not os.path.exists("/bin/sh"):
        return False
    try:
        out = subprocess.run([_SETPRIV, "--help"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return False
    return "--pdeathsig" in out.stdout and "--init-groups" in out.stdout


SPAWN_VIA_SETPRIV = _setpriv_usable()


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
        self.reaper = Reaper(self.cgroup_tree.fleet_dir if self.cgroup_tree else None)
        source = "cgroup" if self.cgroup_tree else "process-group"
        self.emit("fleet.started", None, self.cgroup_reason or f"agents in cgroups under "
                  f"{self.cgroup_tree.fleet_dir if self.cgroup_tree else ''}",
                  file=self.fleet.path, agents=len(self.agents), isolation=source)
        for level in self._levels():
            waits = {d for n in level for d in self.agents[n].spec.depends_on}
            await self._dependencies_ready(sorted(waits))
            starts = []
            for name in level:
                rt = self.agents[name]
                if not rt.spec.enabled:
                    rt.reason = "disabled in the fleet file"
                    continue
                if rt.spec.schedule:
                    self._schedule_next(rt)
                else:
                    starts.append(self._start_task(rt, "fleet start"))
            # A start can wait (for the GPU lock): the rest of its level goes on meanwhile,
            # and the next level waits only for its own dependencies, not for the queue.
            if starts:
                await asyncio.wait(starts, timeout=0)
                await asyncio.sleep(0)

    async def _dependencies_ready(self, names: list[str]) -> None:
        """Wait for the readiness probes of these agents (those that have one)."""
        for name in names:
            rt = self.agents[name]
            probe = rt.spec.ready
            if probe is None or rt.ready.is_set() or rt.pid is None:
                continue
            try:
                await asyncio.wait_for(rt.ready.wait(), probe.timeout)
            except TimeoutError:
                self.emit("agent.warning", name, f"not ready after {probe.timeout:g}s; "
                          "starting its dependents anyway")

    async def _watch_ready(self, rt: AgentRuntime, run_id: int) -> None:
        probe = rt.spec.ready
        assert probe is not None
        pattern = re.compile(probe.log) if probe.log else None
        t0 = time.monotonic()
        while rt.run_id == run_id and rt.pid is not None:
            if await _probe_once(probe, pattern, rt):
                rt.ready.set()
                self.emit("agent.ready", rt.name, f"ready after {time.monotonic() - t0:.2f}s",
                          probe=probe.model_dump(exclude_none=True, exclude={"timeout"}))
                return
            await asyncio.sleep(0.05)

    async def _watch_health(self, rt: AgentRuntime, run_id: int) -> None:
        """Liveness for one run: `failures` failed checks in a row → restart."""
        h = rt.spec.health
        assert h is not None
        await asyncio.sleep(h.start_after)
        while not rt.ready.is_set():  # no point asking before it said it is up
            if rt.run_id != run_id or rt.pid is None:
                return
            await asyncio.sleep(0.2)
        failed = 0
        while True:
            await asyncio.sleep(h.interval)
            if rt.run_id != run_id or rt.pid is None or self._closing:
                return
            # Frozen (it can't answer), stopping, or a freeze/resume under way (the cgroup may
            # be frozen before the state says so): no verdict now.
            if rt.state is not AgentState.RUNNING or rt.op_lock.locked():
                failed = 0
                continue
            since = rt.since
            try:
                ok = await asyncio.wait_for(_probe_once(h, None, rt), h.timeout)
            except TimeoutError:
                ok = False
            if (rt.run_id != run_id or rt.state is not AgentState.RUNNING
                    or rt.since != since or rt.op_lock.locked()):
                continue  # its state moved while we asked: the answer says nothing
            target = h.tcp or h.http
            if ok:
                if failed:
                    self.emit("agent.healthy", rt.name, f"{target} answers again after "
                              f"{failed} failed check(s)")
                failed = 0
                continue
            failed += 1
            if failed < h.failures:
                self.emit("agent.warning", rt.name, f"health check failed ({failed}/"
                          f"{h.failures}): {target} did not answer", check=target)
                continue
            self.emit("agent.unhealthy", rt.name, f"{failed} health checks in a row failed "
                      f"({target}); restarting", check=target, failures=failed)
            await self.restart_agent(rt.name, why="restarted: health checks failed")
            return

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
                    self._schedule_next(rt)
                return
        self._set_state(rt, AgentState.STARTING, why)
        try:
            self._spawn(rt)
        except Exception as exc:  # noqa: BLE001 - any spawn failure is reported, not raised
            rt.pid = None
            for cap in self.capabilities:  # e.g. give back a GPU lock taken for this start
                with contextlib.suppress(Exception):
                    cap.after_exit(rt)
            self._set_state(rt, AgentState.FAILED, f"cannot start: {exc}")
            return
        self._set_state(rt, AgentState.RUNNING, why, pid=rt.pid, run=rt.run_id)
        rt.ready.clear()
        if rt.spec.ready is None:
            rt.ready.set()
        else:
            self._spawn_task(self._watch_ready(rt, rt.run_id))
        if rt.spec.health is not None:
            self._spawn_task(self._watch_health(rt, rt.run_id))
        if rt.spec.schedule:
            self._schedule_next(rt)  # the next slot is watched even while this run goes on

    def _resolve_user(self, spec: AgentSpec) -> tuple[pwd.struct_passwd | None, str]:
        """Which user an agent runs as, and a warning when that is root by default."""
        if os.geteuid() != 0:
            if spec.user and spec.user != pwd.getpwuid(os.geteuid()).pw_name:
                raise PermissionError(f"user {spec.user!r} needs fleettop to run as root")
            return None, ""
        name = spec.user or os.environ.get("SUDO_USER")
        if not name and self.fleet.path:
            with contextlib.suppress(OSError, KeyError):
                owner = pwd.getpwuid(Path(self.fleet.path).stat().st_uid)
                if owner.pw_uid != 0:
                    name = owner.pw_name
        if not name:
            return None, "runs as root: no `user:`, no sudo invoker, fleet file owned by root"
        entry = pwd.getpwnam(name)
        return (None, "") if entry.pw_uid == 0 else (entry, "")

    def _env(self, rt: AgentRuntime, user: pwd.struct_passwd | None) -> dict[str, str]:
        env = dict(os.environ)
        if user is not None:
            env.update(HOME=user.pw_dir, USER=user.pw_name, LOGNAME=user.pw_name)
        env.update(rt.spec.env)
        env["FLEETTOP_AGENT"] = rt.name
        env["FLEETTOP_FLEET"] = self.fleet_id
        env.setdefault("PYTHONUNBUFFERED", "1")
        for cap in self.capabilities:
            cap.agent_env(rt.spec, env)
        return env

    def _argv(self, spec: AgentSpec) -> list[str]:
        argv = spec.argv()
        # `fleettop` in a cmd means this fleettop, even when its venv isn't on PATH.
        if argv and argv[0] == "fleettop":
            own = Path(sys.executable).parent / "fleettop"
            if own.exists():
                argv[0] = str(own)
        return argv

    def _spawn(self, rt: AgentRuntime) -> None:
        spec = rt.spec
        user, warning = self._resolve_user(spec)
        if warning and rt.run_id == 0:
            self.emit("agent.warning", rt.name, warning)
        if rt.log is None:
            rt.log = AgentLog(self.log_dir / f"{rt.name}.log", spec.log.max_bytes,
                              spec.log.backups, spec.log.tail_lines)
        joins: list[str] = []
        """cgroup.procs files the child writes itself into before exec."""
        tree = self.cgroup_tree
        if tree is not None:
            rt.cgroup = tree.agent_dir(rt.name)
            if cgroups.read_events(rt.cgroup).get("frozen"):
                cgroups.thaw(rt.cgroup)
            joins.append(str(rt.cgroup / "cgroup.procs"))
            limit = spec.limits.memory
            if limit is not None:
                why = tree.set_memory_max(rt.cgroup, limit)
                via = "memory.max (cgroup v2)"
                if why:  # hybrid systems keep the memory controller in v1
                    v1, why = tree.v1_memory_dir(rt.name, limit)
                    if v1 is not None:
                        joins.append(str(v1 / "cgroup.procs"))
                        via = f"memory.limit_in_bytes (cgroup v1 {v1})"
                if rt.run_id == 0:
                    if why:
                        self.emit("agent.warning", rt.name, f"limits.memory not enforced: {why}")
                    else:
                        self.emit("agent.limits", rt.name, f"memory limit {limit} bytes via {via}",
                                  memory_bytes=limit)
        elif spec.limits.memory is not None and rt.run_id == 0:
            self.emit("agent.warning", rt.name,
                      f"limits.memory not enforced: {self.cgroup_reason}")
        env = self._env(rt, user)
        cwd = spec.cwd or (str(Path(self.fleet.path).resolve().parent) if self.fleet.path
                           else None)
        uid = user.pw_uid if user else None
        gid = user.pw_gid if user else None
        groups = os.getgrouplist(user.pw_name, user.pw_gid) if user else None
        parent = os.getpid()

        def in_child() -> None:
            # Runs between fork and exec. Order matters: join the cgroup while still root,
            # then drop privileges, then PDEATHSIG (a credential change clears it).
            for procs_file in joins:
                fd = os.open(procs_file, os.O_WRONLY)
                os.write(fd, b"0")
                os.close(fd)
            if uid is not None and gid is not None:
                os.setgroups(groups or [])
                os.setgid(gid)
                os.setuid(uid)
            _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:
                os._exit(1)

        argv = self._argv(spec)
        preexec: Callable[[], None] | None = in_child
        if SPAWN_VIA_SETPRIV:
            _check_executable(argv[0], env.get("PATH", os.defpath), cwd)
            shim = [str(_SETPRIV), "--pdeathsig", "KILL"]
            if uid is not None and gid is not None:
                shim += ["--reuid", str(uid), "--regid", str(gid), "--init-groups"]
            argv = [*shim, "--", *argv]
            if joins:
                argv = ["/bin/sh", "-c", _JOIN_CGROUPS, "sh", *joins, "--", *argv]
            preexec = None
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            popen = subprocess.Popen(
                argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                stdout=out_w, stderr=err_w, start_new_session=True, preexec_fn=preexec,
                close_fds=True,
            )
        finally:
            os.close(out_w)
            os.close(err_w)
        rt.popen, rt.pid = popen, popen.pid
        rt.run_id += 1
        rt.exit_code = None
        rt.started_at = time.time()
        rt.frozen_via = None
        rt.trip = None
        if self.reaper:
            self.reaper.track(popen.pid)
        rt.log.note(f"started pid {popen.pid}: {' '.join(spec.argv())}")
        loop = asyncio.get_running_loop()
        for fd, stream in ((out_r, "out"), (err_r, "err")):
            os.set_blocking(fd, False)
            loop.add_reader(fd, self._on_output, rt, fd, stream)
        self._pipes[rt.name] = [out_r, err_r]
        pidfd = os.pidfd_open(popen.pid)
        self._pidfds[rt.name] = pidfd
        self._exit_waiters[rt.name] = asyncio.Event()
        loop.add_reader(pidfd, self._on_exit, rt, popen.pid)

    def _on_output(self, rt: AgentRuntime, fd: int, stream: str) -> None:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)
            with contextlib.suppress(KeyError, ValueError):
                self._pipes[rt.name].remove(fd)
            return
        if rt.log is not None:
            rt.log.write(data, stream)

    def _drain_pipes(self, rt: AgentRuntime) -> None:
        for fd in list(self._pipes.get(rt.name, [])):
            # Read what's buffered, but a grandchild may still hold the pipe open: don't wait.
            with contextlib.suppress(OSError):
                while True:
                    data = os.read(fd, 65536)
                    if not data:
                        break
                    if rt.log is not None:
                        rt.log.write(data, "out")

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
        self._drain_pipes(rt)
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
            self._schedule_next(rt)
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

    def _schedule_next(self, rt: AgentRuntime) -> None:
        assert rt.spec.schedule
        now = datetime.now().astimezone()
        nxt = croniter(rt.spec.schedule, now).get_next(float)
        rt.next_run = nxt
        if rt.state is not AgentState.SCHEDULED and rt.state is not AgentState.RUNNING:
            self._set_state(rt, AgentState.SCHEDULED, "next run at "
                            + time.strftime("%H:%M:%S", time.localtime(nxt)), next_run=nxt)
        old = self._timers.pop(rt.name, None)
        if old is not None:
            old.cancel()
        self._timers[rt.name] = asyncio.get_running_loop().call_later(
            max(0.0, nxt - time.time()), self._cron_due, rt)

    def _cron_due(self, rt: AgentRuntime) -> None:
        self._timers.pop(rt.name, None)
        if rt.state in (AgentState.RUNNING, AgentState.FROZEN, AgentState.STARTING,
                        AgentState.STOPPING):
            # Never stack runs: the one still going keeps the slot; this one is skipped.
            self.emit("agent.skipped", rt.name, f"previous run still {rt.state.value} "
                      f"(pid {rt.pid}) when the next was due", due=time.time())
            self._schedule_next(rt)
            return
        if rt.state is AgentState.STOPPED and rt.stop_requested:
            return
        self._start_task(rt, "cron schedule")

    # ---- freeze / resume ----------------------------------------------------------------

    async def freeze_agent(self, name: str, reason: str, source: str = "user",
                           evidence: dict[str, Any] | None = None) -> dict[str, Any]:
        """The one freeze path, whoever asks (user, breaker, leak, spin, governor)."""
        rt = self._agent(name)
        # Freeze and resume of one agent never interleave: a resume that arrives while a
        # freeze waits for the kernel's confirmation must run after it, not be refused.
        async with rt.op_lock:
            return await self._freeze(rt, reason, source, evidence)

    async def _freeze(self, rt: AgentRuntime, reason: str, source: str,
                      evidence: dict[str, Any] | None) -> dict[str, Any]:
        name = rt.name
        if rt.state is AgentState.FROZEN:
            return {"ok": True, "already": True, "state": rt.state.value}
        if rt.state is not AgentState.RUNNING:
            return {"ok": False, "error": f"{name} is {rt.state.value}, not running"}
        t0 = time.perf_counter()
        if rt.cgroup is not None:
            await self._joined(rt)
            frozen = cgroups.freeze(rt.cgroup, timeout=0.002)
            if not frozen:
                frozen = await self._await_frozen(rt.cgroup, 1)
            via = "cgroup"
        else:
            assert rt.pid is not None
            proctree.signal_tree(rt.pid, signal.SIGSTOP)
            frozen, via = proctree.wait_stopped(proctree.tree_pids(rt.pid)), "signal"
        latency_ms = (time.perf_counter() - t0) * 1000
        rt.frozen_via = via
        if evidence is not None or source not in ("user", "web"):
            rt.trip = {"kind": source, "reason": reason, "evidence": evidence or {}}
        self._set_state(rt, AgentState.FROZEN, reason, source=source, via=via)
        self.emit("agent.frozen", name, reason, source=source, via=via, pids=rt.pids(),
                  latency_ms=round(latency_ms, 3), confirmed=frozen,
                  evidence=evidence or {})
        return {"ok": True, "state": "frozen", "via": via, "confirmed": frozen,
                "latency_ms": latency_ms}

    async def _joined(self, rt: AgentRuntime) -> None:
        """The spawn shim moves the child into its cgroup right after exec; a freeze asked
        for in that first millisecond waits for it, or it would miss the agent."""
        if time.time() - rt.started_at > 1.0:
            # Long joined (the wait below gives up after 1 s anyway): walking the cgroup
            # cost ~0.2 ms, up to 2 ms, before every freeze.
            return
        deadline = time.monotonic() + 1.0
        # No event to await: the kernel file is the only signal.
        while (rt.pid is not None  # noqa: ASYNC110
               and rt.cgroup is not None and time.monotonic() < deadline
               and rt.pid not in cgroups.procs(rt.cgroup)):
            await asyncio.sleep(0.001)

    async def _await_frozen(self, cg: Path, want: int) -> bool:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            if cgroups.read_events(cg).get("frozen") == want:
                return True
            await asyncio.sleep(0.002)
        return False

    async def resume_agent(self, name: str, reason: str = "",
                           source: str = "user") -> dict[str, Any]:
        rt = self._agent(name)
        async with rt.op_lock:
            return await self._resume(rt, reason, source)

    async def _resume(self, rt: AgentRuntime, reason: str, source: str) -> dict[str, Any]:
        name = rt.name
        if rt.state is not AgentState.FROZEN:
            return {"ok": False, "error": f"{name} is {rt.state.value}, not frozen"}
        for cap in self.capabilities:  # e.g. lift the proxy's block before the agent runs
            with contextlib.suppress(Exception):
                await cap.before_resume(name)
        if rt.frozen_via == "cgroup" and rt.cgroup is not None:
            if not cgroups.thaw(rt.cgroup, timeout=0.002):
                await self._await_frozen(rt.cgroup, 0)
        elif rt.pid is not None:
            proctree.signal_tree(rt.pid, signal.SIGCONT)
        rt.frozen_via = None
        self._set_state(rt, AgentState.RUNNING, reason or f"resumed by {source}",
                        source=source)
        self.emit("agent.resumed", name, reason or f"resumed by {source}", source=source)
        return {"ok": True, "state": "running"}

    def freeze_pid(self, pid: int, reason: str = "by user") -> dict[str, Any]:
        """Freeze a process fleettop did not start (a notebook, a backend server): by signal."""
        if not os.path.exists(f"/proc/{pid}"):
            return {"ok": False, "error": f"no process {pid}"}
        if pid in (os.getpid(), 1):
            return {"ok": False, "error": f"refusing to freeze pid {pid}"}
        n = proctree.signal_tree(pid, signal.SIGSTOP)
        proctree.wait_stopped(proctree.tree_pids(pid))
        comm = _comm(pid)
        self.externals[pid] = {"pid": pid, "name": comm, "state": "frozen", "since": time.time()}
        self.emit("pid.frozen", None, reason, pid=pid, comm=comm, processes=n)
        return {"ok": True, "state": "frozen", "pid": pid, "processes": n}

    def resume_pid(self, pid: int, reason: str = "by user") -> dict[str, Any]:
        if not os.path.exists(f"/proc/{pid}"):
            self.externals.pop(pid, None)
            return {"ok": False, "error": f"no process {pid}"}
        n = proctree.signal_tree(pid, signal.SIGCONT)
        proctree.wait_stopped(proctree.tree_pids(pid), stopped=False)
        self.externals.setdefault(pid, {"pid": pid, "name": _comm(pid)})
        self.externals[pid].update(state="running", since=time.time())
        self.emit("pid.resumed", None, reason, pid=pid, processes=n)
        return {"ok": True, "state": "running", "pid": pid, "processes": n}

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
                self._schedule_next(rt)
            else:
                await self.restart_agent(name, why="its entry in the fleet file changed")
        for name in added:
            rt = self.agents[name] = AgentRuntime(fleet.agents[name])
            if not rt.spec.enabled:
                rt.reason = "disabled in the fleet file"
            elif rt.spec.schedule:
                self._schedule_next(rt)
            else:
                await self._dependencies_ready(sorted(rt.spec.depends_on))
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

    def _basic_stats(self, rt: AgentRuntime) -> dict[str, Any]:
        """CPU% and RSS of the whole tree from procfs, cached for a second."""
        now = time.monotonic()
        cached = self._stats_cache.get(rt.name)
        if cached and now - cached[0] < 1.0:
            return cached[1]
        pids = rt.pids() if rt.pid is not None else []
        ticks = proctree.cpu_ticks(pids) / os.sysconf("SC_CLK_TCK")
        prev = self._cpu_prev.get(rt.name)
        cpu = 0.0
        if prev and now > prev[0] and ticks >= prev[1]:
            cpu = 100.0 * (ticks - prev[1]) / (now - prev[0])
        self._cpu_prev[rt.name] = (now, ticks)
        stats = {"pids": pids, "cpu_percent": round(cpu, 1),
                 "rss_bytes": proctree.rss_bytes(pids), "source": "procfs"}
        self._stats_cache[rt.name] = (now, stats)
        return stats

    def agent_status(self, rt: AgentRuntime) -> dict[str, Any]:
        row: dict[str, Any] = {
            "name": rt.name, "state": rt.state.value, "reason": rt.reason, "pid": rt.pid,
            "since": rt.since, "restarts": rt.restarts, "exit_code": rt.exit_code,
            "next_run": rt.next_run, "priority": rt.spec.priority,
            "schedule": rt.spec.schedule, "cgroup": str(rt.cgroup) if rt.cgroup else None,
            "frozen_via": rt.frozen_via, "trip": rt.trip,
        }
        for cap in self.capabilities:
            with contextlib.suppress(Exception):
                row.update(cap.agent_fields(rt.name))
        if "cpu_percent" not in row:  # no telemetry source for it: walk procfs ourselves
            row.update(self._basic_stats(rt))
        if "pids" not in row:
            row["pids"] = rt.pids() if rt.pid is not None else []
        return row

    def _components(self) -> list[dict[str, Any]]:
        rows = []
        for cap in self.capabilities:
            with contextlib.suppress(Exception):
                row = cap.component()
                if row is not None:
                    rows.append({"name": cap.name, **row})
        return rows

    def snapshot(self) -> dict[str, Any]:
        snap: dict[str, Any] = {
            "version": 1,
            "fleet": {"file": self.fleet.path, "name": self.fleet.name or self.fleet_id,
                      "started_at": self.started_at, "pid": os.getpid(),
                      "cgroup_root": str(self.cgroup_tree.fleet_dir) if self.cgroup_tree
                      else None, "isolation_reason": self.cgroup_reason,
                      "state_dir": str(self.state_dir)},
            "agents": [self.agent_status(rt) for rt in self.agents.values()],
            "external": [dict(v) for v in self.externals.values()],
            "events": [e.to_json() for e in list(self.events)[-200:]],
            "components": self._components(),
        }
        for cap in self.capabilities:
            with contextlib.suppress(Exception):
                snap.update(cap.snapshot_part())
        return snap


async def _probe_once(probe: Any, pattern: re.Pattern[str] | None, rt: AgentRuntime) -> bool:
    if pattern is not None:
        return rt.log is not None and any(pattern.search(line) for line in rt.log.lines(200))
    if probe.tcp:
        host, _, port = probe.tcp.rpartition(":")
        target = (host.strip("[]"), int(port))
        request = None
    else:
        url = urlsplit(probe.http)
        target = (url.hostname or "127.0.0.1", url.port or 80)
        request = (f"GET {url.path or '/'}{'?' + url.query if url.query else ''} HTTP/1.0\r\n"
                   f"Host: {url.netloc}\r\n\r\n").encode()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*target), 1.0)
    except (OSError, TimeoutError):
        return False
    try:
        if request is None:
            return True
        writer.write(request)
        await writer.drain()
        return (await asyncio.wait_for(reader.read(5), 2.0)) == b"HTTP/"
    except (OSError, TimeoutError):
        return False
    finally:
        writer.close()


def _check_executable(cmd: str, path: str, cwd: str | None) -> None:
    """Fail a start up front, as exec would, when the command can't be run."""
    if "/" in cmd:
        full = os.path.join(cwd or ".", cmd)
        if not os.access(full, os.X_OK) or os.path.isdir(full):
            raise FileNotFoundError(f"{cmd}: not an executable file")
    elif shutil.which(cmd, path=path) is None:
        raise FileNotFoundError(f"{cmd}: command not found on PATH")




def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return "?"
