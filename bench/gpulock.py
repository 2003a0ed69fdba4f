"""GPU lock bench: one JSON object on stdout.

- uncontended acquire/release latency (p50/p99, µs), in-process;
- handoff latency between processes: holder releases → next process holds (p50/p99, ms);
- 50 processes contending: handoffs/s and FIFO violations (max overtakes);
- recovery: holder SIGKILLed → next waiter holds (ms).

The contended run is done twice. First each process exits as soon as it has released (the
original measurement): on 2 cores that mostly measures Python's exit (~10 ms of CPU per
process) competing with the next holder. Then (`lock_only_*`) each process stays alive
until all are done, so only the lock's handoff is on the clock.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fleettop.supervisor.gpu.lock import GpuLock, status

CHILD = """
import sys, time
from fleettop.supervisor.gpu.lock import gpu_lock
folder, mode = sys.argv[1], sys.argv[2]
with gpu_lock(folder, name="bench", timeout=120) as lock:
    t = time.time()
    with open(folder + "/log", "a") as f:
        f.write(f"{lock.ticket.seq} {t!r}\\n")
    if mode == "hold":
        print("held", flush=True)
        time.sleep(600)
if mode == "linger":
    sys.stdin.read()
"""


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def uncontended(folder: Path, n: int = 2000) -> dict[str, float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        lock = GpuLock(folder, name="bench")
        lock.acquire()
        lock.release()
        samples.append((time.perf_counter() - t0) * 1e6)
    return {"acquire_release_p50_us": round(pct(samples, 0.5), 1),
            "acquire_release_p99_us": round(pct(samples, 0.99), 1)}


def contended(folder: Path, procs: int = 50, linger: bool = False) -> dict[str, float]:
    holder = subprocess.Popen([sys.executable, "-c", CHILD, str(folder), "hold"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout and holder.stdout.readline() == "held\n"
    mode = "linger" if linger else "quick"
    kids = [subprocess.Popen([sys.executable, "-c", CHILD, str(folder), mode],
                             stdin=subprocess.PIPE if linger else None)
            for _ in range(procs)]
    while len(status(folder)["queue"]) < procs:
        time.sleep(0.01)
    t_kill = time.time()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    log = folder / "log"
    while linger and len(log.read_text().splitlines()) < procs + 1:
        time.sleep(0.01)
    for k in kids:
        if k.stdin:
            k.stdin.close()
        k.wait(120)
    rows = [line.split() for line in log.read_text().splitlines()][1:]
    seqs = [int(r[0]) for r in rows]
    times = [float(r[1]) for r in rows]
    overtakes = sum(1 for i, s in enumerate(seqs) for later in seqs[i + 1:] if later < s)
    gaps = [(b - a) * 1000 for a, b in zip(times, times[1:], strict=False)]
    span = times[-1] - times[0]
    out = {"contenders": procs,
           "handoffs_per_s": round((len(times) - 1) / span, 1) if span > 0 else None,
           "handoff_p50_ms": round(statistics.median(gaps), 3),
           "handoff_p99_ms": round(pct(gaps, 0.99), 3),
           "fifo_overtakes": overtakes,
           "dead_holder_to_next_ms": round((times[0] - t_kill) * 1000, 2)}
    return {f"lock_only_{k}": v for k, v in out.items() if k != "contenders"} if linger else out


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out: dict[str, object] = {"bench": "gpulock", "cpus": os.cpu_count()}
        out.update(uncontended(Path(tmp) / "a"))
        out.update(contended(Path(tmp) / "b"))
        out.update(contended(Path(tmp) / "c", linger=True))
        print(json.dumps(out))


if __name__ == "__main__":
    main()
