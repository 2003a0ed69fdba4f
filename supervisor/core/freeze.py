"""The one freeze and thaw path: the cgroup freezer where there is one, else SIGSTOP/SIGCONT to the
process tree; and freezing processes fleettop did not start."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleettop.supervisor.core import cgroups, proctree
from fleettop.supervisor.core.agent import AgentRuntime, AgentState

if TYPE_CHECKING:
    from fleettop.supervisor.core.supervisor import Supervisor


async def freeze(sup: Supervisor, rt: AgentRuntime, reason: str, source: str,
                  evidence: dict[str, Any] | None) -> dict[str, Any]:
    name = rt.name
    if rt.state is AgentState.FROZEN:
        return {"ok": True, "already": True, "state": rt.state.value}
    if rt.state is not AgentState.RUNNING:
        return {"ok": False, "error": f"{name} is {rt.state.value}, not running"}
    t0 = time.perf_counter()
    if rt.cgroup is not None:
        await joined(sup, rt)
        frozen = cgroups.freeze(rt.cgroup, timeout=0.002)
        if not frozen:
            frozen = await await_frozen(sup, rt.cgroup, 1)
        via = "cgroup"
    else:
        assert rt.pid is not None
        proctree.signal_tree(rt.pid, signal.SIGSTOP)
        frozen, via = proctree.wait_stopped(proctree.tree_pids(rt.pid)), "signal"
    latency_ms = (time.perf_counter() - t0) * 1000
    rt.frozen_via = via
    if evidence is not None or source not in ("user", "web"):
        rt.trip = {"kind": source, "reason": reason, "evidence": evidence or {}}
    sup._set_state(rt, AgentState.FROZEN, reason, source=source, via=via)
    sup.emit("agent.frozen", name, reason, source=source, via=via, pids=rt.pids(),
              latency_ms=round(latency_ms, 3), confirmed=frozen,
              evidence=evidence or {})
    return {"ok": True, "state": "frozen", "via": via, "confirmed": frozen,
            "latency_ms": latency_ms}


async def joined(sup: Supervisor, rt: AgentRuntime) -> None:
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


async def await_frozen(sup: Supervisor, cg: Path, want: int) -> bool:
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        if cgroups.read_events(cg).get("frozen") == want:
            return True
        await asyncio.sleep(0.002)
    return False


async def resume(sup: Supervisor, rt: AgentRuntime, reason: str, source: str) -> dict[str, Any]:
    name = rt.name
    if rt.state is not AgentState.FROZEN:
        return {"ok": False, "error": f"{name} is {rt.state.value}, not frozen"}
    for cap in sup.capabilities:  # e.g. lift the proxy's block before the agent runs
        with contextlib.suppress(Exception):
            await cap.before_resume(name)
    if rt.frozen_via == "cgroup" and rt.cgroup is not None:
        if not cgroups.thaw(rt.cgroup, timeout=0.002):
            await await_frozen(sup, rt.cgroup, 0)
    elif rt.pid is not None:
        proctree.signal_tree(rt.pid, signal.SIGCONT)
    rt.frozen_via = None
    sup._set_state(rt, AgentState.RUNNING, reason or f"resumed by {source}",
                    source=source)
    sup.emit("agent.resumed", name, reason or f"resumed by {source}", source=source)
    return {"ok": True, "state": "running"}


def freeze_pid(sup: Supervisor, pid: int, reason: str = "by user") -> dict[str, Any]:
    """Freeze a process fleettop did not start (a notebook, a backend server): by signal."""
    if not os.path.exists(f"/proc/{pid}"):
        return {"ok": False, "error": f"no process {pid}"}
    if pid in (os.getpid(), 1):
        return {"ok": False, "error": f"refusing to freeze pid {pid}"}
    n = proctree.signal_tree(pid, signal.SIGSTOP)
    proctree.wait_stopped(proctree.tree_pids(pid))
    name = comm(pid)
    sup.externals[pid] = {"pid": pid, "name": name, "state": "frozen", "since": time.time()}
    sup.emit("pid.frozen", None, reason, pid=pid, comm=name, processes=n)
    return {"ok": True, "state": "frozen", "pid": pid, "processes": n}


def resume_pid(sup: Supervisor, pid: int, reason: str = "by user") -> dict[str, Any]:
    if not os.path.exists(f"/proc/{pid}"):
        sup.externals.pop(pid, None)
        return {"ok": False, "error": f"no process {pid}"}
    n = proctree.signal_tree(pid, signal.SIGCONT)
    proctree.wait_stopped(proctree.tree_pids(pid), stopped=False)
    sup.externals.setdefault(pid, {"pid": pid, "name": comm(pid)})
    sup.externals[pid].update(state="running", since=time.time())
    sup.emit("pid.resumed", None, reason, pid=pid, processes=n)
    return {"ok": True, "state": "running", "pid": pid, "processes": n}


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return "?"
