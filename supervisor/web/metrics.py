"""Prometheus gauges and counters, built from one snapshot per scrape."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from fleettop.supervisor.web.snapshot import AGENT_STATES


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    return None


@dataclass(slots=True, eq=False)
class SnapshotCollector:
    """A prometheus-client Collector over one snapshot (plus counts serve saw on the stream).

    `trips` counts `breaker.trip` events per (agent, kind) since serve started; an agent field
    `trips: {kind: n}` from the supervisor, when present, wins.
    """

    snapshot: dict[str, Any]
    trips: Counter[tuple[str, str]] = field(default_factory=Counter)
    events: Counter[str] = field(default_factory=Counter)
    serve: dict[str, float] = field(default_factory=dict)

    def describe(self) -> Iterable[Metric]:
        return ()

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        agents = [a for a in snap.get("agents", []) if a.get("name") is not None]
        fleet = snap.get("fleet") or {}
        info = GaugeMetricFamily("fleettop_fleet_info", "The fleet being supervised.",
                                 labels=["fleet", "file"])
        info.add_metric([str(fleet.get("name") or ""), str(fleet.get("file") or "")], 1)
        yield info

        per_state = Counter(str(a.get("state")) for a in agents)
        g = GaugeMetricFamily("fleettop_agents", "Agents by state.", labels=["state"])
        for name in sorted(set(AGENT_STATES) | set(per_state)):
            g.add_metric([name], per_state.get(name, 0))
        yield g

        state = GaugeMetricFamily("fleettop_agent_state",
                                  "1 for the state the agent is in, 0 for the others.",
                                  labels=["agent", "state"])
        for a in agents:
            for s in sorted(set(AGENT_STATES) | {str(a.get("state"))}):
                state.add_metric([a["name"], s], 1 if s == str(a.get("state")) else 0)
        yield state

        yield from self._agent_gauges(agents)
        yield from self._agent_counters(agents)
        yield from self._lock(snap.get("lock"))
        yield from self._gpus(snap.get("gpus"))
        yield from self._governor(snap.get("governor"))

        ev = CounterMetricFamily("fleettop_events", "Events seen by serve since it started.",
                                 labels=["kind"])
        for kind, n in sorted(self.events.items()):
            ev.add_metric([kind], n)
        yield ev
        for key, (kind, help_text) in _SERVE_METRICS.items():
            if key in self.serve:
                fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                    f"fleettop_serve_{key}", help_text)
                fam.add_metric([], self.serve[key])
                yield fam

    def _agent_gauges(self, agents: list[dict[str, Any]]) -> Iterator[Metric]:
        for key, name, help_text, scale in _AGENT_GAUGES:
            fam = GaugeMetricFamily(name, help_text, labels=["agent"])
            for a in agents:
                v = _num(a.get(key))
                if v is not None:
                    fam.add_metric([a["name"]], v * scale)
            yield fam

    def _agent_counters(self, agents: list[dict[str, Any]]) -> Iterator[Metric]:
        for key, name, help_text in _AGENT_COUNTERS:
            fam = CounterMetricFamily(name, help_text, labels=["agent"])
            for a in agents:
                v = _num(a.get(key))
                if v is not None:
                    fam.add_metric([a["name"]], v)
            yield fam
        tokens = CounterMetricFamily("fleettop_agent_tokens", "LLM tokens through the proxy.",
                                     labels=["agent", "direction"])
        for a in agents:
            for direction in ("in", "out"):
                v = _num(a.get(f"tokens_{direction}"))
                if v is not None:
                    tokens.add_metric([a["name"], direction], v)
        yield tokens
        trips = CounterMetricFamily("fleettop_agent_trips", "Breaker trips by kind.",
                                    labels=["agent", "kind"])
        counted: dict[tuple[str, str], float] = {k: float(v) for k, v in self.trips.items()}
        for a in agents:
            own = a.get("trips")
            if isinstance(own, dict):
                for stale in [k for k in counted if k[0] == a["name"]]:
                    del counted[stale]
                for kind, n in own.items():
                    if _num(n) is not None:
                        counted[(a["name"], str(kind))] = float(n)
        for (agent, kind), n in sorted(counted.items()):
            trips.add_metric([agent, kind], n)
        yield trips

    def _lock(self, lock: Any) -> Iterator[Metric]:
        if not isinstance(lock, dict):
            return
        queue = lock.get("queue") or []
        held = GaugeMetricFamily("fleettop_gpu_lock_held", "1 while an agent holds the GPU lock.")
        held.add_metric([], 1 if lock.get("holder") else 0)
        yield held
        qlen = GaugeMetricFamily("fleettop_gpu_lock_queue_length",
                                 "Agents waiting for the GPU lock.")
        qlen.add_metric([], len(queue))
        yield qlen
        wait = GaugeMetricFamily("fleettop_gpu_lock_wait_seconds",
                                 "How long each queued agent has waited for the GPU lock.",
                                 labels=["agent"])
        longest = 0.0
        now = time.time()
        for entry in queue:
            if not isinstance(entry, dict):
                continue
            agent = entry.get("agent") or entry.get("name")
            waited = _num(entry.get("waited_s", entry.get("wait_s")))
            if waited is None and _num(entry.get("since")) is not None:
                waited = max(0.0, now - float(entry["since"]))
            if agent is not None and waited is not None:
                wait.add_metric([str(agent)], waited)
                longest = max(longest, waited)
        yield wait
        most = GaugeMetricFamily("fleettop_gpu_lock_max_wait_seconds",
                                 "The longest current wait for the GPU lock.")
        most.add_metric([], longest)
        yield most

    def _gpus(self, gpus: Any) -> Iterator[Metric]:
        if not isinstance(gpus, list):
            return
        used = GaugeMetricFamily("fleettop_gpu_memory_used_bytes", "GPU memory in use.",
                                 labels=["gpu", "name"])
        total = GaugeMetricFamily("fleettop_gpu_memory_total_bytes", "GPU memory in all.",
                                  labels=["gpu", "name"])
        util = GaugeMetricFamily("fleettop_gpu_utilization_ratio",
                                 "GPU busy fraction (0-1).", labels=["gpu", "name"])
        for gpu in gpus:
            if not isinstance(gpu, dict):
                continue
            labels = [str(gpu.get("index", "")), str(gpu.get("name", ""))]
            for fam, value, scale in ((used, gpu.get("used_bytes"), 1.0),
                                      (total, gpu.get("total_bytes"), 1.0),
                                      (util, gpu.get("util_percent"), 0.01)):
                v = _num(value)
                if v is not None:
                    fam.add_metric(labels, v * scale)
        yield from (used, total, util)

    def _governor(self, governor: Any) -> Iterator[Metric]:
        if not isinstance(governor, dict) or "level" not in governor:
            return
        level = governor["level"]
        if _num(level) is not None:
            g = GaugeMetricFamily("fleettop_governor_level",
                                  "Governor escalation level (0 = relaxed).")
            g.add_metric([], float(level))
            yield g
        info = GaugeMetricFamily("fleettop_governor_info", "Governor level and reason.",
                                 labels=["level", "reason"])
        info.add_metric([str(level), str(governor.get("reason", ""))], 1)
        yield info


_AGENT_GAUGES = (
    ("cpu_percent", "fleettop_agent_cpu_ratio", "CPU use in cores (1.0 = one core busy).", 0.01),
    ("rss_bytes", "fleettop_agent_rss_bytes", "Resident memory of the agent's process tree.",
     1.0),
    ("vram_bytes", "fleettop_agent_vram_bytes", "GPU memory held by the agent.", 1.0),
    ("tokens_per_s", "fleettop_agent_tokens_per_second", "Recent token rate.", 1.0),
    ("loop_score", "fleettop_agent_loop_score", "Loop detector score (0-1).", 1.0),
    ("nprocs", "fleettop_agent_processes", "Processes in the agent's tree.", 1.0),
    ("leak_slope_bytes_per_s", "fleettop_agent_leak_slope_bytes_per_second",
     "Fitted memory growth.", 1.0),
    ("leak_time_to_limit_s", "fleettop_agent_leak_time_to_limit_seconds",
     "Projected time until the memory limit.", 1.0),
    ("ctx_switches_per_s", "fleettop_agent_context_switches_per_second",
     "Context switches per second.", 1.0),
    ("faults_per_s", "fleettop_agent_page_faults_per_second", "Page faults per second.", 1.0),
)
_AGENT_COUNTERS = (
    ("restarts", "fleettop_agent_restarts", "Times the agent was restarted."),
    ("requests", "fleettop_agent_requests", "LLM requests through the proxy."),
    ("cost_usd", "fleettop_agent_cost_usd", "Spend on LLM calls, in US dollars."),
    ("net_tx_bytes", "fleettop_agent_network_transmit_bytes", "Bytes sent."),
    ("net_rx_bytes", "fleettop_agent_network_receive_bytes", "Bytes received."),
)
_SERVE_METRICS = {
    "ws_clients": ("gauge", "WebSocket clients connected."),
    "ws_messages_sent": ("counter", "WebSocket messages sent."),
    "ws_skips": ("counter", "Times a slow WebSocket client was skipped ahead to a snapshot."),
    "ws_drops": ("counter", "Slow WebSocket clients disconnected."),
}


def render_metrics(snapshot: dict[str, Any], trips: Counter[tuple[str, str]] | None = None,
                   events: Counter[str] | None = None,
                   serve: dict[str, float] | None = None) -> bytes:
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(snapshot, trips or Counter(), events or Counter(),
                                        serve or {}))
    return generate_latest(registry)
