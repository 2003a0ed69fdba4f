"""Per-agent kernel probes: loads ebpf.c once with bcc and reports per-agent counters.

Runs as its own process (``python -m fleettop.probes.sensors.ebpf``) because bcc pulls in
LLVM: ~135 MiB RSS that must not sit in the supervisor. Commands arrive on stdin as
JSON lines, samples and events leave on stdout as JSON lines:

    > {"cmd": "watch", "agent": "coder", "pid": 4242}
    > {"cmd": "unwatch", "agent": "coder"}
    < {"type": "ready", "load_s": 0.31, "rss_bytes": ..., "features": {...}}
    < {"type": "sample", "t": ..., "agents": {"coder": {"oncpu_ns": ..., ...}}}
    < {"type": "event", "kind": "exit", "agent": "coder", "pid": 4243, "exit_code": 3, ...}

Counters in a sample are cumulative since the watch; the reader computes rates.
``--print-c`` prints the generated C (with the substituted #defines) and exits.
Caveats: RSS is taken from kmem:rss_stat only when the event is about the current
task's mm (curr==1), so reclaim by kswapd shows up late; an exited tree's RSS drops
out at once. Exit statuses come from ``task_struct.exit_code`` at an offset read
from the running kernel's BTF; without BTF they are reported as null.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import struct
import sys
import time
from pathlib import Path
from typing import Any

from fleettop.supervisor.base import jsonlines

SRC = Path(__file__).with_name("ebpf.c")
TRACEFS_CANDIDATES = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
DIST_PACKAGES = "/usr/lib/python3/dist-packages"
MAX_AGENTS = 256

# Optional tracepoints: compiled in only when the kernel has them.
OPTIONAL_TRACEPOINTS = {
    "HAVE_TASK_NEWTASK": ("task", "task_newtask"),
    "HAVE_PAGE_FAULT_USER": ("exceptions", "page_fault_user"),
    "HAVE_SOCK_LENGTH": ("sock", "sock_send_length"),
    "HAVE_OOM": ("oom", "mark_victim"),
    "HAVE_RSS_STAT": ("kmem", "rss_stat"),
}
REQUIRED_TRACEPOINTS = (
    ("sched", "sched_switch"),
    ("sched", "sched_process_fork"),
    ("sched", "sched_process_exec"),
    ("sched", "sched_process_exit"),
)
STAT_FIELDS = (
    "oncpu_ns", "runq_ns", "nvcsw", "nivcsw", "forks", "execs", "exits", "oom_kills",
    "faults", "tx_bytes", "rx_bytes", "syscalls", "drops",
)
EVENT_KINDS = {1: "fork", 2: "exec", 3: "exit", 4: "oom"}


class ProbeUnavailable(RuntimeError):
    """eBPF can't be used here; the message says why (shown by the UI and doctor)."""


def import_bcc() -> Any:
    """Import bcc, from the system's dist-packages if it isn't importable otherwise.

    bcc is not on PyPI; Debian's python3-bpfcc is pure Python over libbcc.so.
    """
    try:
        import bcc

        return bcc
    except ImportError:
        pass
    if DIST_PACKAGES not in sys.path and os.path.isdir(DIST_PACKAGES):
        sys.path.append(DIST_PACKAGES)
    try:
        import bcc
    except ImportError as exc:
        raise ProbeUnavailable(
            f"bcc missing ({exc}); install python3-bpfcc (see .ci/install-bpf.sh)"
        ) from exc
    return bcc


def tracefs() -> Path | None:
    for cand in TRACEFS_CANDIDATES:
        if os.path.isdir(os.path.join(cand, "events")):
            return Path(cand)
    return None


def tracepoint_exists(category: str, name: str) -> bool:
    root = tracefs()
    return root is not None and (root / "events" / category / name / "format").exists()


def btf_member_offset(struct_name: str, member: str, path: str = "/sys/kernel/btf/vmlinux") -> int:
    """Byte offset of ``struct_name.member`` in the running kernel, from its BTF; -1 if unknown.

    A hand-rolled CO-RE for the one field bcc can't reach through a tracepoint.
    """
    try:
        data = Path(path).read_bytes()
    except OSError:
        return -1
    if len(data) < 24 or struct.unpack_from("<H", data, 0)[0] != 0xEB9F:
        return -1
    hdr_len, type_off, type_len, str_off, _ = struct.unpack_from("<IIIII", data, 4)
    types = hdr_len + type_off
    strings = hdr_len + str_off

    def name_at(off: int) -> bytes:
        start = strings + off
        return data[start : data.index(b"\0", start)]

    want_struct, want_member = struct_name.encode(), member.encode()
    # Bytes of kind-specific data after each 12-byte type header, by BTF kind.
    fixed = {1: 4, 3: 12, 14: 4, 17: 4}
    per_member = {4: 12, 5: 12, 6: 8, 13: 8, 15: 12, 19: 12}
    pos, end = types, types + type_len
    while pos < end:
        name_off, info, _size = struct.unpack_from("<III", data, pos)
        kind, vlen, kind_flag = (info >> 24) & 0x1F, info & 0xFFFF, info >> 31
        pos += 12
        if kind == 4 and vlen and name_at(name_off) == want_struct:
            for i in range(vlen):
                m_name, _m_type, m_off = struct.unpack_from("<III", data, pos + 12 * i)
                if name_at(m_name) == want_member:
                    bits = m_off & 0xFFFFFF if kind_flag else m_off
                    return bits // 8
        pos += fixed.get(kind, 0) + per_member.get(kind, 0) * vlen
    return -1


def features(count_syscalls: bool = False) -> dict[str, int]:
    """The #defines substituted into ebpf.c for this kernel."""
    defs = {k: int(tracepoint_exists(*tp)) for k, tp in OPTIONAL_TRACEPOINTS.items()}
    defs["HAVE_SOCK_LENGTH"] &= int(tracepoint_exists("sock", "sock_recv_length"))
    defs["COUNT_SYSCALLS"] = int(count_syscalls and tracepoint_exists("raw_syscalls", "sys_enter"))
    defs["EXIT_CODE_OFF"] = btf_member_offset("task_struct", "exit_code")
    defs["MAX_AGENTS"] = MAX_AGENTS
    return defs


def generate_source(defs: dict[str, int]) -> str:
    prelude = "".join(f"#define {k} {v}\n" for k, v in defs.items())
    return prelude + SRC.read_text()


def bcc_available() -> bool:
    """Whether bcc could be imported, without importing it (that costs ~60 MiB)."""
    import importlib.util

    if importlib.util.find_spec("bcc") is not None:
        return True
    return os.path.isfile(os.path.join(DIST_PACKAGES, "bcc", "__init__.py"))


def check_environment(need_bcc: bool = True) -> None:
    """Raise ProbeUnavailable with the first reason eBPF can't work here."""
    if os.geteuid() != 0 and not _has_bpf_caps():
        raise ProbeUnavailable("not root and no CAP_BPF+CAP_PERFMON")
    if tracefs() is None:
        raise ProbeUnavailable("tracefs not mounted (mount -t tracefs nodev /sys/kernel/tracing)")
    missing = [f"{c}:{n}" for c, n in REQUIRED_TRACEPOINTS if not tracepoint_exists(c, n)]
    if missing:
        raise ProbeUnavailable(f"tracepoints missing: {', '.join(missing)}")
    lockdown = lockdown_mode()
    if lockdown == "confidentiality":
        raise ProbeUnavailable("kernel lockdown=confidentiality forbids reading kernel memory")
    build = Path(f"/lib/modules/{os.uname().release}/build")
    if not (build / "include").exists():
        raise ProbeUnavailable(
            f"no kernel headers at {build} (install linux-headers and link them; "
            "see .ci/install-bpf.sh)"
        )
    if need_bcc:
        import_bcc()


def lockdown_mode() -> str | None:
    """The active kernel lockdown mode ("none", "integrity", "confidentiality"), or None."""
    try:
        text = Path("/sys/kernel/security/lockdown").read_text()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("["):
            return word.strip("[]")
    return None


def _has_bpf_caps() -> bool:
    # CAP_PERFMON = 38, CAP_BPF = 39 (Linux 5.8+).
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                eff = int(line.split()[1], 16)
                return bool(eff & (1 << 38)) and bool(eff & (1 << 39))
    except OSError:
        pass
    return False


def _rss_seed(pid: int) -> list[int]:
    """file, anon, swap, shmem bytes from /proc, until rss_stat reports them."""
    seed = [0, 0, 0, 0]
    keys = {"RssFile:": 0, "RssAnon:": 1, "VmSwap:": 2, "RssShmem:": 3}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            parts = line.split()
            if parts and parts[0] in keys:
                seed[keys[parts[0]]] = int(parts[1]) * 1024
    except OSError:
        pass
    return seed


def _tree(pid: int) -> list[int]:
    """pid and its descendants, from /proc/*/task/*/children."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                todo.extend(int(c) for c in task.read_text().split())
    return out


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


class KernelProbe:
    """The loaded BPF program plus the agent-name ↔ slot bookkeeping."""

    def __init__(self, count_syscalls: bool = False) -> None:
        check_environment()
        self.defs = features(count_syscalls)
        bcc = import_bcc()
        t0 = time.monotonic()
        try:
            self.bpf = bcc.BPF(text=generate_source(self.defs).encode())
        except Exception as exc:  # bcc raises bare Exception on compile/load errors
            raise ProbeUnavailable(f"BPF load failed: {exc}") from exc
        self.load_s = time.monotonic() - t0
        self.tids = self.bpf[b"tids"]
        self.procs = self.bpf[b"procs"]
        self.stats = self.bpf[b"stats"]
        self.slots: dict[str, int] = {}
        self.baseline: dict[str, dict[str, int]] = {}
        self.pending_events: list[dict[str, Any]] = []
        self.bpf[b"events"].open_ring_buffer(self._on_event)

    def watch(self, agent: str, pid: int) -> None:
        if agent not in self.slots:
            free = sorted(set(range(MAX_AGENTS)) - set(self.slots.values()))
            if not free:
                raise ProbeUnavailable(f"more than {MAX_AGENTS} agents")
            self.slots[agent] = free[0]
            # Slots are reused: counters restart from whatever the slot holds now.
            self.baseline[agent] = self._read_slot(free[0])
        slot = self.slots[agent]
        for tgid in _tree(pid):
            leaf = self.procs.Leaf()
            leaf.agent = slot
            for i, v in enumerate(_rss_seed(tgid)):
                leaf.rss[i] = v
            self.procs[self.procs.Key(tgid)] = leaf
            for tid in _threads(tgid):
                tleaf = self.tids.Leaf()
                tleaf.agent = slot
                # A thread on a CPU right now gets no switch-in event until it blocks or is
                # preempted: start its slice at the watch (bpf_ktime_get_ns is CLOCK_MONOTONIC).
                # If it is off-CPU instead, its next switch-in overwrites this.
                tleaf.in_ts = time.monotonic_ns()
                self.tids[self.tids.Key(tid)] = tleaf

    def unwatch(self, agent: str) -> None:
        slot = self.slots.pop(agent, None)
        self.baseline.pop(agent, None)
        if slot is None:
            return
        for table in (self.procs, self.tids):
            for k, v in list(table.items()):
                if v.agent == slot:
                    with contextlib.suppress(KeyError):
                        del table[k]

    def _read_slot(self, slot: int) -> dict[str, int]:
        per_cpu = self.stats.getvalue(self.stats.Key(slot))
        return {f: sum(getattr(c, f) for c in per_cpu) for f in STAT_FIELDS}

    def read(self) -> dict[str, dict[str, Any]]:
        """Cumulative counters per agent, plus the tree's RSS and process list."""
        by_slot: dict[int, dict[str, Any]] = {}
        for agent, slot in self.slots.items():
            now = self._read_slot(slot)
            base = self.baseline[agent]
            row: dict[str, Any] = {f: now[f] - base[f] for f in STAT_FIELDS}
            row.update(rss_file=0, rss_anon=0, rss_swap=0, rss_shmem=0, pids=[])
            by_slot[slot] = row
        for k, v in self._procs_items():
            found = by_slot.get(v.agent)
            if found is None:
                continue
            row = found
            row["pids"].append(k if isinstance(k, int) else k.value)
            row["rss_file"] += max(v.rss[0], 0)
            row["rss_anon"] += max(v.rss[1], 0)
            row["rss_swap"] += max(v.rss[2], 0)
            row["rss_shmem"] += max(v.rss[3], 0)
        out = {}
        for agent, slot in self.slots.items():
            row = by_slot[slot]
            row["pids"].sort()
            row["nprocs"] = len(row["pids"])
            row["rss_bytes"] = row["rss_file"] + row["rss_anon"] + row["rss_shmem"]
            out[agent] = row
        return out

    def _procs_items(self) -> Any:
        try:
            return list(self.procs.items_lookup_batch())
        except Exception:  # batch ops need 5.6+; fall back to key-by-key
            return list(self.procs.items())

    def poll_events(self) -> list[dict[str, Any]]:
        self.bpf.ring_buffer_consume()
        out, self.pending_events = self.pending_events, []
        return out

    def _on_event(self, _ctx: Any, data: Any, _size: int) -> None:
        ev = self.bpf[b"events"].event(data)
        names = {slot: name for name, slot in self.slots.items()}
        rec: dict[str, Any] = {
            "type": "event",
            "kind": EVENT_KINDS.get(ev.type, str(ev.type)),
            "agent": names.get(ev.agent),
            "pid": ev.tgid,
            "comm": ev.comm.decode(errors="replace"),
            "t": time.time(),
        }
        if ev.type == 1:
            rec["ppid"] = ev.ppid
        elif ev.type == 2:
            rec["filename"] = ev.filename.decode(errors="replace")
        elif ev.type == 3:
            rec.update(decode_status(ev.status))
        self.pending_events.append(rec)

    def close(self) -> None:
        self.bpf.cleanup()


def decode_status(status: int) -> dict[str, int | None]:
    """A wait status (exit_code << 8 | signal) as exit_code/signal fields."""
    if status < 0:
        return {"exit_code": None, "signal": None}
    sig = status & 0x7F
    if sig:
        return {"exit_code": None, "signal": sig}
    return {"exit_code": (status >> 8) & 0xFF, "signal": None}


def self_rss_bytes() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _out(obj: dict[str, Any]) -> None:
    jsonlines.LineWriter(sys.stdout)(obj)


def _emit(obj: dict[str, Any]) -> None:
    _out(obj)


def _handle(probe: KernelProbe, line: str) -> None:
    try:
        req = jsonlines.decode(line)
        if req is None:
            raise ValueError(f"not a JSON object: {line.strip()[:200]}")
        if req.get("cmd") == "watch":
            probe.watch(str(req["agent"]), int(req["pid"]))
        elif req.get("cmd") == "unwatch":
            probe.unwatch(str(req["agent"]))
        else:
            _emit({"type": "error", "why": f"unknown command: {line.strip()[:200]}"})
    except (ValueError, KeyError, ProbeUnavailable) as exc:
        _emit({"type": "error", "why": f"{type(exc).__name__}: {exc}"})


def serve(probe: KernelProbe, interval: float, exit_on_eof: bool = True) -> None:
    """The loader loop: stdin commands, ring-buffer events, a sample every interval."""
    _emit({
        "type": "ready", "load_s": round(probe.load_s, 3), "rss_bytes": self_rss_bytes(),
        "features": probe.defs, "pid": os.getpid(),
    })
    next_sample = time.monotonic()
    inputs = [sys.stdin]
    buf = ""
    while True:
        timeout = max(0.0, min(next_sample - time.monotonic(), 0.02))
        ready, _, _ = select.select(inputs, [], [], timeout) if inputs else ([], [], [])
        if not inputs:
            time.sleep(timeout)
        if ready:
            chunk = os.read(sys.stdin.fileno(), 65536).decode(errors="replace")
            if not chunk:
                if exit_on_eof:
                    return  # the reader went away: so do we
                inputs = []
                continue
            buf += chunk
            *lines, buf = buf.split("\n")
            for line in lines:
                if line.strip():
                    _handle(probe, line)
        for ev in probe.poll_events():
            _emit(ev)
        if time.monotonic() >= next_sample:
            _emit({"type": "sample", "t": time.time(), "agents": probe.read()})
            next_sample += interval
            if next_sample < time.monotonic():
                next_sample = time.monotonic() + interval


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fleettop.probes.sensors.ebpf", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interval", type=float, default=0.1, help="seconds between samples")
    ap.add_argument("--syscalls", action="store_true",
                    help="count syscalls (raw_syscalls:sys_enter; slows every process)")
    ap.add_argument("--print-c", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("-p", "--pid", type=int, action="append", default=[],
                    help="watch PID as agent 'pid-PID' (for trying it by hand)")
    args = ap.parse_args(argv)
    if args.print_c:
        print(generate_source(features(args.syscalls)))
        return 0
    try:
        probe = KernelProbe(count_syscalls=args.syscalls)
    except ProbeUnavailable as exc:
        _emit({"type": "unavailable", "why": str(exc)})
        return 2
    for pid in args.pid:
        probe.watch(f"pid-{pid}", pid)
    try:
        serve(probe, args.interval, exit_on_eof=not args.pid)
    except (KeyboardInterrupt, BrokenPipeError):
        pass
    finally:
        probe.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
