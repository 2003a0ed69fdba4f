"""Supervisor speed and footprint, side by side with supervisord, in one run. Prints JSON.

- start/stop time of N sleeping agents (fleettop headless vs supervisord 4.3.0),
- headless supervisor CPU% and RSS while supervising 200 idle agents (telemetry off),
- freeze/resume latency over the control socket: request → `frozen 1` observed, p50/p99.

supervisord is installed into a throwaway venv when it isn't on PATH (pass --no-supervisord
to skip it). Usage: python bench/supervisor.py [--agents 50,200] [--idle 30] [--freezes 100]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLEETTOP = [sys.executable, "-m", "fleettop.supervisor.cli.main"]


def proc_cpu_rss(pid: int) -> tuple[float, int]:
    """(user+system seconds, RSS bytes) of one process."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])
    with open(f"/proc/{pid}/statm") as fh:
        rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return ticks / os.sysconf("SC_CLK_TCK"), rss


def count_sleepers(tag: str) -> int:
    n = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    if tag.encode() in fh.read():
                        n += 1
            except OSError:
                continue
    return n


def wait(pred, timeout: float = 120.0, step: float = 0.005) -> float:
    t0 = time.perf_counter()
    while not pred():
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError
        time.sleep(step)
    return time.perf_counter() - t0


_CONNS: dict[Path, socket.socket] = {}


def fleettop_request(sock: Path, req: dict) -> dict:
    """One request over a kept-open control connection, as the UI and scripts hold one."""
    s = _CONNS.get(sock)
    if s is None:
        s = _CONNS[sock] = socket.socket(socket.AF_UNIX)
        s.connect(str(sock))
    s.sendall(json.dumps(req).encode() + b"\n")
    buf = b""
    while not buf.endswith(b"\n"):
        buf += s.recv(1 << 20)
    return json.loads(buf)


def bench_fleettop(n: int, tmp: Path, idle: float, freezes: int) -> dict:
    tag = f"9{n:04d}1"  # a sleep duration unique to this run, to find its processes
    fleet = tmp / f"fleet{n}.yaml"
    # Plain sleepers, as supervisord gets: no token proxy (it would start its own process,
    # ~1 s of mitmproxy imports, before the first agent).
    fleet.write_text(json.dumps({"agents": {f"a{i}": {"cmd": ["sleep", tag], "proxy": False}
                                            for i in range(n)}}))
    env = dict(os.environ, FLEETTOP_STATE_DIR=str(tmp / "state"),
               FLEETTOP_RUNTIME_DIR=str(tmp / "run"))
    t0 = time.perf_counter()
    proc = subprocess.Popen([*FLEETTOP, "run", "--headless", str(fleet), "--no-telemetry"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    wait(lambda: count_sleepers(f"sleep\0{tag}") >= n)
    started = time.perf_counter() - t0
    out: dict = {"agents": n, "start_s": round(started, 3)}
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    os.environ.update(FLEETTOP_RUNTIME_DIR=str(tmp / "run"))
    from fleettop.supervisor.base import paths

    sock = paths.socket_path(fleet)
    wait(sock.exists)
    if idle:
        out.update(measure_idle(proc.pid, idle))
    if freezes:
        snap = fleettop_request(sock, {"cmd": "status"})
        cg = {a["name"]: a["cgroup"] for a in snap["agents"]}
        lat_freeze, lat_resume, via = [], [], None
        for i in range(freezes):
            name = f"a{i % n}"
            events = Path(cg[name]) / "cgroup.events" if cg[name] else None
            t = time.perf_counter()
            reply = fleettop_request(sock, {"cmd": "freeze", "name": name})
            if events is not None:
                wait(lambda ev=events: "frozen 1" in ev.read_text(), 5, 0)
            lat_freeze.append(time.perf_counter() - t)
            via = reply.get("via")
            t = time.perf_counter()
            fleettop_request(sock, {"cmd": "resume", "name": name})
            if events is not None:
                wait(lambda ev=events: "frozen 0" in ev.read_text(), 5, 0)
            lat_resume.append(time.perf_counter() - t)
        out["freeze"] = {"via": via, "n": freezes, **pct(lat_freeze)}
        out["resume"] = {"n": freezes, **pct(lat_resume)}
    conn = _CONNS.pop(sock, None)
    if conn is not None:
        conn.close()
    out["stop_s"] = measure_stop(proc, tag)
    return out


def measure_idle(pid: int, seconds: float) -> dict:
    """CPU% and RSS of one process over an idle window, after 2 s to settle."""
    time.sleep(2)
    cpu0, _ = proc_cpu_rss(pid)
    t0 = time.perf_counter()
    time.sleep(seconds)
    cpu1, rss = proc_cpu_rss(pid)
    return {"idle_s": seconds,
            "idle_cpu_percent": round(100 * (cpu1 - cpu0) / (time.perf_counter() - t0), 3),
            "idle_rss_mib": round(rss / 2**20, 1)}


def measure_stop(proc: subprocess.Popen, tag: str) -> float:
    """SIGTERM the supervisor; seconds until its last agent is gone."""
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    wait(lambda: count_sleepers(f"sleep\0{tag}") == 0)
    return round(time.perf_counter() - t0, 3)


def pct(samples: list[float]) -> dict:
    ms = sorted(s * 1000 for s in samples)
    return {"p50_ms": round(statistics.median(ms), 3),
            "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 3),
            "max_ms": round(ms[-1], 3)}


def supervisord_bin(tmp: Path) -> Path | None:
    found = shutil.which("supervisord")
    if found:
        return Path(found)
    venv = tmp / "sv-venv"
    if subprocess.run([sys.executable, "-m", "venv", str(venv)]).returncode:
        return None
    pip = subprocess.run([str(venv / "bin/pip"), "install", "-q", "supervisor==4.3.0"],
                         capture_output=True)
    return venv / "bin/supervisord" if pip.returncode == 0 else None


def bench_supervisord(binary: Path, n: int, tmp: Path, idle: float) -> dict:
    tag = f"8{n:04d}1"
    conf = tmp / f"sv{n}.conf"
    lines = [f"[supervisord]\nnodaemon=true\nlogfile={tmp}/sv{n}.log\npidfile={tmp}/sv{n}.pid\n"
             f"childlogdir={tmp}\n"]
    lines += [f"[program:a{i}]\ncommand=sleep {tag}\nstartsecs=0\nstopasgroup=true\n"
              for i in range(n)]
    conf.write_text("\n".join(lines))
    t0 = time.perf_counter()
    proc = subprocess.Popen([str(binary), "-c", str(conf)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    wait(lambda: count_sleepers(f"sleep\0{tag}") >= n)
    out: dict = {"agents": n, "start_s": round(time.perf_counter() - t0, 3)}
    if idle:
        out.update(measure_idle(proc.pid, idle))
    out["stop_s"] = measure_stop(proc, tag)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--agents", default="50,200")
    ap.add_argument("--idle", type=float, default=30.0, help="idle window for the largest N")
    ap.add_argument("--freezes", type=int, default=100)
    ap.add_argument("--no-supervisord", action="store_true")
    args = ap.parse_args()
    sizes = [int(x) for x in args.agents.split(",")]
    result: dict = {"bench": "supervisor", "cpus": os.cpu_count(), "fleettop": [],
                    "supervisord": []}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        sv = None if args.no_supervisord else supervisord_bin(tmp)
        result["supervisord_version"] = (subprocess.run([str(sv), "--version"],
                                                        capture_output=True, text=True)
                                          .stdout.strip() if sv else None)
        for n in sizes:
            last = n == max(sizes)
            # Alternate the two so drift on a shared machine hits both alike.
            result["fleettop"].append(bench_fleettop(n, tmp, args.idle if last else 0,
                                                     args.freezes if last else 0))
            if sv:
                result["supervisord"].append(bench_supervisord(sv, n, tmp,
                                                               args.idle if last else 0))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
