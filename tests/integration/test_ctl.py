"""`fleettop run --headless` as a real subprocess, steered with every `fleettop ctl` command."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleettop.supervisor.base import paths
from fleettop.supervisor.core import cgroups, proctree
from tests.support.processes import FLEETTOP, needs_cgroups

PY = sys.executable


def ctl(fleet: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    run = subprocess.run([*FLEETTOP, "ctl", "-f", str(fleet), *args], capture_output=True,
                         text=True, timeout=60)
    if check:
        assert run.returncode == 0, (args, run.stdout, run.stderr)
    return run


def status(fleet: Path) -> dict:
    return json.loads(ctl(fleet, "status", "--json").stdout)


def agent(fleet: Path, name: str) -> dict:
    return next(a for a in status(fleet)["agents"] if a["name"] == name)


def wait_until(pred, timeout: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if pred():
                return
        except (StopIteration, KeyError, json.JSONDecodeError, AssertionError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out: {what}")
        time.sleep(0.05)


@pytest.fixture
def fleet_proc(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(json.dumps({"agents": {
        "worker": {"cmd": ["sh", "-c", "echo hello from worker; sleep 1000 & sleep 1000 & wait"]},
        "other": {"cmd": ["sleep", "1000"], "depends_on": ["worker"]},
    }}))
    proc = subprocess.Popen([*FLEETTOP, "run", "--headless", str(fleet), "--events", "json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: paths.socket_path(fleet).exists()
               and agent(fleet, "other")["state"] == "running", what="fleet up")
    yield fleet, proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_every_ctl_command_round_trips(fleet_proc) -> None:
    fleet, proc = fleet_proc
    sock = paths.socket_path(fleet)
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700

    wait_until(lambda: len(agent(fleet, "worker")["pids"]) >= 3, what="the worker's tree")
    snap = status(fleet)
    worker = next(a for a in snap["agents"] if a["name"] == "worker")
    for key in ("name", "state", "reason", "pid", "pids", "cpu_percent", "rss_bytes", "source"):
        assert key in worker
    assert len(worker["pids"]) >= 3 and worker["pid"] in worker["pids"]
    assert "worker" in ctl(fleet, "status").stdout

    assert "worker: frozen" in ctl(fleet, "freeze", "worker").stdout
    assert agent(fleet, "worker")["state"] == "frozen"
    assert all(proctree.proc_state(p) in ("S", "D", "T") for p in worker["pids"])
    assert "worker: running" in ctl(fleet, "resume", "worker").stdout

    ext = subprocess.Popen(["sleep", "100"], start_new_session=True)
    try:
        assert json.loads(ctl(fleet, "freeze", "--pid", str(ext.pid), "--json").stdout)["ok"]
        assert proctree.proc_state(ext.pid) == "T"
        ctl(fleet, "resume", "--pid", str(ext.pid))
        wait_until(lambda: proctree.proc_state(ext.pid) == "S", what="external resumed")
    finally:
        ext.kill()
        ext.wait()

    old_pid = worker["pid"]
    ctl(fleet, "restart", "worker")
    new = agent(fleet, "worker")
    assert new["state"] == "running" and new["pid"] != old_pid and new["restarts"] == 1

    ctl(fleet, "stop", "other")
    assert agent(fleet, "other")["state"] == "stopped"
    ctl(fleet, "start", "other")
    assert agent(fleet, "other")["state"] == "running"

    wait_until(lambda: "hello from worker" in ctl(fleet, "logs", "worker", "-n", "20").stdout,
               what="log line")
    logs = json.loads(ctl(fleet, "logs", "worker", "--json").stdout)
    assert Path(logs["path"]).exists()

    events = ctl(fleet, "events", "-n", "200").stdout
    assert "agent.frozen worker" in events and "agent.resumed worker" in events
    as_json = json.loads(ctl(fleet, "events", "--json").stdout)["events"]
    assert {"ts", "kind", "agent", "reason", "data"} <= set(as_json[0])

    # With a backlog the freeze is seen whether it comes before or after the follower is
    # connected (it waited 0.5 s for that, and a loaded machine can take longer).
    follower = subprocess.Popen([*FLEETTOP, "ctl", "-f", str(fleet), "events", "--follow",
                                 "--json", "-n", "1000"], stdout=subprocess.PIPE, text=True)
    try:
        ctl(fleet, "freeze", "other")
        line = json.loads(follower.stdout.readline())
        while (line["kind"], line["agent"]) != ("agent.frozen", "other"):
            line = json.loads(follower.stdout.readline())
    finally:
        follower.terminate()
        follower.wait()

    bad = ctl(fleet, "freeze", "nobody", check=False)
    assert bad.returncode == 1 and "no agent named 'nobody'" in bad.stderr

    second = subprocess.run([*FLEETTOP, "run", "--headless", str(fleet), "--for", "1s"],
                            capture_output=True, text=True, timeout=60)
    assert second.returncode == 1 and "already running" in second.stderr
    assert f"fleettop ctl -f {fleet} status" in second.stderr

    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    events = [json.loads(line) for line in out.splitlines()]
    assert events[-1]["kind"] == "fleet.stopped"
    stops = [e["agent"] for e in events if e["kind"] == "agent.state"
             and e["data"]["to"] == "stopping" and e["reason"] == "fleet shutdown"]
    assert stops.index("other") < stops.index("worker")  # reverse dependency order
    assert all(proctree.proc_state(p) in (None, "Z") for p in new["pids"]), [
        (p, proctree.proc_state(p)) for p in new["pids"]]


def test_ctl_without_a_running_fleet_says_so(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("agents: {}\n")
    run = ctl(fleet, "status", check=False)
    assert run.returncode == 1 and "no fleettop is running for this fleet" in run.stderr


@needs_cgroups
def test_no_orphans_after_sigkill_of_fleettop(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    # A grandchild that calls setsid escapes its process group: only the cgroup holds it.
    fleet.write_text(json.dumps({"agents": {
        "escaper": {"cmd": ["sh", "-c", "setsid sleep 1000 & sleep 1000 & wait"]},
        "plain": {"cmd": ["sleep", "1000"], "limits": {"memory": "64MiB"}},
    }}))
    proc = subprocess.Popen([*FLEETTOP, "run", "--headless", str(fleet)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: paths.socket_path(fleet).exists()
                   and len(agent(fleet, "escaper")["pids"]) >= 3, what="fleet up")
        snap = status(fleet)
        pids = [p for a in snap["agents"] for p in a["pids"]]
        cgroup_root = snap["fleet"]["cgroup_root"]
        assert cgroup_root and len(pids) >= 4
        # On hybrid hosts the memory limit lives in a v1 cgroup beside the v2 one: it stayed
        # after a SIGKILL until the next start.
        own = cgroups.find_v1_memory()
        v1_dir = (own / cgroups.BASE_NAME / f"{paths.fleet_id(fleet)}.{snap['fleet']['pid']}"
                  if own else None)
        assert v1_dir is None or v1_dir.is_dir(), v1_dir
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    wait_until(lambda: not any(proctree.proc_state(p) not in (None, "Z") for p in pids), 10,
               "every agent process gone after the supervisor was SIGKILLed")
    wait_until(lambda: not Path(cgroup_root).exists(), 10, "the dead fleet's cgroup removed")
    if v1_dir is not None:
        wait_until(lambda: not v1_dir.exists(), 10, "its v1 memory cgroup removed")


def test_sigint_stops_the_fleet_cleanly(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(json.dumps({"agents": {"a": {"cmd": ["sleep", "1000"]}}}))
    proc = subprocess.Popen([*FLEETTOP, "run", "--headless", str(fleet), "--events", "text"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: paths.socket_path(fleet).exists()
               and agent(fleet, "a")["state"] == "running", what="up")
    pid = agent(fleet, "a")["pid"]
    os.kill(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "fleet.stopped" in out and proctree.proc_state(pid) in (None, "Z")
    assert not paths.socket_path(fleet).exists()


def test_run_for_duration_ends_by_itself(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(json.dumps({"agents": {"a": {"cmd": ["sleep", "1000"]}}}))
    run = subprocess.run([*FLEETTOP, "run", "--headless", str(fleet), "--for", "1s"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    kinds = [json.loads(line)["kind"] for line in run.stdout.splitlines()]
    assert "fleet.started" in kinds and kinds[-1] == "fleet.stopped"


def test_a_start_that_fails_is_reported_and_the_exit_code_says_so(tmp_path: Path) -> None:
    """A headless run whose agent could not start exited 0."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(json.dumps({"agents": {"a": {"cmd": ["sleep", "1000"]},
                                            "ghost": {"cmd": ["no-such-program-here"]}}}))
    run = subprocess.run([*FLEETTOP, "run", "--headless", str(fleet), "--for", "1s",
                          "--no-telemetry"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1, run.stderr
    assert "1 agent(s) could not start: ghost" in run.stderr, run.stderr
    assert "no-such-program-here' is not on this host's PATH" in run.stderr  # the warning


def test_reload_applies_the_changed_fleet_file_and_refuses_a_bad_one(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"

    def write(agents: dict, **extra) -> None:
        fleet.write_text(json.dumps({"agents": agents, **extra}))

    write({"keep": {"cmd": ["sleep", "1000"]}, "edit": {"cmd": ["sleep", "1000"]},
           "drop": {"cmd": ["sleep", "1000"]}})
    proc = subprocess.Popen([*FLEETTOP, "run", "--headless", str(fleet), "--no-telemetry"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: paths.socket_path(fleet).exists() and all(
            a["state"] == "running" for a in status(fleet)["agents"]), what="fleet up")
        row = next(c for c in status(fleet)["components"] if c["name"] == "proxy")
        assert row["relay"] == "one piece per read, uvloop" and row["relay"] in row["detail"]
        before = {a["name"]: a["pid"] for a in status(fleet)["agents"]}
        write({"keep": {"cmd": ["sleep", "1000"]}, "edit": {"cmd": ["sleep", "2000"]},
               "new": {"cmd": ["sleep", "1000"], "depends_on": ["keep"]}},
              proxy={"port": 1234})
        reply = json.loads(ctl(fleet, "reload", "--json").stdout)
        assert (reply["added"], reply["removed"], reply["changed"]) == (["new"], ["drop"],
                                                                        ["edit"])
        assert reply["needs_fleettop_restart"] == ["proxy"]
        events = json.loads(ctl(fleet, "events", "--json", "-n", "500").stdout)["events"]
        assert not [e for e in events if e["kind"] == "fleet.warning"]  # the proxy took it
        wait_until(lambda: agent(fleet, "new")["state"] == "running", what="new agent")
        after = {a["name"]: a for a in status(fleet)["agents"]}
        assert set(after) == {"keep", "edit", "new"}
        assert after["keep"]["pid"] == before["keep"]  # untouched
        assert after["edit"]["pid"] != before["edit"] and after["edit"]["state"] == "running"
        wait_until(lambda: not _alive(before["drop"]) and not _alive(before["edit"]),
                   what="the dropped and the replaced processes gone")
        # A bad file: a clear error with its position, and nothing changes.
        fleet.write_text('{"agents": {"keep": {"cmd": ["sleep", "1000"], "restrat": "no"}}}')
        bad = ctl(fleet, "reload", check=False)
        assert bad.returncode == 1 and "fleet file not applied" in bad.stderr
        assert "restrat" in bad.stderr and "fleet.yaml:1:" in bad.stderr
        assert {a["name"]: a["pid"] for a in status(fleet)["agents"]} == {
            n: a["pid"] for n, a in after.items()}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
