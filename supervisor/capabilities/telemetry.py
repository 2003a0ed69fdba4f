"""Per-agent telemetry (eBPF or procfs, plus NVML) as a capability of the supervisor.

Watches each agent's root pid while it runs, publishes its figures in the agent's row of the
snapshot (`agent_fields`) and the GPUs in the snapshot's `gpus`, feeds the leak and spin
detectors, and acts through the one freeze path (``supervisor.freeze_agent``) when a policy
says so. Probe reads run
in a worker thread, so a slow /proc walk or NVML call never holds the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleettop.probes.sensors.nvml import GpuSnapshot, GpuSource, NvmlGpu
from fleettop.probes.sensors.source import AgentSample, TelemetrySource
from fleettop.supervisor.config.probes import LeakSection, ProbesSection
from fleettop.supervisor.core.capability import Capability
from fleettop.supervisor.detect.leaks import LeakDetector, Trip
from fleettop.supervisor.detect.spin import SpinDetector, SpinTrip

if TYPE_CHECKING:
    from fleettop.supervisor.core.supervisor import Supervisor

log = logging.getLogger(__name__)
WATCHED_STATES = ("running", "frozen")


@dataclass
class _AgentWatch:
    pid: int
    detectors: dict[str, LeakDetector] = field(default_factory=dict)
    spin: SpinDetector | None = None
    fields: dict[str, Any] = field(default_factory=dict)


def mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class TelemetryWatch(Capability):
    """Samples, leak and spin verdicts for a Supervisor's agents; acts through freeze_agent."""

    name = "telemetry"

    def __init__(self, supervisor: Supervisor, probes: ProbesSection | None = None,
                 leak: LeakSection | None = None, source: TelemetrySource | None = None,
                 gpu: GpuSource | None = None) -> None:
        self.sup = supervisor
        self.probes = probes or ProbesSection()
        self.leak = leak or LeakSection()
        self.source = source or TelemetrySource(prefer=self.probes.source,
                                                count_syscalls=self.probes.syscalls)
        self.gpu = gpu
        self.gpu_snapshot = GpuSnapshot()
        self._gpu_next = 0.0
        self._watches: dict[str, _AgentWatch] = {}
        self._task: asyncio.Task[None] | None = None
        self._acting: set[asyncio.Task[Any]] = set()
        self._component: dict[str, Any] | None = None

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Start the source (the eBPF loader may take seconds) and the sampling loop."""
        if self.source.source == "none":
            await asyncio.to_thread(self.source.start)
        if self.gpu is None:
            self.gpu = await asyncio.to_thread(NvmlGpu)
        self._publish_component()
        self.sup.emit("telemetry.source", None, self.source.why or "eBPF probes loaded",
                      source=self.source.source, why=self.source.why,
                      gpu=self.gpu.available, gpu_why=self.gpu.why)
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await asyncio.to_thread(self.source.close)
        if self.gpu is not None:
            self.gpu.close()

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # a probe hiccup must not end telemetry for the fleet
                log.exception("telemetry tick failed")
            await asyncio.sleep(self.probes.interval)

    # -- one step --------------------------------------------------------------------
    async def tick(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self._sync_watches()
        samples = await asyncio.to_thread(self.source.sample)
        if self.gpu is not None and self.gpu.available and now >= self._gpu_next:
            self.gpu_snapshot = await asyncio.to_thread(self.gpu.sample)
            self._gpu_next = now + self.probes.gpu_interval
        for ev in self.source.events():
            self._on_event(ev)
        for name, s in samples.items():
            w = self._watches.get(name)
            if w is not None:
                self._on_sample(name, w, s, now)
        self._publish_component()

    def _sync_watches(self) -> None:
        for name, rt in self.sup.agents.items():
            state = getattr(rt.state, "value", rt.state)
            live = state in WATCHED_STATES and rt.pid is not None
            w = self._watches.get(name)
            if live and rt.pid is not None and (w is None or w.pid != rt.pid):
                self._watches[name] = self._new_watch(rt)
                self.source.watch(name, rt.pid, getattr(rt, "cgroup", None))
            elif not live and w is not None:
                del self._watches[name]
                self.source.unwatch(name)

    def _new_watch(self, rt: Any) -> _AgentWatch:
        w = _AgentWatch(pid=rt.pid)
        if self.leak.policy != "off":
            for metric in self.leak.metrics:
                w.detectors[metric] = LeakDetector(
                    horizon_s=self.leak.horizon, eval_s=self.leak.eval_interval,
                    persistence=self.leak.persistence, metric=metric)
        spin = self.probes.spin
        if spin.policy != "off":
            w.spin = SpinDetector(spin.cpu_percent, spin.duration, spin.max_blocking_per_s)
        return w

    def _limit(self, name: str, metric: str, current: int) -> float | None:
        if metric == "vram":
            gpus = self.gpu_snapshot.gpus
            return float(sum(g.mem_total for g in gpus)) if gpus else None
        rt = self.sup.agents.get(name)
        limits = getattr(getattr(rt, "spec", None), "limits", None)
        mem = getattr(limits, "memory", None)
        if mem:
            return float(mem)
        avail = mem_available()
        return None if avail is None else float(current + avail)

    def _on_sample(self, name: str, w: _AgentWatch, s: AgentSample, now: float) -> None:
        vram = self.gpu_snapshot.vram_of(s.pids) if self.gpu_snapshot.gpus else None
        w.fields = {
            "source": s.source,
            "telemetry_why": self.source.why,
            "cpu_percent": s.cpu_percent,
            "ctx_switches_per_s": s.ctx_switches_per_s,
            "voluntary_switches_per_s": s.voluntary_switches_per_s,
            "runq_percent": s.runq_percent,
            "rss_bytes": s.rss_bytes,
            "faults_per_s": None if s.faults_per_s is None else round(s.faults_per_s, 1),
            "net_tx_bytes": s.net_tx_bytes,
            "net_rx_bytes": s.net_rx_bytes,
            "syscalls_per_s": s.syscalls_per_s,
            "nprocs": s.nprocs,
            "pids": s.pids,
            "exits": s.exits,
            "oom_kills": s.oom_kills,
            "vram_bytes": vram,
        }
        rt = self.sup.agents.get(name)
        running = getattr(getattr(rt, "state", None), "value", None) == "running"
        values = {"rss": s.rss_bytes, "vram": vram}
        for metric, det in w.detectors.items():
            value = values.get(metric)
            if value is None or not s.nprocs:
                continue
            det.limit = self._limit(name, metric, value)
            trip = det.feed(now, value)
            fit = det.last_fit
            if fit is not None:
                w.fields.update({
                    f"{metric}_leak_state": det.state,
                    f"{metric}_leak_slope_bytes_per_s": round(fit.theil_sen, 1),
                    f"{metric}_leak_ols_slope_bytes_per_s": round(fit.slope, 1),
                    f"{metric}_leak_r2": round(fit.r2, 3),
                    f"{metric}_leak_time_to_limit_s": fit.time_to_limit_s,
                    f"{metric}_leak_window": fit.window,
                })
            if trip is not None and running:
                self._on_leak(name, metric, trip)
        if w.spin is not None and running:
            spin = w.spin.feed(now, s.cpu_percent, s.voluntary_switches_per_s)
            if spin is not None:
                self._on_spin(name, spin)

    # -- acting ----------------------------------------------------------------------
    def _on_leak(self, name: str, metric: str, trip: Trip) -> None:
        evidence = {"metric": metric, "severity": trip.severity, **trip.fit.to_json()}
        self.sup.emit(f"leak.{trip.severity}", name, trip.reason, **evidence)
        if trip.severity == "critical" and self.leak.policy == "freeze":
            self._act(self.sup.freeze_agent(name, reason=trip.reason, source="leak",
                                            evidence=evidence))

    def _on_spin(self, name: str, trip: SpinTrip) -> None:
        evidence = {"cpu_percent": round(trip.cpu_percent, 1), "since": trip.since,
                    "voluntary_switches_per_s": trip.voluntary_switches_per_s,
                    "source": self.source.source}
        self.sup.emit("spin.trip", name, trip.reason, **evidence)
        if self.probes.spin.policy == "freeze":
            self._act(self.sup.freeze_agent(name, reason=trip.reason, source="spin",
                                            evidence=evidence))

    def _act(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._acting.add(task)
        task.add_done_callback(self._acting.discard)

    def _on_event(self, ev: dict[str, Any]) -> None:
        agent = ev.get("agent")
        if agent is None:
            return
        if ev.get("kind") == "oom":
            self.sup.emit("probe.oom_kill", agent, f"OOM killer chose pid {ev.get('pid')}",
                          pid=ev.get("pid"))
        elif ev.get("kind") == "exit" and ev.get("pid") != getattr(
                self._watches.get(agent), "pid", None):
            code, sig = ev.get("exit_code"), ev.get("signal")
            if code or sig:  # the root's own exit is the supervisor's to report
                what = f"signal {sig}" if sig else f"code {code}"
                self.sup.emit("probe.child_exit", agent, f"{ev.get('comm')} exited with {what}",
                              pid=ev.get("pid"), exit_code=code, signal=sig)

    # -- publishing ------------------------------------------------------------------
    def agent_fields(self, name: str) -> dict[str, Any]:
        """Extra per-agent fields for `ctl status` and the UI."""
        w = self._watches.get(name)
        if w is None or not w.fields:
            return {}
        out = {k: v for k, v in w.fields.items() if k != "pids"}
        # The UI's and web view's generic names: the RSS fit is "the" leak fit of a row.
        for generic, specific in (("leak_slope_bytes_per_s", "rss_leak_slope_bytes_per_s"),
                                  ("leak_r2", "rss_leak_r2"),
                                  ("leak_time_to_limit_s", "rss_leak_time_to_limit_s")):
            if specific in out:
                out[generic] = out[specific]
        return out

    def component(self) -> dict[str, Any] | None:
        return self._component

    def snapshot_part(self) -> dict[str, Any]:
        """The probes' GPU sample in the snapshot's shape, with each process's agent named."""
        gpu, snap = self.gpu, self.gpu_snapshot
        if gpu is None or not snap.gpus:
            return {"gpus": [], "gpu_reason": (gpu.why if gpu is not None else "")
                    or "no GPU data yet"}
        owner = {pid: name for name, rt in self.sup.agents.items() if rt.pid
                 for pid in rt.pids()}

        def procs(index: int) -> list[dict[str, Any]]:
            on = snap.per_gpu.get(index)
            if on is None and index == snap.gpus[0].index and not snap.per_gpu:
                on = snap.process_vram  # a source that can't tell the cards apart
            return [{"pid": pid, "agent": owner.get(pid), "used_bytes": used}
                    for pid, used in (on or {}).items()]

        return {"gpus": [{"index": g.index, "name": g.name, "used_bytes": g.mem_used,
                          "total_bytes": g.mem_total, "util_percent": g.util_percent,
                          "processes": procs(g.index)}
                         for g in snap.gpus]}

    def _publish_component(self) -> None:
        info = self.source.status()
        self._component = {
            "source": info["source"], "why": info["why"],
            "loader_pid": info.get("loader_pid"),
            "loader_rss_bytes": info.get("loader_rss_bytes"),
            "load_s": info.get("load_s"),
            "gpu": bool(self.gpu and self.gpu.available),
            "gpu_why": self.gpu.why if self.gpu else "not started",
            "gpus": [g.to_json() for g in self.gpu_snapshot.gpus],
        }
