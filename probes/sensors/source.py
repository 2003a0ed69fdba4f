"""One interface over the two per-agent telemetry sources: eBPF (preferred) and procfs.

``TelemetrySource.start()`` tries the kernel probe in a child process (bcc's LLVM
stays out of the caller) and falls back to procfs with the reason in ``why``: not
root, no CAP_BPF, bcc missing, no headers, lockdown, or a load error. If the loader
dies later, the source falls back the same way and says so. ``sample()`` never
blocks on the kernel: it turns the latest cumulative counters into rates.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fleettop.probes.sensors import ebpf
from fleettop.probes.sensors.procfs import ProcfsProbe
from fleettop.supervisor.base import jsonlines

RATE_WINDOW_S = 1.0
LOAD_TIMEOUT_S = 60.0  # compile on a busy 2-core box can take tens of seconds


@dataclass
class AgentSample:
    """Per-agent figures at one instant; rates are over the last ~second."""

    agent: str
    t: float
    source: str
    cpu_percent: float = 0.0  # of one core
    ctx_switches_per_s: float = 0.0
    voluntary_switches_per_s: float = 0.0  # the tree blocked (I/O, sleep, locks)
    runq_percent: float | None = None  # waiting for a CPU while runnable (ebpf only)
    rss_bytes: int = 0
    swap_bytes: int = 0
    faults_per_s: float | None = None
    net_tx_bytes: int | None = None
    net_rx_bytes: int | None = None
    net_tx_per_s: float | None = None
    net_rx_per_s: float | None = None
    syscalls_per_s: float | None = None
    nprocs: int = 0
    pids: list[int] = field(default_factory=list)
    forks: int | None = None
    execs: int | None = None
    exits: int = 0
    oom_kills: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _rate(new: Any, old: Any, dt: float) -> float | None:
    if new is None or old is None or dt <= 0:
        return None
    return max(0.0, (new - old) / dt)


def to_sample(agent: str, source: str, hist: deque[tuple[float, dict[str, Any]]]) -> AgentSample:
    """An AgentSample from a history of (t, cumulative counters), oldest first."""
    t1, new = hist[-1]
    t0, old = hist[0]
    dt = t1 - t0
    s = AgentSample(agent=agent, t=t1, source=source)
    s.rss_bytes = int(new.get("rss_bytes") or 0)
    s.swap_bytes = int(new.get("rss_swap") or 0)
    s.nprocs = int(new.get("nprocs") or 0)
    s.pids = list(new.get("pids") or [])
    s.exits = int(new.get("exits") or 0)
    s.oom_kills = new.get("oom_kills")
    s.forks, s.execs = new.get("forks"), new.get("execs")
    s.net_tx_bytes, s.net_rx_bytes = new.get("tx_bytes"), new.get("rx_bytes")
    if dt <= 0:
        return s
    cpu = _rate(new.get("oncpu_ns"), old.get("oncpu_ns"), dt)
    s.cpu_percent = round((cpu or 0.0) / 1e7, 1)
    vol = _rate(new.get("nvcsw"), old.get("nvcsw"), dt) or 0.0
    invol = _rate(new.get("nivcsw"), old.get("nivcsw"), dt) or 0.0
    s.voluntary_switches_per_s = round(vol, 1)
    s.ctx_switches_per_s = round(vol + invol, 1)
    runq = _rate(new.get("runq_ns"), old.get("runq_ns"), dt)
    s.runq_percent = None if runq is None else round(runq / 1e7, 1)
    s.faults_per_s = _rate(new.get("faults"), old.get("faults"), dt)
    s.net_tx_per_s = _rate(new.get("tx_bytes"), old.get("tx_bytes"), dt)
    s.net_rx_per_s = _rate(new.get("rx_bytes"), old.get("rx_bytes"), dt)
    if new.get("syscalls") is not None and source == "ebpf":
        s.syscalls_per_s = _rate(new.get("syscalls"), old.get("syscalls"), dt)
    return s


def cgroup_cpu_ns(cgroup: Path | None) -> int | None:
    """CPU time of a cgroup v2 (every process in it, exited ones included), in ns."""
    if cgroup is None:
        return None
    try:
        with open(cgroup / "cpu.stat") as fh:
            for line in fh:
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) * 1000
    except (OSError, ValueError):
        return None
    return None


def ebpf_precheck() -> str | None:
    """Why eBPF can't work here, from cheap checks that don't import bcc; None if it may."""
    try:
        ebpf.check_environment(need_bcc=False)
    except ebpf.ProbeUnavailable as exc:
        return str(exc)
    if not ebpf.bcc_available():
        return "bcc missing: install python3-bpfcc (see .ci/install-bpf.sh)"
    return None


class TelemetrySource:
    """Per-agent samples from eBPF or, failing that, procfs. Thread-safe."""

    def __init__(self, prefer: str = "auto", interval: float = 0.1,
                 count_syscalls: bool = False) -> None:
        self.prefer = prefer  # "auto" | "ebpf" | "procfs"
        self.interval = interval
        self.count_syscalls = count_syscalls
        self.source = "none"
        self.why = "not started"
        self.loader_info: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._hist: dict[str, deque[tuple[float, dict[str, Any]]]] = {}
        self._watched: dict[str, tuple[int, Path | None]] = {}
        self._events: list[dict[str, Any]] = []
        self._proc: subprocess.Popen[bytes] | None = None
        self._procfs: ProcfsProbe | None = None
        self._cpu_hist: dict[str, deque[tuple[float, int]]] = {}
        """Per agent: (t, cgroup CPU ns) read at each sample (eBPF source)."""

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        if self.prefer == "procfs":
            self._use_procfs("procfs chosen in the fleet file")
            return
        reason = ebpf_precheck()
        if reason is None:
            reason = self._start_loader()
        if reason is None:
            return
        if self.prefer == "ebpf":
            self.why = reason
        self._use_procfs(reason)

    def _start_loader(self) -> str | None:
        cmd = [sys.executable, "-m", "fleettop.probes.sensors.ebpf",
               "--interval", str(self.interval)]
        if self.count_syscalls:
            cmd.append("--syscalls")
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE)
        except OSError as exc:
            return f"cannot start the eBPF loader: {exc}"
        stdout = proc.stdout
        assert stdout is not None
        first: list[bytes] = []
        reader = threading.Thread(target=lambda: first.append(stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(LOAD_TIMEOUT_S)
        msg: dict[str, Any] = (jsonlines.decode(first[0]) if first else None) or {}
        if msg.get("type") != "ready":
            proc.kill()
            err = b""
            with contextlib.suppress(Exception):
                err = proc.communicate(timeout=5)[1] or b""
            why = msg.get("why") or err.decode(errors="replace").strip().splitlines()[-1:] \
                or ["the eBPF loader did not start in time"]
            return why if isinstance(why, str) else f"BPF load error: {why[0]}"
        self._proc = proc
        self.loader_info = msg
        self.source, self.why = "ebpf", ""
        threading.Thread(target=self._read_loader, args=(proc,), daemon=True,
                         name="fleettop-ebpf-reader").start()
        return None

    def _use_procfs(self, why: str) -> None:
        with self._lock:
            self._procfs = ProcfsProbe()
            self.source, self.why = "procfs", why
            self._hist.clear()
            for agent, (pid, cg) in self._watched.items():
                self._procfs.watch(agent, pid, cg)

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()  # type: ignore[union-attr]
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # -- watching --------------------------------------------------------------------
    def watch(self, agent: str, root_pid: int, cgroup: Path | None = None) -> None:
        with self._lock:
            self._watched[agent] = (root_pid, cgroup)
            self._hist.pop(agent, None)
            if self._procfs is not None:
                self._procfs.watch(agent, root_pid, cgroup)
                return
        self._send({"cmd": "watch", "agent": agent, "pid": root_pid})

    def unwatch(self, agent: str) -> None:
        with self._lock:
            self._watched.pop(agent, None)
            self._hist.pop(agent, None)
            self._cpu_hist.pop(agent, None)
            if self._procfs is not None:
                self._procfs.unwatch(agent)
                return
        self._send({"cmd": "unwatch", "agent": agent})

    def _send(self, req: dict[str, Any]) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None:
            return
        try:
            proc.stdin.write(jsonlines.encode(req))
            proc.stdin.flush()
        except OSError as exc:
            self._loader_died(f"eBPF loader pipe closed: {exc}")

    # -- reading ---------------------------------------------------------------------
    def _read_loader(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            msg = jsonlines.decode(raw)
            if msg is None:
                continue
            kind = msg.get("type")
            if kind == "sample":
                self._push(msg["t"], msg["agents"])
            elif kind == "event":
                with self._lock:
                    self._events.append(msg)
                    del self._events[:-1000]
        if self._proc is proc:
            self._loader_died(f"eBPF loader exited (rc={proc.wait()})")

    def _loader_died(self, why: str) -> None:
        self._proc = None
        self._use_procfs(why)

    def _push(self, t: float, agents: dict[str, dict[str, Any]]) -> None:
        with self._lock:
            for agent, counters in agents.items():
                if agent not in self._watched:
                    continue
                hist = self._hist.setdefault(agent, deque())
                hist.append((t, counters))
                while len(hist) > 2 and t - hist[1][0] >= RATE_WINDOW_S:
                    hist.popleft()

    def sample(self, now: float | None = None) -> dict[str, AgentSample]:
        """The latest figures per watched agent (procfs polls now; ebpf reads its buffer)."""
        if self._procfs is not None:
            with self._lock:
                procfs = self._procfs
            if procfs is not None:
                self._push(time.time(), procfs.read())
        with self._lock:
            out = {a: to_sample(a, self.source, h) for a, h in self._hist.items() if h}
            watched = dict(self._watched)
        if self.source == "ebpf":
            self._exact_cpu(out, watched, time.time() if now is None else now)
        return out

    def _exact_cpu(self, out: dict[str, AgentSample],
                   watched: dict[str, tuple[int, Path | None]], now: float) -> None:
        """sched_switch books on-CPU time when a task is switched out: a task that stays on
        a CPU read 0, then a burst over 100%. The kernel's own count for the cgroup is exact
        at every read and is what top agrees with: read once per sample (not per kernel
        report, ten a second), it replaces the eBPF figure."""
        for agent, s in out.items():
            exact = cgroup_cpu_ns(watched.get(agent, (0, None))[1])
            if exact is None:
                continue
            hist = self._cpu_hist.setdefault(agent, deque())
            hist.append((now, exact))
            while len(hist) > 2 and now - hist[1][0] >= RATE_WINDOW_S:
                hist.popleft()
            (t0, c0), (t1, c1) = hist[0], hist[-1]
            if t1 > t0:
                s.cpu_percent = round(max(0, c1 - c0) / (t1 - t0) / 1e7, 1)

    def events(self) -> list[dict[str, Any]]:
        """Fork/exec/exit/oom events since the last call (ebpf only)."""
        with self._lock:
            out, self._events = self._events, []
        return out

    def status(self) -> dict[str, Any]:
        return {"source": self.source, "why": self.why,
                "loader_pid": self._proc.pid if self._proc else None,
                "loader_rss_bytes": _rss_of(self._proc.pid) if self._proc else None,
                "load_s": self.loader_info.get("load_s")}


def _rss_of(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


__all__ = ["AgentSample", "TelemetrySource", "ebpf_precheck", "to_sample"]
