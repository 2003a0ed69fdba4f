"""Readiness (`ready:`) and liveness (`health:`) probes of an agent's run."""

from __future__ import annotations

import asyncio
import re
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from fleettop.supervisor.core.agent import AgentRuntime, AgentState

if TYPE_CHECKING:
    from fleettop.supervisor.core.supervisor import Supervisor


async def dependencies_ready(sup: Supervisor, names: list[str]) -> None:
    """Wait for the readiness probes of these agents (those that have one)."""
    for name in names:
        rt = sup.agents[name]
        probe = rt.spec.ready
        if probe is None or rt.ready.is_set() or rt.pid is None:
            continue
        try:
            await asyncio.wait_for(rt.ready.wait(), probe.timeout)
        except TimeoutError:
            sup.emit("agent.warning", name, f"not ready after {probe.timeout:g}s; "
                      "starting its dependents anyway")


async def watch_ready(sup: Supervisor, rt: AgentRuntime, run_id: int) -> None:
    probe = rt.spec.ready
    assert probe is not None
    pattern = re.compile(probe.log) if probe.log else None
    t0 = time.monotonic()
    while rt.run_id == run_id and rt.pid is not None:
        if await probe_once(probe, pattern, rt):
            rt.ready.set()
            sup.emit("agent.ready", rt.name, f"ready after {time.monotonic() - t0:.2f}s",
                      probe=probe.model_dump(exclude_none=True, exclude={"timeout"}))
            return
        await asyncio.sleep(0.05)


async def watch_health(sup: Supervisor, rt: AgentRuntime, run_id: int) -> None:
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
        if rt.run_id != run_id or rt.pid is None or sup._closing:
            return
        # Frozen (it can't answer), stopping, or a freeze/resume under way (the cgroup may
        # be frozen before the state says so): no verdict now.
        if rt.state is not AgentState.RUNNING or rt.op_lock.locked():
            failed = 0
            continue
        since = rt.since
        try:
            ok = await asyncio.wait_for(probe_once(h, None, rt), h.timeout)
        except TimeoutError:
            ok = False
        if (rt.run_id != run_id or rt.state is not AgentState.RUNNING
                or rt.since != since or rt.op_lock.locked()):
            continue  # its state moved while we asked: the answer says nothing
        target = h.tcp or h.http
        if ok:
            if failed:
                sup.emit("agent.healthy", rt.name, f"{target} answers again after "
                          f"{failed} failed check(s)")
            failed = 0
            continue
        failed += 1
        if failed < h.failures:
            sup.emit("agent.warning", rt.name, f"health check failed ({failed}/"
                      f"{h.failures}): {target} did not answer", check=target)
            continue
        sup.emit("agent.unhealthy", rt.name, f"{failed} health checks in a row failed "
                  f"({target}); restarting", check=target, failures=failed)
        await sup.restart_agent(rt.name, why="restarted: health checks failed")
        return


async def probe_once(probe: Any, pattern: re.Pattern[str] | None, rt: AgentRuntime) -> bool:
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
