"""The procfs fallback on real processes, and TelemetryWatch driving a fake supervisor."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fleettop.probes.sensors.nvml import FakeGpu
from fleettop.probes.sensors.procfs import ProcfsProbe, read_proc, tree_pids
from fleettop.probes.sensors.source import AgentSample, TelemetrySource
from fleettop.supervisor.capabilities.telemetry import TelemetryWatch
from fleettop.supervisor.config.probes import LeakSection, ProbesSection

MiB = 1 << 20

TREE = """
import os, subprocess, sys, time
KID = ("import time; b=bytearray(32<<20); b[::4096]=b'x'*(8192); print(1, flush=True); "
       "time.sleep(30)")
kids = [subprocess.Popen([sys.executable, "-c", KID], stdout=subprocess.PIPE) for _ in range(2)]
for k in kids:
    k.stdout.readline()
print("ready", flush=True)
sys.stdin.readline()
t = time.process_time()
while time.process_time() - t < 0.3:
    pass
for k in kids:
    k.kill(); k.wait()
print("done", flush=True)
sys.stdin.readline()
"""


def test_procfs_sums_the_tree_and_keeps_exited_cpu():
    root = subprocess.Popen([sys.executable, "-c", TREE], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert root.stdout.readline().strip() == "ready"
        probe = ProcfsProbe()
        probe.watch("tree", root.pid)
        first = probe.read()["tree"]
        assert first["nprocs"] == 3 and set(first["pids"]) == set(tree_pids(root.pid))
        # each child touched 32 MiB: the tree's RSS counts them
        assert first["rss_bytes"] > 2 * 32 * MiB
        expect = sum(read_proc(p).rss_bytes for p in first["pids"])
        assert abs(first["rss_bytes"] - expect) < 4 * MiB
        root.stdin.write("go\n")
        root.stdin.flush()
        assert root.stdout.readline().strip() == "done"
        after = probe.read()["tree"]
        assert after["nprocs"] == 1 and after["exits"] == 2
        assert after["oncpu_ns"] - first["oncpu_ns"] >= 0.2e9  # the 0.3 s spin, give or take
        assert after["tx_bytes"] is None  # procfs can't see network bytes per process
    finally:
        root.kill()
        root.wait()


def test_forced_fallback_gives_the_same_fields():
    src = TelemetrySource(prefer="procfs")
    src.start()
    assert src.source == "procfs" and "procfs" in src.why
    src.watch("me", os.getpid())
    src.sample()
    time.sleep(0.05)
    s = src.sample()["me"]
    assert isinstance(s, AgentSample) and s.source == "procfs"
    assert set(s.to_json()) >= {"cpu_percent", "ctx_switches_per_s", "rss_bytes",
                                "faults_per_s", "net_tx_bytes", "net_rx_bytes", "nprocs",
                                "exits", "oom_kills"}
    assert s.rss_bytes > 0 and os.getpid() in s.pids
    src.close()


# -- TelemetryWatch with a fake supervisor --------------------------------------------

@dataclass
class FakeRuntime:
    name: str
    pid: int | None
    state: Any = field(default_factory=lambda: SimpleNamespace(value="running"))
    cgroup: Path | None = None
    spec: Any = field(default_factory=lambda: SimpleNamespace(
        limits=SimpleNamespace(memory=None)))


class FakeSupervisor:
    def __init__(self, agents: dict[str, FakeRuntime]) -> None:
        self.agents = agents
        self.events: list[tuple[str, str | None, str, dict]] = []
        self.frozen: list[dict[str, Any]] = []
        self.froze = asyncio.Event()

    def emit(self, kind: str, agent: str | None = None, reason: str = "", **data: Any) -> None:
        self.events.append((kind, agent, reason, data))

    async def freeze_agent(self, name: str, reason: str, source: str = "user",
                           evidence: dict | None = None) -> dict:
        self.frozen.append({"name": name, "reason": reason, "source": source,
                            "evidence": evidence})
        self.agents[name].state = SimpleNamespace(value="frozen")
        self.froze.set()
        return {"ok": True}


class ScriptedSource:
    """A TelemetrySource stand-in whose RSS grows 1 MiB per sampled second."""

    source, why = "procfs", "scripted"

    def __init__(self) -> None:
        self.watched: dict[str, int] = {}
        self.t = 0.0

    def start(self) -> None: ...
    def close(self) -> None: ...
    def events(self) -> list: return []
    def status(self) -> dict: return {"source": self.source, "why": self.why}

    def watch(self, agent: str, pid: int, cgroup: Path | None = None) -> None:
        self.watched[agent] = pid

    def unwatch(self, agent: str) -> None:
        self.watched.pop(agent, None)

    def sample(self) -> dict[str, AgentSample]:
        self.t += 1
        return {a: AgentSample(agent=a, t=self.t, source="procfs", cpu_percent=3.0,
                               rss_bytes=int(300 * MiB + self.t * MiB), nprocs=1, pids=[p])
                for a, p in self.watched.items()}


async def test_link_publishes_fields_and_freezes_a_leak_near_its_limit():
    rt = FakeRuntime("leaky", pid=4242)
    rt.spec.limits.memory = 1200 * MiB  # ~15 min of headroom at 1 MiB/s: under the horizon
    sup = FakeSupervisor({"leaky": rt, "idle": FakeRuntime("idle", None, SimpleNamespace(
        value="stopped"))})
    gpu = FakeGpu()
    gpu.set_process_vram(4242, 512 * MiB)
    link = TelemetryWatch(sup, ProbesSection(), LeakSection(policy="freeze"),
                         source=ScriptedSource(), gpu=gpu)
    for t in range(0, 600):
        await link.tick(now=float(t))
        if sup.frozen:
            break
    await asyncio.sleep(0)
    row = link.agent_fields("leaky")
    assert row["source"] == "procfs" and row["vram_bytes"] == 512 * MiB
    assert row["rss_leak_slope_bytes_per_s"] > 0.5 * MiB
    assert link.agent_fields("idle") == {}
    assert sup.frozen and sup.frozen[0]["source"] == "leak"
    assert sup.frozen[0]["evidence"]["time_to_limit_s"] < 20 * 60
    assert any(k == "leak.critical" for k, *_ in sup.events)
    assert link.component()["gpu"] is True


@pytest.fixture
def spinning_child():
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield child
    child.kill()
    child.wait()


async def test_link_freezes_a_real_spinning_child_via_procfs(spinning_child):
    sup = FakeSupervisor({"spinner": FakeRuntime("spinner", spinning_child.pid)})
    # 30% of a core, not 95%: several people share this 2-core machine.
    probes = ProbesSection(interval=0.2, spin={"cpu_percent": 30, "duration": "1s"})
    link = TelemetryWatch(sup, probes, LeakSection(policy="off"),
                         source=TelemetrySource(prefer="procfs"), gpu=FakeGpu(count=0))
    await link.start()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(sup.froze.wait(), 20)
    await link.stop()
    assert sup.frozen and sup.frozen[0]["source"] == "spin", sup.events
    assert sup.frozen[0]["evidence"]["source"] == "procfs"
    assert sup.events[0][0] == "telemetry.source"


def test_ebpf_cpu_percent_is_the_cgroups_own_count(tmp_path: Path) -> None:
    """sched_switch books on-CPU time at switch-out: a steady busy loop read 117, 33, 0,
    122 %. With a cgroup, the kernel's exact count (cpu.stat) is used instead."""
    from fleettop.probes.sensors.source import TelemetrySource, cgroup_cpu_ns

    cg = tmp_path / "agent"
    cg.mkdir()
    src = TelemetrySource(prefer="ebpf")
    src.source = "ebpf"  # as if the loader were up; its reports arrive through _push
    src._watched["spin"] = (1, cg)
    got: list[float] = []
    for usage_us, booked_ns in ((0, 0), (950_000, 0), (1_900_000, 3_000_000_000)):
        src._push(len(got), {"spin": {"oncpu_ns": booked_ns, "nprocs": 1, "pids": [1]}})
        (cg / "cpu.stat").write_text(f"usage_usec {usage_us}\nuser_usec {usage_us}\n")
        got.append(src.sample(now=10.0 + len(got))["spin"].cpu_percent)
    assert got[1:] == [95.0, 95.0], got  # not the 0 % and 300 % that eBPF booked
    assert cgroup_cpu_ns(None) is None and cgroup_cpu_ns(tmp_path / "gone") is None
