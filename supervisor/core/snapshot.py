"""The fleet as plain dicts: what `ctl status`, the UI and the web view show."""

from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING, Any

from fleettop.supervisor.core import proctree
from fleettop.supervisor.core.agent import AgentRuntime

if TYPE_CHECKING:
    from fleettop.supervisor.core.supervisor import Supervisor


def basic_stats(sup: Supervisor, rt: AgentRuntime) -> dict[str, Any]:
    """CPU% and RSS of the whole tree from procfs, cached for a second."""
    now = time.monotonic()
    cached = sup._stats_cache.get(rt.name)
    if cached and now - cached[0] < 1.0:
        return cached[1]
    pids = rt.pids() if rt.pid is not None else []
    ticks = proctree.cpu_ticks(pids) / os.sysconf("SC_CLK_TCK")
    prev = sup._cpu_prev.get(rt.name)
    cpu = 0.0
    if prev and now > prev[0] and ticks >= prev[1]:
        cpu = 100.0 * (ticks - prev[1]) / (now - prev[0])
    sup._cpu_prev[rt.name] = (now, ticks)
    stats = {"pids": pids, "cpu_percent": round(cpu, 1),
             "rss_bytes": proctree.rss_bytes(pids), "source": "procfs"}
    sup._stats_cache[rt.name] = (now, stats)
    return stats


def agent_row(sup: Supervisor, rt: AgentRuntime) -> dict[str, Any]:
    row: dict[str, Any] = {
        "name": rt.name, "state": rt.state.value, "reason": rt.reason, "pid": rt.pid,
        "since": rt.since, "restarts": rt.restarts, "exit_code": rt.exit_code,
        "next_run": rt.next_run, "priority": rt.spec.priority,
        "schedule": rt.spec.schedule, "cgroup": str(rt.cgroup) if rt.cgroup else None,
        "frozen_via": rt.frozen_via, "trip": rt.trip,
        "log_error": rt.log.failing if rt.log is not None else None,
    }
    for cap in sup.capabilities:
        with contextlib.suppress(Exception):
            row.update(cap.agent_fields(rt.name))
    if "cpu_percent" not in row:  # no telemetry source for it: walk procfs ourselves
        row.update(basic_stats(sup, rt))
    if "pids" not in row:
        row["pids"] = rt.pids() if rt.pid is not None else []
    return row


def components(sup: Supervisor) -> list[dict[str, Any]]:
    rows = []
    for cap in sup.capabilities:
        with contextlib.suppress(Exception):
            row = cap.component()
            if row is not None:
                rows.append({"name": cap.name, **row})
    return rows


def fleet_snapshot(sup: Supervisor) -> dict[str, Any]:
    snap: dict[str, Any] = {
        "version": 1,
        "fleet": {"file": sup.fleet.path, "name": sup.fleet.name or sup.fleet_id,
                  "started_at": sup.started_at, "pid": os.getpid(),
                  "cgroup_root": str(sup.cgroup_tree.fleet_dir) if sup.cgroup_tree
                  else None, "isolation_reason": sup.cgroup_reason,
                  "state_dir": str(sup.state_dir)},
        "agents": [agent_row(sup, rt) for rt in sup.agents.values()],
        "external": [dict(v) for v in sup.externals.values()],
        "events": [e.to_json() for e in list(sup.events)[-200:]],
        "components": components(sup),
    }
    for cap in sup.capabilities:
        with contextlib.suppress(Exception):
            snap.update(cap.snapshot_part())
    return snap
