"""The real BPF program, loaded into this kernel, against real child processes.

Skips (printing what is missing) unless root with bcc, headers and tracefs; run
`.ci/install-bpf.sh` first. Tolerances are on amounts, never on timing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleettop.probes.sensors import ebpf
from fleettop.probes.sensors.source import TelemetrySource

try:
    ebpf.check_environment()
    MISSING = ""
except ebpf.ProbeUnavailable as exc:
    MISSING = str(exc)

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(bool(MISSING), reason=f"eBPF unavailable: {MISSING}"),
]

# The child waits for a line on stdin before acting, so the watch is in place first.
CHILD = """
import os, sys, time
sys.stdin.readline()
t_go = time.process_time()  # the probe counts from here: the watch was in place before "go"
action = sys.argv[1]
if action == "spin":
    t = time.process_time()
    while time.process_time() - t < 0.4:
        pass
elif action == "sleep":
    for _ in range(5):
        time.sleep(0.02)
elif action == "write":
    fd = os.open("/dev/null", os.O_WRONLY)
    for _ in range(20000):
        os.write(fd, b"x")
elif action == "alloc":
    buf = bytearray(96 << 20)
    for i in range(0, len(buf), 4096):
        buf[i] = 1
    print(open("/proc/self/status").read().split("VmRSS:")[1].split()[0], flush=True)
    sys.stdin.readline()
elif action == "net":
    import socket
    srv = socket.create_server(("127.0.0.1", 0))
    cli = socket.create_connection(srv.getsockname())
    conn, _ = srv.accept()
    cli.sendall(b"x" * 100000)
    got = 0
    while got < 100000:
        got += len(conn.recv(65536))
elif action == "tree":
    os.system("sh -c 'exit 7'")
    p = os.fork()
    if p == 0:
        os.kill(os.getpid(), 9)
    os.waitpid(p, 0)
print(time.process_time() - t_go, flush=True)
sys.exit(3)
"""


@pytest.fixture(scope="module")
def probe():
    p = ebpf.KernelProbe(count_syscalls=True)
    yield p
    p.close()


def run_child(probe: ebpf.KernelProbe, agent: str, action: str) -> tuple[dict, list, str]:
    child = subprocess.Popen([sys.executable, "-c", CHILD, action], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    probe.watch(agent, child.pid)
    out, _ = child.communicate("go\n", timeout=30)
    assert child.returncode == 3
    return probe.read()[agent], [e for e in probe.poll_events() if e["agent"] == agent], out


def test_spin_cpu_matches_the_childs_own_accounting(probe):
    stats, events, out = run_child(probe, "spin", "spin")
    child_cpu_ns = float(out.split()[-1]) * 1e9
    # The kernel's process_time since "go" and our sched_switch sum should agree within 15%
    # (its start-up before the watch was counted once, and on a loaded machine it is ~0.1 s).
    assert abs(stats["oncpu_ns"] - child_cpu_ns) < 0.15 * child_cpu_ns + 20e6, (stats, out)
    exits = [e for e in events if e["kind"] == "exit"]
    assert [(e["exit_code"], e["signal"]) for e in exits] == [(3, None)]
    assert stats["exits"] == 1 and stats["nprocs"] == 0


def test_sleep_blocks_and_write_counts_syscalls(probe):
    sleep, _, _ = run_child(probe, "sleeper", "sleep")
    assert sleep["nvcsw"] >= 5  # five sleeps: five voluntary switches at least
    write, _, _ = run_child(probe, "writer", "write")
    assert write["syscalls"] >= 20000


def test_socket_bytes_are_counted_both_ways(probe):
    if not probe.defs["HAVE_SOCK_LENGTH"]:
        pytest.skip("no sock:sock_{send,recv}_length tracepoints in this kernel")
    stats, _, _ = run_child(probe, "net", "net")
    assert stats["tx_bytes"] >= 100000 and stats["rx_bytes"] >= 100000


def test_tree_fork_exec_exit_codes_and_signals(probe):
    stats, events, _ = run_child(probe, "tree", "tree")
    assert stats["forks"] >= 2 and stats["execs"] >= 1
    exits = {(e["exit_code"], e["signal"]) for e in events if e["kind"] == "exit"}
    assert (7, None) in exits  # sh -c 'exit 7'
    assert (None, 9) in exits  # the forked child killed itself
    assert (3, None) in exits  # the root
    assert any(e["kind"] == "exec" and e["filename"].endswith("sh") for e in events)


def test_rss_of_the_tree_matches_proc(probe):
    child = subprocess.Popen([sys.executable, "-c", CHILD, "alloc"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        probe.watch("alloc", child.pid)
        child.stdin.write("go\n")
        child.stdin.flush()
        vmrss = int(child.stdout.readline()) * 1024
        rss = probe.read()["alloc"]["rss_bytes"]
        # rss_stat reports percpu counters that may lag by a batch: allow 8%.
        assert abs(rss - vmrss) < 0.08 * vmrss, (rss, vmrss)
        assert rss > 96 << 20
    finally:
        child.communicate("done\n", timeout=30)


def _memory_cgroup(limit: int) -> Path | None:
    for base, knob in ((Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
                       (Path("/sys/fs/cgroup"), "memory.max")):
        cg = base / f"fleettop-test-{os.getpid()}"
        try:
            cg.mkdir(exist_ok=True)
            (cg / knob).write_text(str(limit))
            return cg
        except OSError:
            if cg.exists():
                cg.rmdir()
    return None


def test_oom_kill_in_a_small_memory_cgroup(probe):
    cg = _memory_cgroup(48 << 20)
    if cg is None:
        pytest.skip("no writable memory cgroup (v1 memory or v2 memory.max) for an OOM test")
    try:
        code = ("import sys; sys.stdin.readline(); b=[]\n"
                "while True: b.append(bytearray(4<<20)); b[-1][::4096]=b'x'*(1024)")
        child = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE,
            preexec_fn=lambda: (cg / "cgroup.procs").write_text(str(os.getpid())))
        probe.watch("hog", child.pid)
        child.communicate(b"go\n", timeout=60)
        assert child.returncode == -9
        time.sleep(0.05)
        events = probe.poll_events()
        assert probe.read()["hog"]["oom_kills"] >= 1
        assert any(e["kind"] == "oom" and e["agent"] == "hog" for e in events)
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def test_unwatched_processes_are_not_counted(probe):
    probe.watch("idle", os.getpid())
    probe.unwatch("idle")
    assert "idle" not in probe.read()
    before = {k.value if hasattr(k, "value") else k for k, _ in probe._procs_items()}
    assert os.getpid() not in before


def test_telemetry_source_uses_ebpf_in_a_separate_process():
    src = TelemetrySource(prefer="ebpf", interval=0.05)
    src.start()
    try:
        assert src.source == "ebpf", src.why
        status = src.status()
        assert status["loader_pid"] != os.getpid()
        child = subprocess.Popen([sys.executable, "-c", CHILD, "spin"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        src.watch("spin", child.pid)
        deadline = time.monotonic() + 20  # the loader has the watch: it reports the child
        while "spin" not in src.sample():
            assert time.monotonic() < deadline, "the loader never reported the watched child"
            time.sleep(0.05)
        child.communicate("go\n", timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            s = src.sample().get("spin")
            if s and s.exits >= 1:
                break
            time.sleep(0.05)
        assert s is not None and s.source == "ebpf" and s.exits >= 1
        assert any(e["kind"] == "exit" and e["exit_code"] == 3 for e in src.events())
    finally:
        src.close()


def test_print_c_shows_substituted_defines(capsys):
    assert ebpf.main(["--print-c"]) == 0
    text = capsys.readouterr().out
    assert "#define COUNT_SYSCALLS 0" in text and "TRACEPOINT_PROBE(sched, sched_switch)" in text


def test_a_dead_loader_falls_back_to_procfs_and_says_why():
    src = TelemetrySource(prefer="auto", interval=0.05)
    src.start()
    try:
        assert src.source == "ebpf", src.why
        src.watch("me", os.getpid())
        os.kill(src.status()["loader_pid"], 9)
        deadline = time.monotonic() + 10
        while src.source == "ebpf" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert src.source == "procfs" and "loader exited" in src.why
        src.sample()
        time.sleep(0.05)
        assert src.sample()["me"].source == "procfs"
    finally:
        src.close()
