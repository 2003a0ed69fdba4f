"""`gpu: exclusive` agents in a real supervisor: one holds the GPU lock, the next waits."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from fleettop.supervisor.capabilities.gpu import GpuStartGate
from fleettop.supervisor.config.load import parse_fleet
from fleettop.supervisor.core.agent import AgentState
from fleettop.supervisor.core.supervisor import Supervisor
from fleettop.supervisor.gpu.lock import status


async def wait_for(pred, timeout: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out: {what}"
        await asyncio.sleep(0.02)


def supervisor(tmp: Path, agents: dict, gpu: dict | None = None) -> Supervisor:
    text = json.dumps({"agents": agents, **({"gpu": gpu} if gpu else {})})
    (tmp / "fleet.yaml").write_text(text)
    sup = Supervisor(parse_fleet(text, str(tmp / "fleet.yaml")))
    GpuStartGate.install(sup, sup.fleet.gpu)
    return sup


async def test_exclusive_agents_take_turns_on_the_gpu(tmp_path: Path) -> None:
    work = [sys.executable, "-c", "import time; time.sleep(0.8)"]
    sup = supervisor(tmp_path, {
        "first": {"cmd": work, "gpu": "exclusive", "restart": "no"},
        "second": {"cmd": work, "gpu": "exclusive", "restart": "no"},
        "cpu-only": {"cmd": ["sleep", "100"]},
    })
    await sup.start()
    try:
        a, b = sup.agents["first"], sup.agents["second"]
        # start() did not block on the queue: the CPU agent runs while `second` waits.
        assert sup.agents["cpu-only"].state is AgentState.RUNNING
        await wait_for(lambda: {a.state, b.state} == {AgentState.RUNNING, AgentState.WAITING},
                       what="one running, one waiting")
        folder = Path(sup.state_dir) / "gpu"
        st = status(folder)
        assert st["holder"]["name"] in ("first", "second") and len(st["queue"]) == 1
        await wait_for(lambda: a.state is AgentState.EXITED and b.state is AgentState.EXITED,
                       what="both ran")
        order = [(e.kind, e.agent) for e in sup.events if e.kind.startswith("lock.")]
        acquired = [who for kind, who in order if kind == "lock.acquired"]
        released = [who for kind, who in order if kind == "lock.released"]
        assert len(acquired) == 2 and len(released) == 2
        # the second acquire comes only after the first release
        assert order.index(("lock.released", acquired[0])) < order.index(
            ("lock.acquired", acquired[1]))
        assert status(folder)["holder"] is None
    finally:
        await sup.shutdown()


async def test_scheduled_agent_skips_a_run_when_the_lock_times_out(tmp_path: Path) -> None:
    sup = supervisor(tmp_path, {
        "hog": {"cmd": ["sleep", "100"], "gpu": "exclusive"},
        "nightly": {"cmd": ["true"], "gpu": "exclusive", "schedule": "* * * * * *"},
    }, gpu={"lock_timeout": "0.3s"})
    await sup.start()
    try:
        await wait_for(lambda: any(e.kind == "lock.timeout" and e.agent == "nightly"
                                   for e in sup.events), 10, "a lock timeout")
        skipped = [e for e in sup.events if e.kind == "agent.skipped" and e.agent == "nightly"]
        assert skipped and "GPU lock not granted" in skipped[0].reason
        timeout = next(e for e in sup.events if e.kind == "lock.timeout")
        assert "skipped this run, will retry at the next schedule" in timeout.reason
        assert sup.agents["nightly"].state in (AgentState.SCHEDULED, AgentState.WAITING)
        assert sup.agents["hog"].state is AgentState.RUNNING
    finally:
        await sup.shutdown()


async def test_stopping_a_waiting_agent_leaves_the_queue(tmp_path: Path) -> None:
    sup = supervisor(tmp_path, {
        "hog": {"cmd": ["sleep", "100"], "gpu": "exclusive"},
        "patient": {"cmd": ["sleep", "100"], "gpu": "exclusive"},
    })
    await sup.start()
    try:
        waiting = [rt for rt in sup.agents.values() if rt.state is AgentState.WAITING]
        await wait_for(lambda: any(rt.state is AgentState.WAITING for rt in
                                   sup.agents.values()), what="one waiting")
        waiting = next(rt for rt in sup.agents.values() if rt.state is AgentState.WAITING)
        await sup.stop_agent(waiting.name)
        assert waiting.state is AgentState.STOPPED
        folder = Path(sup.state_dir) / "gpu"
        await wait_for(lambda: not status(folder)["queue"], what="ticket gone")
    finally:
        await sup.shutdown()
