"""Per-agent counters from /proc (and the agent's cgroup when it has one), at ~1 Hz.

The fallback when eBPF can't load. It reports the same cumulative counters as the
kernel probe (see ebpf.py) so one rate computation serves both. What it can't see:
bytes on the network per process (procfs has none: reported as None), exit codes of
grandchildren, and anything that lived and died between two polls. CPU time of
processes that exited is kept (their last reading), so counters never go backwards.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class ProcReading:
    """One process's cumulative counters from /proc/PID/{stat,status}."""

    cpu_ns: int
    nvcsw: int
    nivcsw: int
    faults: int
    rss_bytes: int
    rss_swap: int
    start_ticks: int


def read_proc(pid: int) -> ProcReading | None:
    """Counters for one pid, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except (OSError, ProcessLookupError):
        return None
    # comm may hold spaces and parens: split after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None  # a zombie: its last live reading is kept as gone
    # fields[0] is state (field 3): minflt=10, majflt=12, utime=14, stime=15, starttime=22.
    minflt, majflt = int(fields[7]), int(fields[9])
    utime, stime = int(fields[11]), int(fields[12])
    start = int(fields[19])
    vals = {}
    for line in status.splitlines():
        key, _, rest = line.partition(":")
        if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches", "VmRSS", "VmSwap"):
            vals[key] = int(rest.split()[0])
    return ProcReading(
        cpu_ns=(utime + stime) * 1_000_000_000 // CLK_TCK,
        nvcsw=vals.get("voluntary_ctxt_switches", 0),
        nivcsw=vals.get("nonvoluntary_ctxt_switches", 0),
        faults=minflt + majflt,
        rss_bytes=vals.get("VmRSS", 0) * 1024,
        rss_swap=vals.get("VmSwap", 0) * 1024,
        start_ticks=start,
    )


def tree_pids(root_pid: int) -> list[int]:
    """root_pid and all its descendants (empty if root_pid is gone)."""
    try:
        root = psutil.Process(root_pid)
        kids = root.children(recursive=True)
    except psutil.Error:
        return []
    return [root_pid, *(k.pid for k in kids)]


def cgroup_pids(cgroup: Path) -> list[int]:
    pids: list[int] = []
    for procs in [cgroup / "cgroup.procs", *cgroup.glob("**/cgroup.procs")]:
        with contextlib.suppress(OSError, ValueError):
            pids.extend(int(x) for x in procs.read_text().split())
    return sorted(set(pids))


def cgroup_oom_kills(cgroup: Path) -> int | None:
    try:
        for line in (cgroup / "memory.events").read_text().splitlines():
            key, _, val = line.partition(" ")
            if key == "oom_kill":
                return int(val)
    except (OSError, ValueError):
        return None
    return None


@dataclass
class _Watched:
    root_pid: int
    cgroup: Path | None
    last: dict[tuple[int, int], ProcReading] = field(default_factory=dict)
    gone_cpu_ns: int = 0
    gone_nvcsw: int = 0
    gone_nivcsw: int = 0
    gone_faults: int = 0
    exits: int = 0
    oom_base: int | None = None


class ProcfsProbe:
    """Same per-agent cumulative counters as the kernel probe, from polling /proc."""

    def __init__(self) -> None:
        self._agents: dict[str, _Watched] = {}

    def watch(self, agent: str, pid: int, cgroup: Path | None = None) -> None:
        w = _Watched(root_pid=pid, cgroup=cgroup)
        if cgroup is not None:
            w.oom_base = cgroup_oom_kills(cgroup)
        self._agents[agent] = w
        self._poll(w)  # baseline: counters start at the watch, like the kernel probe's
        w.gone_cpu_ns = -sum(r.cpu_ns for r in w.last.values())
        w.gone_nvcsw = -sum(r.nvcsw for r in w.last.values())
        w.gone_nivcsw = -sum(r.nivcsw for r in w.last.values())
        w.gone_faults = -sum(r.faults for r in w.last.values())

    def unwatch(self, agent: str) -> None:
        self._agents.pop(agent, None)

    def agents(self) -> list[str]:
        return list(self._agents)

    def _poll(self, w: _Watched) -> dict[tuple[int, int], ProcReading]:
        pids = cgroup_pids(w.cgroup) if w.cgroup is not None else []
        if not pids:
            pids = tree_pids(w.root_pid)
        now: dict[tuple[int, int], ProcReading] = {}
        for pid in pids:
            r = read_proc(pid)
            if r is not None:
                now[(pid, r.start_ticks)] = r  # (pid, start) survives pid reuse
        for key, old in w.last.items():
            if key not in now:
                w.gone_cpu_ns += old.cpu_ns
                w.gone_nvcsw += old.nvcsw
                w.gone_nivcsw += old.nivcsw
                w.gone_faults += old.faults
                w.exits += 1
        w.last = now
        return now

    def read(self) -> dict[str, dict[str, Any]]:
        """Cumulative counters per agent (the keys of the kernel probe's samples)."""
        out: dict[str, dict[str, Any]] = {}
        for agent, w in self._agents.items():
            now = self._poll(w)
            oom = None
            if w.cgroup is not None:
                cur = cgroup_oom_kills(w.cgroup)
                if cur is not None:
                    oom = cur - (w.oom_base or 0)
            rs = list(now.values())
            out[agent] = {
                "oncpu_ns": w.gone_cpu_ns + sum(r.cpu_ns for r in rs),
                "runq_ns": None,
                "nvcsw": w.gone_nvcsw + sum(r.nvcsw for r in rs),
                "nivcsw": w.gone_nivcsw + sum(r.nivcsw for r in rs),
                "forks": None,
                "execs": None,
                "exits": w.exits,
                "oom_kills": oom,
                "faults": w.gone_faults + sum(r.faults for r in rs),
                "tx_bytes": None,
                "rx_bytes": None,
                "syscalls": None,
                "rss_bytes": sum(r.rss_bytes for r in rs),
                "rss_swap": sum(r.rss_swap for r in rs),
                "pids": sorted(pid for pid, _ in now),
                "nprocs": len(now),
            }
        return out
