"""The GPU lock with real processes: FIFO order, dead holders, reused pids, garbage, timeouts."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleettop.supervisor.cli.lock import EXIT_SKIPPED
from fleettop.supervisor.gpu import lock as gpulock
from fleettop.supervisor.gpu.lock import GpuLock, LockTimeout, gpu_lock, status
from fleettop.supervisor.gpu.queue import proc_start_time

CHILD = """
import sys, time
from fleettop.supervisor.gpu.lock import gpu_lock
folder, name, hold = sys.argv[1], sys.argv[2], float(sys.argv[3])
with gpu_lock(folder, name=name, model="m", timeout=60) as lock:
    with open(folder + "/order", "a") as f:
        f.write(f"{lock.ticket.seq} {name}\\n")
    print("held", flush=True)
    time.sleep(hold)
"""


HOLDER = """
import os, sys, time
from fleettop.supervisor.gpu.lock import gpu_lock
folder, name, fork = sys.argv[1], sys.argv[2], sys.argv[3] == "fork"
with gpu_lock(folder, name=name, timeout=60) as lock:
    with open(folder + "/order", "a") as f:
        f.write(f"{lock.ticket.seq} {name}\\n")
    if fork and os.fork() == 0:  # a child that keeps copies of every fd, the pipe included
        time.sleep(600)
        os._exit(0)
    print("held", flush=True)
    sys.stdin.read()
"""


def _holder(folder: Path, name: str, fork: bool = False) -> subprocess.Popen[str]:
    """Holds the lock until its stdin is closed, then releases it the normal way."""
    return subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), name,
                             "fork" if fork else ""], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)


def _order(folder: Path) -> list[str]:
    return [line.split()[1] for line in (folder / "order").read_text().splitlines()]


def _queued(folder: Path) -> list[str]:
    return [q["name"] for q in status(folder)["queue"]]


def _child(folder: Path, name: str, hold: float = 0.0) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(folder), name, str(hold)],
                            stdout=subprocess.PIPE, text=True)


def _wait_until(cond: object, what: str, limit: float = 20.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.01)


def _lock_cli(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleettop.supervisor.cli.lock", "lock", *args],
                          capture_output=True, text=True, timeout=60, **kw)  # type: ignore


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "gpu"


def test_fifo_order_with_fifty_processes(folder: Path) -> None:
    holder = _child(folder, "holder", hold=1.0)
    assert holder.stdout and holder.stdout.readline() == "held\n"
    kids = [_child(folder, f"w{i}") for i in range(50)]
    for kid in kids:
        assert kid.wait(60) == 0
    holder.wait(10)
    lines = (folder / "order").read_text().split("\n")[:-1]
    seqs = [int(line.split()[0]) for line in lines]
    assert len(seqs) == 51
    assert seqs == sorted(seqs), "the lock was granted out of ticket order"
    assert status(folder)["queue"] == [] and status(folder)["holder"] is None


def test_holder_killed_next_waiter_proceeds(folder: Path) -> None:
    holder = _child(folder, "victim", hold=600)
    assert holder.stdout and holder.stdout.readline() == "held\n"
    waiter = _child(folder, "next")
    _wait_until(lambda: len(status(folder)["queue"]) == 1, "the waiter's ticket")
    assert status(folder)["holder"]["name"] == "victim"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert waiter.stdout and waiter.stdout.readline() == "held\n"
    assert waiter.wait(10) == 0
    st = status(folder)
    assert st["holder"] is None and st["queue"] == [] and st["stale"] == []


def test_waiter_behind_a_killed_waiter_keeps_its_place(folder: Path) -> None:
    holder = _holder(folder, "h")
    try:
        assert holder.stdout and holder.stdout.readline() == "held\n"
        doomed = _child(folder, "doomed")
        _wait_until(lambda: _queued(folder) == ["doomed"], "the first waiter")
        last = _child(folder, "last")
        _wait_until(lambda: _queued(folder) == ["doomed", "last"], "the second waiter")
        doomed.send_signal(signal.SIGKILL)
        doomed.wait()
        # `last` was watching `doomed`: it drops the dead ticket and waits for the holder.
        _wait_until(lambda: _queued(folder) == ["last"] and not status(folder)["stale"],
                    "the dead waiter's ticket to go")
        assert status(folder)["holder"]["name"] == "h"
        assert holder.stdin is not None
        holder.stdin.close()
        assert last.stdout and last.stdout.readline() == "held\n"
        assert last.wait(30) == 0 and holder.wait(30) == 0
    finally:
        holder.kill()
    assert _order(folder) == ["h", "last"]
    assert sorted(os.listdir(folder / "queue")) == []


async def test_cancelled_async_waiter_leaves_no_ticket_and_no_thread(folder: Path) -> None:
    holder = _holder(folder, "h")
    behind: subprocess.Popen[str] | None = None
    try:
        assert holder.stdout and holder.stdout.readline() == "held\n"
        threads = set(threading.enumerate())
        lock = GpuLock(folder, name="cancelled")
        task = asyncio.create_task(lock.acquire_async())
        while _queued(folder) != ["cancelled"]:
            await asyncio.sleep(0.01)
        seq = lock.ticket.seq if lock.ticket else None
        behind = _child(folder, "behind")
        while _queued(folder) != ["cancelled", "behind"]:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert _queued(folder) == ["behind"] and lock.ticket is None and not lock.held
        assert not [n for n in os.listdir(folder / "queue") if n.startswith(f"{seq:012d}.")]
        assert set(threading.enumerate()) == threads
        with pytest.raises(LockTimeout):
            await GpuLock(folder, name="impatient", timeout=0.05).acquire_async()
        assert set(threading.enumerate()) == threads and _queued(folder) == ["behind"]
        assert holder.stdin is not None
        holder.stdin.close()
        assert behind.stdout and behind.stdout.readline() == "held\n"  # it moved up a place
        assert behind.wait(30) == 0
    finally:
        holder.kill()
        if behind is not None:
            behind.kill()
    assert _order(folder) == ["h", "behind"]


async def test_release_wakes_the_next_while_a_forked_child_keeps_the_pipe(
        folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The child keeps the holder's pipe open, so its release must be told, not just seen as
    # a hangup: with the periodic look disabled, a missed wake-up would hang here.
    monkeypatch.setattr(gpulock, "_LOOK_AGAIN", 600.0)
    holder = _holder(folder, "parent", fork=True)
    try:
        assert holder.stdout and holder.stdout.readline() == "held\n"
        task = asyncio.create_task(GpuLock(folder, name="next").acquire_async())
        while _queued(folder) != ["next"]:
            await asyncio.sleep(0.01)
        assert holder.stdin is not None
        holder.stdin.close()
        lock = await asyncio.wait_for(task, 30)  # a hang guard, not a measurement
        assert lock.held and status(folder)["holder"]["name"] == "next"
        lock.release()
    finally:
        os.killpg(holder.pid, signal.SIGKILL)  # the forked child too
        holder.wait()


def test_leftovers_without_a_ticket_are_swept(folder: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    (folder / "queue").mkdir(parents=True)
    for name in ("000000000003.wake", "000000000004.held"):
        (folder / "queue" / name).write_text("")
    with caplog.at_level(logging.WARNING, logger="fleettop.supervisor.gpu.lock"), \
            gpu_lock(folder, timeout=5) as lock:
        assert lock.ticket is not None and lock.ticket.seq == 5
        assert sorted(os.listdir(folder / "queue")) == ["000000000005.held",
                                                        "000000000005.ticket",
                                                        "000000000005.wake"]
        assert status(folder)["ignored"] == []
    assert caplog.text == ""
    assert os.listdir(folder / "queue") == []


def _fake_ticket(folder: Path, seq: int, pid: int, start_time: int | None,
                 name: str = "ghost") -> Path:
    (folder / "queue").mkdir(parents=True, exist_ok=True)
    path = folder / "queue" / f"{seq:012d}.ticket"
    path.write_text(json.dumps({"pid": pid, "start_time": start_time, "host": gpulock.HOST,
                                "name": name, "model": None, "queued_at": time.time()}))
    (folder / "seq").write_text(str(seq))
    return path


def test_reused_pid_ticket_is_dropped_live_one_is_kept(folder: Path) -> None:
    # Our own pid, but another start time: the pid was reused, the ticket's owner is dead.
    ghost = _fake_ticket(folder, 1, os.getpid(), (proc_start_time(os.getpid()) or 0) + 7)
    with gpu_lock(folder, name="me", timeout=5) as lock:
        assert lock.held
    assert not ghost.exists()
    # A live process with the right start time keeps its place however old the ticket is.
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        live = _fake_ticket(folder, 10, sleeper.pid, proc_start_time(sleeper.pid), "sleeper")
        with pytest.raises(LockTimeout) as err:
            GpuLock(folder, name="late", timeout=0.3).acquire()
        assert err.value.position == 2
        assert live.exists()
        assert [q["name"] for q in status(folder)["queue"]] == ["sleeper"]
    finally:
        sleeper.kill()
        sleeper.wait()
    assert status(folder)["stale"][0]["name"] == "sleeper"
    with gpu_lock(folder, timeout=5):
        pass
    assert not live.exists()


def test_garbage_files_are_ignored_with_a_warning(folder: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    (folder / "queue").mkdir(parents=True)
    (folder / "queue" / "notes.txt").write_text("hello")
    (folder / "queue" / "000000000001.ticket").write_text("{not json")
    (folder / "seq").write_text("garbage")
    with caplog.at_level(logging.WARNING, logger="fleettop.supervisor.gpu.lock"), \
            gpu_lock(folder, timeout=5) as lock:
        assert lock.ticket is not None and lock.ticket.seq == 2
    assert "notes.txt" in caplog.text and "000000000001.ticket" in caplog.text
    assert sorted(status(folder)["ignored"]) == ["000000000001.ticket", "notes.txt"]


def test_a_garbage_file_is_warned_about_once(folder: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    """status() runs on every snapshot: its warning repeated on every call."""
    (folder / "queue").mkdir(parents=True)
    (folder / "queue" / "stray.txt").write_text("hello")
    with caplog.at_level(logging.WARNING, logger="fleettop.supervisor.gpu.lock"):
        for _ in range(3):
            assert status(folder)["ignored"] == ["stray.txt"]
    assert caplog.text.count("stray.txt") == 1, caplog.text


def test_timeout_gives_up_cleanly(folder: Path) -> None:
    holder = _child(folder, "busy", hold=600)
    try:
        assert holder.stdout and holder.stdout.readline() == "held\n"
        with pytest.raises(LockTimeout) as err:
            GpuLock(folder, name="impatient", timeout=0.2).acquire()
        assert err.value.holder is not None and err.value.holder["name"] == "busy"
        assert status(folder)["queue"] == []  # our ticket left with us
    finally:
        holder.kill()
        holder.wait()


async def test_async_acquire_waits_in_order(folder: Path) -> None:
    first = GpuLock(folder, name="a")
    await first.acquire_async()
    order: list[str] = []

    async def waiter(name: str) -> None:
        async with gpu_lock(folder, name=name, timeout=20):
            order.append(name)

    async def queued(n: int) -> None:
        for _ in range(2000):
            if len(status(folder)["queue"]) >= n:
                return
            await asyncio.sleep(0.01)

    t1 = asyncio.create_task(waiter("b"))
    await queued(1)
    t2 = asyncio.create_task(waiter("c"))
    await queued(2)
    first.release()
    await asyncio.gather(t1, t2)
    assert order == ["b", "c"]
    with pytest.raises(LockTimeout):
        async with gpu_lock(folder, timeout=0), gpu_lock(folder, timeout=0.1):
            pass


def test_lock_run_cli_exit_codes_and_skip(folder: Path) -> None:
    ok = _lock_cli("run", "--dir", str(folder), "--", sys.executable, "-c",
                   "import sys; sys.exit(3)")
    assert ok.returncode == 3
    crashed = _lock_cli("run", "--dir", str(folder), "--", sys.executable, "-c",
                        "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert crashed.returncode == 128 + signal.SIGKILL
    assert status(folder)["holder"] is None  # a crash inside `lock run` releases
    holder = _child(folder, "nightly", hold=600)
    try:
        assert holder.stdout and holder.stdout.readline() == "held\n"
        skipped = _lock_cli("run", "--dir", str(folder), "--timeout", "200ms", "--name", "cron",
                            "--", "true")
        assert skipped.returncode == EXIT_SKIPPED
        assert "skipped this run, will retry at the next schedule" in skipped.stderr
        st = _lock_cli("status", "--json", "--dir", str(folder))
        data = json.loads(st.stdout)
        assert data["holder"]["name"] == "nightly" and data["holder"]["model"] == "m"
        assert data["queue"] == []
        text = _lock_cli("status", "--dir", str(folder)).stdout
        assert "held by nightly" in text
    finally:
        holder.kill()
        holder.wait()


def test_status_json_lists_queue_in_order(folder: Path) -> None:
    holder = _child(folder, "h", hold=600)
    waiters: list[subprocess.Popen[str]] = []
    try:
        assert holder.stdout and holder.stdout.readline() == "held\n"
        for i in range(3):
            waiters.append(_child(folder, f"q{i}"))
            _wait_until(lambda n=i + 1: len(status(folder)["queue"]) == n, "a ticket")
        data = json.loads(_lock_cli("status", "--json", "--dir", str(folder)).stdout)
        assert [q["name"] for q in data["queue"]] == ["q0", "q1", "q2"]
        assert [q["position"] for q in data["queue"]] == [1, 2, 3]
        assert all(q["waited_s"] >= 0 for q in data["queue"])
    finally:
        holder.kill()
        holder.wait()
        for w in waiters:
            assert w.wait(30) == 0


async def _gate_order(folder: Path, max_wait: float) -> list[str]:
    from fleettop.supervisor.gpu.gate import GpuGate

    gate = GpuGate(folder, max_wait=max_wait)
    order: list[str] = []
    release_first = asyncio.Event()
    first_in = asyncio.Event()

    async def request(agent: str, model: str, hold: asyncio.Event | None = None) -> None:
        async with gate.slot(agent, model, wait=20):
            order.append(f"{agent}:{model}")
            first_in.set()
            holder = status(folder)["holder"]
            assert holder["name"].startswith("proxy:") and gate.in_flight == 1
            if hold is not None:
                await hold.wait()

    first = asyncio.create_task(request("a1", "A", release_first))
    await first_in.wait()
    rest = [asyncio.create_task(request(n, m)) for n, m in (("b1", "B"), ("a2", "A"),
                                                            ("a3", "A"))]
    await asyncio.sleep(0.05)
    release_first.set()
    await asyncio.gather(first, *rest)
    await gate.idle()
    assert gate.lock is None and status(folder)["holder"] is None  # idle gate lets go
    return order


async def test_proxy_gate_batches_by_model(folder: Path) -> None:
    assert await _gate_order(folder, max_wait=30) == ["a1:A", "a2:A", "a3:A", "b1:B"]


async def test_proxy_gate_max_wait_stops_starvation(folder: Path) -> None:
    assert await _gate_order(folder, max_wait=0) == ["a1:A", "b1:B", "a2:A", "a3:A"]


def test_pick_next_rule() -> None:
    from fleettop.supervisor.gpu.gate import GateRequest, pick_next

    loop = asyncio.new_event_loop()
    try:
        q = [GateRequest("x", m, t, loop.create_future()) for m, t in (("B", 0), ("A", 5))]
        assert pick_next(q, "A", now=10, max_wait=30).model == "A"
        assert pick_next(q, "A", now=31, max_wait=30).model == "B"
        assert pick_next(q, "C", now=10, max_wait=30).model == "B"
        assert pick_next([], "A", now=0, max_wait=1) is None
    finally:
        loop.close()


def test_lock_without_f_uses_the_queue_of_the_fleet_here(tmp_path: Path) -> None:
    """`fleettop lock run` the way the docs show it, next to fleet.yaml, queues where that
    fleet's GPU agents queue (it used a per-user folder of its own), and says so."""
    from fleettop.supervisor.config.load import load_fleet
    from fleettop.supervisor.core.supervisor import Supervisor

    (tmp_path / "fleet.yaml").write_text("agents:\n  a: {cmd: [sleep, '1'], gpu: exclusive}\n")
    env = {k: v for k, v in os.environ.items() if k != "FLEETTOP_GPU_LOCK_DIR"}
    agents_queue = Supervisor(load_fleet(tmp_path / "fleet.yaml")).state_dir / "gpu"
    st = json.loads(_lock_cli("status", "--json", cwd=tmp_path, env=env).stdout)
    assert Path(st["folder"]) == agents_queue and "fleet.yaml" in st["chosen_by"], st
    ran = _lock_cli("run", "--", "true", cwd=tmp_path, env=env)
    assert ran.returncode == 0 and f"queue {agents_queue}" in ran.stderr, ran.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    st = json.loads(_lock_cli("status", "--json", cwd=elsewhere, env=env).stdout)
    assert "per-user" in st["chosen_by"] and Path(st["folder"]) != agents_queue, st
