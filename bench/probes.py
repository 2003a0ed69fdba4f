"""Probe overhead and leak-detection latency, as one JSON object on stdout.

    sudo .venv/bin/python bench/probes.py [--rounds 9]

Overhead: a syscall-heavy child (os.write to /dev/null) and a CPU-bound child (a
Python loop) each time their own work; conditions alternate round by round: probes
off, default probes with the child unwatched and watched, and the same with syscall
counting (raw_syscalls:sys_enter). Ratios are medians over the rounds relative to
"off"; paired ratios divide each round by the same round's "off". Also: loader
load+attach time and RSS (as the separate process the supervisor runs), ring-buffer
events/s, and how long the leak detector takes on synthetic traces.
Without root/bcc the eBPF parts report why they were skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from fleettop.probes.sensors import ebpf
from fleettop.supervisor.detect.leaks import LeakDetector

MiB = 1 << 20
CHILD = """
import os, sys, time
sys.stdin.readline()
kind, n = sys.argv[1], int(sys.argv[2])
t = time.perf_counter()
if kind == "write":
    fd = os.open("/dev/null", os.O_WRONLY)
    for _ in range(n):
        os.write(fd, b"x")
elif kind == "cpu":
    x = 0
    for i in range(n):
        x += i
elif kind == "fork":
    for _ in range(n):
        p = os.fork()
        if p == 0:
            os._exit(0)
        os.waitpid(p, 0)
print(time.perf_counter() - t, flush=True)
"""
WORK = {"write": 200_000, "cpu": 3_000_000}
CONDITIONS = ("off", "default_unwatched", "default_watched", "syscalls_unwatched",
              "syscalls_watched")


def set_attached(probe: ebpf.KernelProbe, on: bool, saved: dict[bytes, bytes]) -> None:
    """Detach every tracepoint (remembering its function) or re-attach them."""
    b = probe.bpf
    if not on:
        for tp in list(b.tracepoint_fds):
            cat, name = tp.decode().split(":")
            saved[tp] = f"tracepoint__{cat}__{name}".encode()
            b.detach_tracepoint(tp=tp)
    else:
        for tp, fn in saved.items():
            if tp not in b.tracepoint_fds:
                b.attach_tracepoint(tp=tp, fn_name=fn)


def timed_child(kind: str, n: int, watch: ebpf.KernelProbe | None) -> float:
    child = subprocess.Popen([sys.executable, "-c", CHILD, kind, str(n)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if watch is not None:
        watch.watch("bench", child.pid)
    out, _ = child.communicate("go\n", timeout=120)
    if watch is not None:
        watch.unwatch("bench")
    return float(out.split()[-1])


def overhead(rounds: int) -> dict[str, Any]:
    default = ebpf.KernelProbe(count_syscalls=False)
    sysc = ebpf.KernelProbe(count_syscalls=True)
    saved_d: dict[bytes, bytes] = {}
    saved_s: dict[bytes, bytes] = {}
    set_attached(default, False, saved_d)
    set_attached(sysc, False, saved_s)
    times: dict[str, dict[str, list[float]]] = {k: {c: [] for c in CONDITIONS} for k in WORK}
    try:
        for _ in range(rounds):
            for cond in CONDITIONS:
                probe = sysc if cond.startswith("syscalls") else default
                if cond != "off":
                    set_attached(probe, True, saved_s if probe is sysc else saved_d)
                for kind, n in WORK.items():
                    watch = probe if cond.endswith("_watched") else None
                    times[kind][cond].append(timed_child(kind, n, watch))
                if cond != "off":
                    set_attached(probe, False, saved_s if probe is sysc else saved_d)
    finally:
        default.close()
        sysc.close()
    out: dict[str, Any] = {}
    for kind, by_cond in times.items():
        off = statistics.median(by_cond["off"])
        out[kind] = {
            "work": WORK[kind],
            "median_s": {c: round(statistics.median(v), 5) for c, v in by_cond.items()},
            "ratio_vs_off": {c: round(statistics.median(v) / off, 3)
                             for c, v in by_cond.items()},
            # each round's time over the same round's "off": cancels slow drift
            "paired_ratio_median": {
                c: round(statistics.median(a / b for a, b in zip(v, by_cond["off"],
                                                                 strict=True)), 3)
                for c, v in by_cond.items() if c != "off"},
        }
        if kind == "write":
            per_call = {c: round((statistics.median(v) - off) / WORK[kind] * 1e9, 1)
                        for c, v in by_cond.items() if c != "off"}
            out[kind]["added_ns_per_syscall"] = per_call
    return out


def loader(runs: int = 3) -> dict[str, Any]:
    loads, rss = [], []
    for _ in range(runs):
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "fleettop.probes.sensors.ebpf"],
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
        wall = time.monotonic() - t0
        msg = json.loads(proc.stdout.splitlines()[0])
        loads.append(msg["load_s"])
        rss.append(msg["rss_bytes"])
    return {"load_attach_s": loads, "process_wall_s_last": round(wall, 3),
            "loader_rss_mib": [round(r / MiB, 1) for r in rss],
            "supervisor_side": "bcc never imported in the supervisor: the loader is a child"}


def ringbuf_rate(n: int = 3000) -> dict[str, Any]:
    probe = ebpf.KernelProbe()
    try:
        child = subprocess.Popen([sys.executable, "-c", CHILD, "fork", str(n)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        probe.watch("forker", child.pid)
        child.stdin.write("go\n")
        child.stdin.flush()
        events: list[dict[str, Any]] = []
        while child.poll() is None:  # poll like the loader does, every 20 ms
            time.sleep(0.02)
            events += probe.poll_events()
        out = child.stdout.read()
        events += probe.poll_events()
        drops = probe.read()["forker"]["drops"]
    finally:
        probe.close()
    secs = float(out.split()[-1])
    return {"forks": n, "events": len(events), "drops": drops, "child_s": round(secs, 3),
            "events_per_s": round(len(events) / secs),
            "note": "fork+exit of a child per iteration; the child's rate bounds it"}


def leak_latency() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    t = np.arange(0, 60 * 60, 1.0)
    base = 400 * MiB + rng.normal(0, 2 * MiB, len(t))

    def first_trip(y: np.ndarray, onset: float) -> float | None:
        det = LeakDetector(limit=64 << 30)
        for ti, yi in zip(t, y, strict=True):
            if det.feed(ti, yi) is not None:
                return round(ti - onset, 1)
        return None

    onset = 600.0
    ramp = np.clip(t - onset, 0, None)
    saw = 200 * MiB * ((t % 30) / 30)
    spikes = np.zeros(len(t))
    for s in rng.uniform(0, t[-1], 60):
        spikes[(t >= s) & (t < s + rng.uniform(2, 20))] += rng.uniform(0.3, 1.5) * (1 << 30)
    return {
        "leak_1mib_per_s_detect_after_onset_s": first_trip(base + ramp * MiB, onset),
        "leak_5mib_per_min_sawtooth_detect_after_onset_s":
            first_trip(base + saw + ramp * 5 * MiB / 60, onset),
        "false_leaks": {
            "flat_spikes": first_trip(base + spikes, 0),
            "sawtooth": first_trip(base + saw, 0),
            "model_load_step": first_trip(base + (t >= 1800) * (2 << 30), 0),
            "warmup_plateau": first_trip(base + 400 * MiB / (1 + np.exp(-(t - 120) / 25)), 0),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    result: dict[str, Any] = {"kernel": os.uname().release, "cpus": os.cpu_count(),
                              "rounds": args.rounds}
    try:
        ebpf.check_environment()
        result["features"] = ebpf.features()
        result["loader"] = loader()
        result["overhead"] = overhead(args.rounds)
        result["ringbuf"] = ringbuf_rate()
    except ebpf.ProbeUnavailable as exc:
        result["ebpf_skipped"] = str(exc)
    result["leak"] = leak_latency()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
