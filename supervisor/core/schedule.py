"""Cron agents: the next slot from `schedule:`, and what happens when it is due."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime
from typing import TYPE_CHECKING

from croniter import croniter

from fleettop.supervisor.core.agent import TRANSITIONS, AgentRuntime, AgentState

if TYPE_CHECKING:
    from fleettop.supervisor.core.supervisor import Supervisor


def schedule_next(sup: Supervisor, rt: AgentRuntime) -> None:
    assert rt.spec.schedule
    now = datetime.now().astimezone()
    nxt = croniter(rt.spec.schedule, now).get_next(float)
    rt.next_run = nxt
    # A run still going (running, frozen, starting, stopping) keeps its state: the slot is
    # watched, and a due slot is skipped with an event; its exit schedules the next one.
    if rt.state not in (AgentState.SCHEDULED, AgentState.RUNNING) and \
            AgentState.SCHEDULED in TRANSITIONS[rt.state]:
        sup._set_state(rt, AgentState.SCHEDULED, "next run at "
                       + time.strftime("%H:%M:%S", time.localtime(nxt)), next_run=nxt)
    old = sup._timers.pop(rt.name, None)
    if old is not None:
        old.cancel()
    sup._timers[rt.name] = asyncio.get_running_loop().call_later(
        max(0.0, nxt - time.time()), cron_due, sup, rt)


def cron_due(sup: Supervisor, rt: AgentRuntime) -> None:
    sup._timers.pop(rt.name, None)
    if rt.state in (AgentState.RUNNING, AgentState.FROZEN, AgentState.STARTING,
                    AgentState.STOPPING):
        # Never stack runs: the one still going keeps the slot; this one is skipped.
        sup.emit("agent.skipped", rt.name, f"previous run still {rt.state.value} "
                 f"(pid {rt.pid}) when the next was due", due=time.time())
        schedule_next(sup, rt)
        return
    if rt.state is AgentState.STOPPED and rt.stop_requested:
        return
    sup._start_task(rt, "cron schedule")
