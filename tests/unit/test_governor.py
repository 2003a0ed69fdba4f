"""Governor levels from recorded /proc files: PSI, vmstat, buddyinfo, meminfo, cgroups."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from fleettop.supervisor.config.gpu import GovernorSection
from fleettop.supervisor.gpu.evictor import GpuMemory
from fleettop.supervisor.gpu.governor import (
    Governor,
    Sampler,
    high_order_free_share,
    level_for,
    read_psi,
    read_state,
    shrink_request,
)
from tests.support.processes import needs_cgroups

CALM = ("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
        "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")


def psi(some: float, full: float = 0.0) -> str:
    return (f"some avg10={some:.2f} avg60=1.00 avg300=0.50 total=123456\n"
            f"full avg10={full:.2f} avg60=0.00 avg300=0.00 total=789\n")


class Root:
    """A fake / with the files the governor reads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        (path / "proc/pressure").mkdir(parents=True)
        (path / "proc/1").mkdir()
        (path / "proc/1/status").write_text("Name:\tinit\nVmRSS:\t  1048576 kB\n")
        self.pressure(memory=CALM, cpu=CALM, io=CALM)
        self.vmstat(0, 0, 0)
        (path / "proc/meminfo").write_text(
            "MemTotal:       16777216 kB\nMemFree:         8388608 kB\nBuffers:  0 kB\n"
            "Cached:          4194304 kB\nSReclaimable:     0 kB\n")
        self.buddy([10, 10, 10, 10, 100, 100, 100, 100, 100, 100, 100])

    def pressure(self, **files: str) -> None:
        for name, text in files.items():
            (self.path / "proc/pressure" / name).write_text(text)

    def vmstat(self, pswpin: int, pswpout: int, refault: int) -> None:
        (self.path / "proc/vmstat").write_text(
            f"nr_free_pages 100\npswpin {pswpin}\npswpout {pswpout}\n"
            f"workingset_refault_anon {refault}\nworkingset_refault_file 0\n")

    def buddy(self, counts: list[int]) -> None:
        (self.path / "proc/buddyinfo").write_text(
            "Node 0, zone      DMA      1      1      0      1      2      1      1      0"
            "      1      1      3\n"
            f"Node 0, zone   Normal {' '.join(str(c) for c in counts)}\n")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class FakeSupervisor:
    def __init__(self) -> None:
        self.events: list[tuple[str, str | None, str, dict[str, Any]]] = []
        self.agents = {"important": {"priority": 10, "state": "running"},
                       "batch": {"priority": -5, "state": "running"},
                       "normal": {"priority": 0, "state": "running"}}
        self.calls: list[tuple[str, str]] = []

    def emit(self, kind: str, agent: str | None = None, reason: str = "", **data: Any) -> None:
        self.events.append((kind, agent, reason, data))

    def snapshot(self) -> dict[str, Any]:
        return {"agents": [{"name": n, **a, "rss_bytes": 0} for n, a in self.agents.items()]}

    async def freeze_agent(self, name: str, reason: str, source: str = "user",
                           evidence: dict[str, Any] | None = None) -> dict[str, Any]:
        assert source == "governor" and evidence
        self.agents[name]["state"] = "frozen"
        self.calls.append(("freeze", name))
        return {"ok": True}

    async def resume_agent(self, name: str, reason: str = "") -> dict[str, Any]:
        self.agents[name]["state"] = "running"
        self.calls.append(("resume", name))
        return {"ok": True}

    async def stop_agent(self, name: str) -> dict[str, Any]:
        self.agents[name]["state"] = "stopped"
        self.calls.append(("stop", name))
        return {"ok": True}


@pytest.fixture
def root(tmp_path: Path) -> Root:
    return Root(tmp_path)


def test_readers_parse_recorded_files(root: Root, tmp_path: Path) -> None:
    root.pressure(memory=psi(12.5, 3.25))
    data = read_psi(root.path / "proc/pressure/memory")
    assert data is not None and data["some"]["avg10"] == 12.5 and data["full"]["avg10"] == 3.25
    assert data["some"]["total"] == 123456
    assert read_psi(tmp_path / "nope") is None
    share = high_order_free_share(root.path)
    assert share is not None and 0.9 < share < 1.0
    root.buddy([50000, 20000, 100, 0, 0, 0, 0, 0, 0, 0, 0])
    share = high_order_free_share(root.path)
    assert share is not None and share < 0.05


def test_sampler_rates_and_unaccounted(root: Root) -> None:
    clock = Clock()
    cg = root.path / "cg/agent-a"
    cg.mkdir(parents=True)
    (cg / "memory.pressure").write_text(psi(33.0))
    sampler = Sampler(root.path, rss_every=0, clock=clock,
                      cgroups=lambda: {"agent-a": cg, "gone": None},
                      gpu=type("G", (), {"read_memory": lambda self: GpuMemory(100, 93)})())
    first = sampler.sample()
    assert "swap_pages_per_s" not in first
    assert first["agent_memory_some_avg10"] == 33.0 and sampler.worst_agent == "agent-a"
    assert first["gpu_used"] == 0.93
    # used = 16 GiB - 8 GiB free - 4 GiB cache = 4 GiB; 1 GiB of it is in processes.
    assert first["unaccounted"] == pytest.approx(0.1875)
    root.vmstat(500, 1500, 20000)
    clock.t += 2
    second = sampler.sample()
    assert second["swap_pages_per_s"] == 1000.0 and second["refault_pages_per_s"] == 10000.0


def test_levels_follow_the_worst_figure() -> None:
    cfg = GovernorSection(confirm=1)
    assert level_for({"memory_some_avg10": 1.0}, cfg)[0] == 0
    assert level_for({"memory_some_avg10": 30.0}, cfg) == (2, {"memory_some_avg10": 2})
    assert level_for({"memory_some_avg10": 30.0, "swap_pages_per_s": 6000.0}, cfg)[0] == 3
    # Fragmentation only counts while free memory is scarce.
    assert level_for({"high_order_free": 0.01, "free_share": 0.5}, cfg)[0] == 0
    assert level_for({"high_order_free": 0.01, "free_share": 0.05}, cfg)[0] == 4


async def test_escalates_at_once_steps_down_after_cooldown_with_hysteresis(root: Root) -> None:
    clock = Clock()
    sup = FakeSupervisor()
    state_file = root.path / "governor.json"
    cfg = GovernorSection.model_validate({"cooldown": "30s", "hysteresis": 0.2, "confirm": 1})
    gov = Governor(Sampler(root.path, clock=clock, rss_every=0), cfg, supervisor=sup,
                   state_path=state_file, clock=clock)
    assert (await gov.step()).level == 0
    root.pressure(memory=psi(45.0))  # ≥ 40 → level 3: shrink, (no evictor), freeze lowest
    state = await gov.step()
    assert state.level == 3 and state.num_ctx_cap == 2048
    assert sup.calls == [("freeze", "batch")]
    kinds = [e[0] for e in sup.events]
    assert kinds[:2] == ["governor.level", "governor.action"]
    level_event = sup.events[0]
    assert level_event[3]["from"] == 0 and level_event[3]["to"] == 3
    assert level_event[3]["figures"]["memory_some_avg10"] == 45.0
    proxy_view = read_state(state_file)
    assert proxy_view.level == 3 and proxy_view.max_tokens_cap == 512
    # Pressure eases to just under the level-3 step: hysteresis keeps level 3.
    root.pressure(memory=psi(35.0))
    clock.t += 60
    assert (await gov.step()).level == 3
    assert sup.calls[-1] == ("freeze", "normal")  # still level 3 a cooldown later: one more
    # Well under: one level down at a time, each after `cooldown` at the level.
    root.pressure(memory=psi(5.0))
    clock.t += 1
    assert (await gov.step()).level == 2
    # Below the freezing level, the governor resumes what it froze, newest first.
    assert sup.calls[-1] == ("resume", "normal")
    clock.t += 5
    assert (await gov.step()).level == 2
    assert sup.calls[-1] == ("resume", "batch")
    clock.t += 31
    assert (await gov.step()).level == 1
    clock.t += 31
    state = await gov.step()
    assert state.level == 0 and state.num_ctx_cap is None
    assert [c for c in sup.calls if c[0] == "freeze"] == [("freeze", "batch"),
                                                          ("freeze", "normal")]
    assert all(a["state"] == "running" for a in sup.agents.values())


async def test_last_resort_kill_and_protected_agents(root: Root) -> None:
    clock = Clock()
    sup = FakeSupervisor()
    cfg = GovernorSection.model_validate({"protect": ["batch"], "confirm": 1})
    gov = Governor(Sampler(root.path, clock=clock, rss_every=0), cfg, supervisor=sup, clock=clock)
    root.pressure(memory=psi(90.0, 40.0))
    assert (await gov.step()).level == 4
    assert sup.calls == [("freeze", "normal"), ("stop", "normal")]


class FakeEvictor:
    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    async def evict_idle(self, reason: str, *, idle_only: bool = True) -> Any:
        self.calls.append((reason, idle_only))
        return type("R", (), {"evictions": []})()


async def test_evicts_through_the_watchdog_once_per_cooldown(root: Root) -> None:
    clock = Clock()
    ev = FakeEvictor()
    gov = Governor(Sampler(root.path, clock=clock, rss_every=0),
                   GovernorSection(confirm=1), evictor=ev,
                   clock=clock)
    await gov.step({"swap_pages_per_s": 2000.0})
    await gov.step({"swap_pages_per_s": 2000.0})
    assert ev.calls == [("governor level 2", True)]


def test_shrink_request_ollama_and_openai() -> None:
    ollama = {"model": "qwen", "prompt": "hi", "options": {"num_ctx": 32768}}
    changed = shrink_request(ollama, 4096, 1024)
    assert ollama["options"] == {"num_ctx": 4096, "num_predict": 1024}
    assert changed["num_ctx"] == (32768, 4096)
    openai = {"model": "gpt", "messages": [], "max_tokens": 100}
    assert shrink_request(openai, 4096, 1024) == {} and openai["max_tokens"] == 100
    openai2 = {"model": "gpt", "messages": [], "max_completion_tokens": 9000}
    shrink_request(openai2, None, 512)
    assert openai2["max_completion_tokens"] == 512
    assert shrink_request({"model": "x", "messages": []}, None, None) == {}


async def test_a_single_burst_does_not_raise_the_level(root: Root) -> None:
    clock = Clock()
    gov = Governor(Sampler(root.path, clock=clock, rss_every=0), GovernorSection(), clock=clock)
    calm = {"refault_pages_per_s": 0.0}
    burst = {"refault_pages_per_s": 50000.0}
    assert (await gov.step(burst)).level == 0  # one sample: a fleet starting up
    assert (await gov.step(calm)).level == 0
    await gov.step(burst)
    assert (await gov.step(burst)).level == 3  # two in a row: pressure


# --- real pressure -------------------------------------------------------------------------

THRASH = """
import os, sys
path = sys.argv[1]
with open(path, 'wb') as f:  # its own pages: charged to this agent's memory cgroup
    for _ in range(96):
        f.write(os.urandom(1 << 20))
    f.flush()
    os.fsync(f.fileno())
    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
while True:  # 96 MiB read over and over under a 24 MiB limit: reclaim, refault, stall
    with open(path, 'rb') as f:
        while f.read(1 << 20):
            pass
"""


@pytest.mark.slow  # a real agent fills its cgroup: ~30 s
@needs_cgroups
async def test_real_memory_pressure_in_an_agent_cgroup_raises_the_level(tmp_path: Path) -> None:
    import sys

    from fleettop.supervisor.config.load import parse_fleet
    from fleettop.supervisor.core.supervisor import Supervisor

    if read_psi("/proc/pressure/memory") is None:
        pytest.skip("needs PSI (/proc/pressure/memory): kernel built without CONFIG_PSI or "
                    "booted with psi=0")
    text = json.dumps({"agents": {"thrasher": {
        "cmd": [sys.executable, "-c", THRASH, str(tmp_path / "pages.bin")],
        "limits": {"memory": "24MiB"}, "restart": "no"}}})
    (tmp_path / "fleet.yaml").write_text(text)
    sup = Supervisor(parse_fleet(text, str(tmp_path / "fleet.yaml")))
    events: list[tuple] = []
    cfg = GovernorSection.model_validate({
        "confirm": 1, "interval": "0.5s",
        # Only the agent's own memory.pressure may raise the level here: the machine's other
        # figures (CPU from other work, the thrasher's refaults) are set out of reach.
        "thresholds": {"agent_memory_some_avg10": [0.2, 50, 60, 70],
                       "memory_some_avg10": [99, 99.5, 99.8, 99.9],
                       "memory_full_avg10": [99, 99.5, 99.8, 99.9],
                       "io_full_avg10": [99, 99.5, 99.8, 99.9],
                       "cpu_some_avg10": [101, 102, 103, 104],
                       "swap_pages_per_s": [1e12, 2e12, 3e12, 4e12],
                       "refault_pages_per_s": [1e12, 2e12, 3e12, 4e12],
                       "unaccounted": [0.97, 0.98, 0.99, 1.0]}})
    state_file = tmp_path / "governor.json"
    gov = Governor(Sampler("/", cgroups=lambda: {n: r.cgroup for n, r in sup.agents.items()}),
                   cfg, emit=lambda *a, **k: events.append((a, k)), state_path=state_file)
    await sup.start()
    try:
        cgroup = sup.agents["thrasher"].cgroup
        assert cgroup is not None and (Path(cgroup) / "memory.pressure").exists()
        deadline = time.monotonic() + 40
        while gov.state.level == 0:
            assert time.monotonic() < deadline, (
                f"no level change; agent memory.pressure: "
                f"{read_psi(Path(cgroup) / 'memory.pressure')}, figures {gov.state.figures}")
            await gov.step()
            await asyncio.sleep(0.5)
    finally:
        await sup.shutdown()
    (args, data), = [e for e in events if e[0][0] == "governor.level"]
    assert data["to"] == 1 and data["steps"] == {"agent_memory_some_avg10": 1}
    assert data["figures"]["agent_memory_some_avg10"] >= 0.2
    assert gov.sampler.worst_agent == "thrasher"
    proxy_view = read_state(state_file)  # what the proxy applies to new requests
    assert proxy_view.level == 1 and proxy_view.num_ctx_cap == 8192
