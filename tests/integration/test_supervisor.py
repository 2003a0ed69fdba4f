"""The supervisor with real processes, signals and cgroups: no mocks of the OS."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from fleettop.supervisor.config.load import parse_fleet
from fleettop.supervisor.control.dispatch import dispatch
from fleettop.supervisor.core import cgroups, proctree
from fleettop.supervisor.core.agent import AgentState
from fleettop.supervisor.core.supervisor import Supervisor
from tests.support.processes import needs_cgroups

PY = sys.executable


async def wait_for(pred: Callable[[], object], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or pred}")
        await asyncio.sleep(0.02)


def fleet_of(tmp: Path, text: str | dict):
    if isinstance(text, dict):
        text = json.dumps(text)  # JSON is YAML: no quoting puzzles for shell scripts
    path = tmp / "fleet.yaml"
    path.write_text(text)
    return parse_fleet(text, str(path))


async def running(tmp: Path, text: str | dict,
                  use_cgroups: bool = True) -> AsyncIterator[Supervisor]:
    sup = Supervisor(fleet_of(tmp, text), use_cgroups=use_cgroups)
    await sup.start()
    try:
        yield sup
    finally:
        await sup.shutdown()


def kinds(sup: Supervisor, kind: str, agent: str | None = None) -> list:
    return [e for e in sup.events if e.kind == kind and (agent is None or e.agent == agent)]


def transitions(sup: Supervisor, agent: str) -> list[str]:
    return [e.data["to"] for e in kinds(sup, "agent.state", agent)]


def alive(pid: int) -> bool:
    state = proctree.proc_state(pid)
    return state is not None and state != "Z"


TICKER = ("import os,sys,time\np=sys.argv[1]\nos.fork(); os.fork()\n"
          "while True:\n  open(p+str(os.getpid()),'a').write('x'); time.sleep(0.02)")


@pytest.mark.parametrize("isolation", ["cgroup", "signal"])
async def test_freeze_and_resume_a_multiprocess_agent(tmp_path: Path, isolation: str) -> None:
    if isolation == "cgroup" and cgroups.find_v2_mount() is None:
        pytest.skip("no cgroup v2 mount: the cgroup freezer can't be tested here")
    # sh → python → 3 forks: a 5-process tree, each process writing its own file.
    cmd = ["/bin/sh", "-c", '"$1" -c "$2" "$3" & wait', "sh", PY, TICKER, f"{tmp_path}/t."]
    text = {"agents": {"tick": {"cmd": cmd}}}
    async for sup in running(tmp_path, text, use_cgroups=isolation == "cgroup"):
        rt = sup.agents["tick"]
        await wait_for(lambda: len(list(tmp_path.glob("t.*"))) >= 4, what="4 tickers")
        pids = rt.pids()
        assert len(pids) >= 4  # sh + the python and its 3 forks
        if isolation == "cgroup" and rt.cgroup is None:
            pytest.skip(f"cgroup v2 not writable here: {sup.cgroup_reason}")
        reply = await sup.freeze_agent("tick", "test freeze")
        assert reply["ok"] and reply["via"] == isolation
        assert rt.state is AgentState.FROZEN
        if isolation == "cgroup":
            assert cgroups.read_events(rt.cgroup)["frozen"] == 1
        else:
            assert all(proctree.proc_state(p) == "T" for p in pids)
        sizes = {p: p.stat().st_size for p in tmp_path.glob("t.*")}
        await asyncio.sleep(0.5)
        assert {p: p.stat().st_size for p in tmp_path.glob("t.*")} == sizes, "ran while frozen"
        assert all(alive(p) for p in pids), "memory kept: every process still exists"
        await sup.resume_agent("tick")
        assert rt.state is AgentState.RUNNING
        if isolation == "cgroup":
            assert cgroups.read_events(rt.cgroup)["frozen"] == 0
        await wait_for(lambda: any(p.stat().st_size > sizes.get(p, 0)
                                   for p in tmp_path.glob("t.*")), what="progress after resume")
        frozen = kinds(sup, "agent.frozen", "tick")
        assert frozen and frozen[0].data["via"] == isolation and frozen[0].reason == "test freeze"


async def test_frozen_agent_is_never_restarted(tmp_path: Path) -> None:
    text = "agents:\n  a: {cmd: [sleep, '1000'], restart: always}\n"
    async for sup in running(tmp_path, text):
        rt = sup.agents["a"]
        await sup.freeze_agent("a", "hold")
        pid = rt.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)  # someone kills it while frozen
        await wait_for(lambda: rt.pid is None, what="exit")
        await asyncio.sleep(0.3)
        assert rt.state is AgentState.EXITED and rt.restarts == 0


async def test_restart_backoff_then_start_limit(tmp_path: Path) -> None:
    text = ("agents:\n  crash:\n    cmd: [sh, -c, 'echo boom; exit 3']\n"
            "    backoff: {initial: 0.05s, factor: 2, max: 0.2s, jitter: 0}\n"
            "    start_limit: {burst: 4, interval: 60s}\n")
    async for sup in running(tmp_path, text):
        rt = sup.agents["crash"]
        await wait_for(lambda: rt.state is AgentState.FAILED, what="failed")
        assert rt.restarts == 3 and rt.exit_code == 3
        delays = [e.data["delay"] for e in kinds(sup, "agent.state", "crash")
                  if e.data["to"] == "backoff"]
        assert delays == [0.05, 0.1, 0.2]  # exponential, capped at max
        assert "start limit hit: 4 exits in 60s" in rt.reason
        assert "boom" in "\n".join(rt.log.lines(50))


async def test_backoff_has_jitter_and_resets_after_a_stable_run(tmp_path: Path) -> None:
    from fleettop.supervisor.core.agent import backoff_delay

    spec = fleet_of(tmp_path, "agents:\n  a: {cmd: x, backoff: {initial: 1s, max: 8s}}\n"
                    ).agents["a"]
    samples = {round(backoff_delay(spec, 2), 3) for _ in range(50)}
    assert len(samples) > 10 and all(3.2 <= s <= 4.8 for s in samples)
    assert all(backoff_delay(spec, 20) <= 8.0 for _ in range(50))
    text = ("agents:\n  flaky:\n    cmd: [sh, -c, 'sleep 0.3; exit 1']\n"
            "    backoff: {initial: 0.05s, jitter: 0, reset_after: 0.2s}\n"
            "    start_limit: {burst: 2, interval: 60s}\n")
    async for sup in running(tmp_path, text):
        rt = sup.agents["flaky"]
        await wait_for(lambda: rt.restarts >= 3, what="3 restarts")
        # Each run outlived reset_after, so the attempt count and the start limit reset.
        assert rt.state is not AgentState.FAILED
        delays = [e.data["delay"] for e in kinds(sup, "agent.state", "flaky")
                  if e.data["to"] == "backoff"]
        assert set(delays) == {0.05}


async def test_restart_policies(tmp_path: Path) -> None:
    text = ("agents:\n  ok-no: {cmd: 'true', restart: no}\n"
            "  ok-onfail: {cmd: 'true'}\n"
            "  ok-always: {cmd: 'true', restart: always, backoff: {initial: 0.05s}}\n")
    async for sup in running(tmp_path, text):
        await wait_for(lambda: sup.agents["ok-always"].restarts >= 2, what="always restarts")
        assert sup.agents["ok-no"].state is AgentState.EXITED
        assert sup.agents["ok-onfail"].state is AgentState.EXITED
        assert sup.agents["ok-onfail"].exit_code == 0


async def test_depends_on_orders_start_and_reverses_stop(tmp_path: Path) -> None:
    text = ("agents:\n  web: {cmd: [sleep, '100'], depends_on: [api]}\n"
            "  api: {cmd: [sleep, '100'], depends_on: [db]}\n"
            "  db: {cmd: [sleep, '100']}\n")
    sup = Supervisor(fleet_of(tmp_path, text))
    await sup.start()
    await sup.shutdown()
    started = [e.agent for e in kinds(sup, "agent.state") if e.data["to"] == "running"]
    stopped = [e.agent for e in kinds(sup, "agent.state") if e.data["to"] == "stopped"]
    assert started == ["db", "api", "web"]
    assert stopped == ["web", "api", "db"]


async def test_stop_escalates_to_sigkill_for_the_whole_tree(tmp_path: Path) -> None:
    stubborn = ("import signal,os,time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)"
                "\nos.fork()\ntime.sleep(1000)")
    text = {"agents": {"stubborn": {"cmd": [PY, "-c", stubborn], "stop_timeout": "0.5s"}}}
    async for sup in running(tmp_path, text):
        rt = sup.agents["stubborn"]
        await wait_for(lambda: len(rt.pids()) >= 2, what="fork")
        pids = rt.pids()
        await sup.stop_agent("stubborn")
        assert rt.state is AgentState.STOPPED
        assert kinds(sup, "agent.kill", "stubborn")
        await wait_for(lambda: not any(alive(p) for p in pids), 5, "tree gone")


async def test_cron_run_still_going_is_skipped_not_stacked(tmp_path: Path) -> None:
    # croniter's sixth field is seconds: due every second, each run takes ~2.5 s.
    text = ("agents:\n  batch:\n    cmd: [sh, -c, 'echo run; sleep 2.5']\n"
            "    schedule: '* * * * * *'\n")
    async for sup in running(tmp_path, text):
        rt = sup.agents["batch"]
        assert rt.state is AgentState.SCHEDULED and rt.next_run is not None
        await wait_for(lambda: len(kinds(sup, "agent.skipped", "batch")) >= 1, 8, "skip")
        runs = [e for e in kinds(sup, "agent.state", "batch") if e.data["to"] == "running"]
        assert len(runs) == 1  # the skipped slot did not start a second, stacked run
        assert "previous run still running" in kinds(sup, "agent.skipped", "batch")[0].reason
        await wait_for(lambda: rt.state is AgentState.SCHEDULED and rt.exit_code == 0, 8,
                       "back to scheduled")


async def test_a_frozen_cron_agent_keeps_its_schedule(tmp_path: Path) -> None:
    """A due slot while the run is frozen is skipped with an event (it was an
    IllegalTransition frozen → scheduled that ended the schedule); the timer stays armed,
    and after the resume the run finishes and the agent is scheduled again."""
    text = ("agents:\n  nightly:\n    cmd: [sh, -c, 'echo run; sleep 3']\n"
            "    schedule: '* * * * * *'\n")
    async for sup in running(tmp_path, text):
        rt = sup.agents["nightly"]
        await wait_for(lambda: rt.state is AgentState.RUNNING, 8, "first run")
        assert (await sup.freeze_agent("nightly", "test"))["ok"]
        await wait_for(lambda: any("still frozen" in e.reason
                                   for e in kinds(sup, "agent.skipped", "nightly")), 8,
                       "a slot skipped while frozen")
        assert rt.state is AgentState.FROZEN and "nightly" in sup._timers
        due = rt.next_run
        await wait_for(lambda: rt.next_run != due, 5, "the timer re-armed")
        assert (await sup.resume_agent("nightly", "test"))["ok"]
        await wait_for(lambda: rt.state is AgentState.SCHEDULED and rt.exit_code == 0, 10,
                       "scheduled again after the resumed run ended")


async def test_freeze_an_external_pid(tmp_path: Path) -> None:
    ext = subprocess.Popen(["sleep", "100"])
    try:
        async for sup in running(tmp_path, "agents: {}\n"):
            reply = await dispatch(sup, {"cmd": "freeze", "pid": ext.pid})
            assert reply["ok"] and proctree.proc_state(ext.pid) == "T"
            snap = sup.snapshot()
            assert snap["external"][0]["pid"] == ext.pid
            assert snap["external"][0]["state"] == "frozen"
            reply = await dispatch(sup, {"cmd": "resume", "pid": ext.pid})
            assert reply["ok"]
            # SIGCONT makes it runnable (R) for a moment before it sleeps again (S).
            await wait_for(lambda: proctree.proc_state(ext.pid) == "S", 5, "asleep again")
            assert (await dispatch(sup, {"cmd": "freeze", "pid": 999999}))["ok"] is False
    finally:
        ext.kill()
        ext.wait()


async def test_log_rotation_and_tail(tmp_path: Path) -> None:
    script = "for i in $(seq 1 400); do echo line-$i-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxx; done"
    text = (f"agents:\n  chatty:\n    cmd: \"{script}\"\n    shell: true\n    restart: no\n"
            "    log: {max_bytes: 4KiB, backups: 2, tail_lines: 50}\n")
    async for sup in running(tmp_path, text):
        rt = sup.agents["chatty"]
        await wait_for(lambda: rt.state is AgentState.EXITED, what="exit")
        path = rt.log.path
        rotated = sorted(path.parent.glob(path.name + ".*"))
        assert [p.name for p in rotated] == [path.name + ".1", path.name + ".2"]
        assert all(p.stat().st_size <= 4096 for p in [path, *rotated])
        assert not path.with_name(path.name + ".3").exists()
        tail = rt.log.lines(50)
        assert any("line-400-" in line for line in tail)
        assert "line-1-" not in "\n".join(tail)


@needs_cgroups
async def test_memory_limit_applied_where_the_controller_exists(tmp_path: Path) -> None:
    text = "agents:\n  capped: {cmd: [sleep, '100'], limits: {memory: 64MiB}}\n"
    async for sup in running(tmp_path, text):
        rt = sup.agents["capped"]
        tree = sup.cgroup_tree
        assert tree is not None and rt.cgroup is not None
        await wait_for(lambda: rt.pid in cgroups.procs(rt.cgroup), what="joined")
        if "memory" in tree.controllers:
            assert (rt.cgroup / "memory.max").read_text().strip() == str(64 * 1024**2)
        elif tree.v1_memory is not None:  # hybrid: the limit lives in the v1 hierarchy
            v1 = tree.v1_memory / "capped"
            assert (v1 / "memory.limit_in_bytes").read_text().strip() == str(64 * 1024**2)
            assert str(rt.pid) in (v1 / "cgroup.procs").read_text().split()
            assert kinds(sup, "agent.limits", "capped")
        else:
            warn = [e.reason for e in kinds(sup, "agent.warning", "capped")]
            assert any("limits.memory not enforced" in w for w in warn), warn
    assert tree.v1_memory is None or not tree.v1_memory.exists()  # removed at shutdown


@needs_cgroups
async def test_leftover_cgroup_of_a_dead_fleettop_is_cleaned(tmp_path: Path) -> None:
    mount = cgroups.find_v2_mount()
    assert mount is not None
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = mount / cgroups.BASE_NAME / f"ghost-0000.{dead.pid}"
    (stale / "agent").mkdir(parents=True)
    orphan = subprocess.Popen(["sleep", "100"])
    (stale / "agent" / "cgroup.procs").write_text(str(orphan.pid))
    async for sup in running(tmp_path, "agents: {}\n"):
        assert not stale.exists()
        assert orphan.wait(timeout=5) == -signal.SIGKILL
        assert kinds(sup, "fleet.cleanup")


async def test_state_machine_rejects_illegal_transitions(tmp_path: Path) -> None:
    from fleettop.supervisor.core.agent import AgentRuntime, IllegalTransition

    rt = AgentRuntime(fleet_of(tmp_path, "agents:\n  a: {cmd: x}\n").agents["a"])
    with pytest.raises(IllegalTransition):
        rt.transition(AgentState.FROZEN, "cannot freeze what never ran")
    rt.transition(AgentState.STARTING, "go")
    rt.transition(AgentState.RUNNING, "up")
    assert rt.state is AgentState.RUNNING and rt.reason == "up"


async def test_unstartable_command_fails_with_reason(tmp_path: Path) -> None:
    text = "agents:\n  ghost: {cmd: [/nonexistent/agent]}\n"
    async for sup in running(tmp_path, text):
        rt = sup.agents["ghost"]
        assert rt.state is AgentState.FAILED
        assert "cannot start" in rt.reason and "nonexistent" in rt.reason


async def test_dependents_wait_for_readiness(tmp_path: Path) -> None:
    text = {"agents": {
        "server": {"cmd": ["sh", "-c", "sleep 0.6; echo server listening; sleep 100"],
                   "ready": {"log": "listening"}},
        "client": {"cmd": ["sleep", "100"], "depends_on": ["server"]},
    }}
    async for sup in running(tmp_path, text):
        ready = kinds(sup, "agent.ready", "server")
        started = [e for e in kinds(sup, "agent.state", "client") if e.data["to"] == "running"]
        assert ready and started and started[0].ts >= ready[0].ts
        assert ready[0].data["probe"] == {"log": "listening"}


async def test_readiness_timeout_starts_dependents_anyway(tmp_path: Path) -> None:
    text = {"agents": {
        "mute": {"cmd": ["sleep", "100"], "ready": {"tcp": "127.0.0.1:1", "timeout": "0.3s"}},
        "after": {"cmd": ["sleep", "100"], "depends_on": ["mute"]},
    }}
    async for sup in running(tmp_path, text):
        assert sup.agents["after"].state is AgentState.RUNNING
        assert any("not ready after 0.3s" in e.reason for e in kinds(sup, "agent.warning",
                                                                      "mute"))


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs fleettop to run as root")
async def test_agent_runs_as_the_configured_user_never_root_by_accident(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pwd

    nobody = pwd.getpwnam("nobody")
    monkeypatch.delenv("SUDO_USER", raising=False)
    text = {"agents": {
        "as-nobody": {"cmd": ["id", "-u"], "user": "nobody", "restart": "no", "cwd": "/"},
        "as-invoker": {"cmd": ["id", "-u"], "restart": "no", "cwd": "/"},
    }}
    monkeypatch.setenv("SUDO_USER", "nobody")  # as under `sudo fleettop ...` by nobody
    async for sup in running(tmp_path, text):
        for name in ("as-nobody", "as-invoker"):
            rt = sup.agents[name]
            await wait_for(lambda rt=rt: rt.state is AgentState.EXITED, what=f"{name} exits")
            assert str(nobody.pw_uid) in rt.log.lines(10), (name, rt.log.lines(10))


@needs_cgroups
async def test_memory_limit_is_enforced(tmp_path: Path) -> None:
    text = {"agents": {"hog": {
        "cmd": [PY, "-c", "x = bytearray(256 * 2**20); import time; time.sleep(30)"],
        "limits": {"memory": "64MiB"}, "restart": "no"}}}
    async for sup in running(tmp_path, text):
        rt = sup.agents["hog"]
        if any("not enforced" in e.reason for e in kinds(sup, "agent.warning", "hog")):
            pytest.skip("no memory controller here, in cgroup v2 or v1")
        await wait_for(lambda: rt.state is AgentState.EXITED, 20, "the OOM kill")
        assert rt.exit_code == -signal.SIGKILL


HANGS = """
import http.server, socket, sys, threading, time
port, hang_after = int(sys.argv[1]), float(sys.argv[2])
server = http.server.HTTPServer(("127.0.0.1", port), http.server.SimpleHTTPRequestHandler)
threading.Thread(target=server.serve_forever, daemon=True).start()
print("listening", flush=True)
if hang_after > 0:
    time.sleep(hang_after)
    server.shutdown()  # the process lives on, answering nothing: a hung agent
    server.socket.close()
time.sleep(1000)
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_health_checks_restart_a_hung_agent(tmp_path: Path) -> None:
    port = _free_port()
    async for sup in running(tmp_path, {"agents": {"api": {
            "cmd": [sys.executable, "-c", HANGS, str(port), "0.6"],
            "ready": {"log": "listening"},
            "health": {"http": f"http://127.0.0.1:{port}/", "interval": "0.2s",
                       "timeout": "0.5s", "failures": 2}}}}):
        rt = sup.agents["api"]
        first = rt.pid
        await wait_for(lambda: kinds(sup, "agent.unhealthy", "api"), 15, "unhealthy")
        await wait_for(lambda: rt.pid not in (None, first) and rt.state is AgentState.RUNNING,
                       15, "restarted")
        ev = kinds(sup, "agent.unhealthy", "api")[0]
        assert ev.data["failures"] == 2 and ev.data["check"].endswith(f":{port}/")
        warnings = [e for e in kinds(sup, "agent.warning", "api") if "health" in e.reason]
        assert warnings and "(1/2)" in warnings[-1].reason
        assert not alive(first) and rt.restarts == 1
        assert "health checks failed" in rt.reason


async def test_a_frozen_agent_is_not_health_checked(tmp_path: Path) -> None:
    port = _free_port()
    async for sup in running(tmp_path, {"agents": {"api": {
            "cmd": [sys.executable, "-c", HANGS, str(port), "0"],
            "ready": {"log": "listening"},
            # Two failures in a row: one slow answer on a loaded machine is not a hang.
            "health": {"http": f"http://127.0.0.1:{port}/", "interval": "0.1s",
                       "timeout": "1s", "failures": 2}}}}):
        rt = sup.agents["api"]
        await wait_for(lambda: rt.ready.is_set(), 10, "ready")
        await asyncio.sleep(0.5)  # healthy: answers every check
        pid = rt.pid
        await sup.freeze_agent("api", reason="test")
        await asyncio.sleep(3.0)  # a frozen server cannot answer; it must not be restarted
        assert rt.pid == pid and rt.state is AgentState.FROZEN
        assert not kinds(sup, "agent.unhealthy", "api"), [
            (round(e.ts % 100, 3), e.kind, e.reason) for e in sup.events]
        await sup.resume_agent("api")
        await asyncio.sleep(0.5)
        assert rt.pid == pid and not kinds(sup, "agent.unhealthy", "api"), [
            (round(e.ts % 100, 3), e.kind, e.reason) for e in sup.events]


async def test_reload_leaves_a_frozen_agent_frozen_until_its_next_start(tmp_path: Path) -> None:
    async for sup in running(tmp_path, {"agents": {"held": {"cmd": ["sleep", "1000"]}}}):
        rt = sup.agents["held"]
        await wait_for(lambda: rt.state is AgentState.RUNNING, 10, "running")
        pid = rt.pid
        await sup.freeze_agent("held", reason="inspect")
        reply = await sup.reload(fleet_of(tmp_path, {"agents": {"held": {
            "cmd": ["sleep", "2000"]}, "cron": {"cmd": ["true"], "schedule": "0 3 * * *"}}}))
        assert reply["changed"] == ["held"] and reply["frozen_apply_later"] == ["held"]
        assert reply["added"] == ["cron"] and sup.agents["cron"].state is AgentState.SCHEDULED
        assert rt.pid == pid and rt.state is AgentState.FROZEN
        assert rt.spec.cmd == ["sleep", "2000"]  # what its next start runs
        assert kinds(sup, "fleet.reloaded")[-1].data["frozen_apply_later"] == ["held"]


CHATTY = ("import itertools, sys, time\n"
          "for i in itertools.count():\n"
          "    print(f'line {i} ' + 'x' * 200, flush=True)\n"
          "    time.sleep(0.002)\n")


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs as the state dir needs root")
async def test_a_full_disk_is_one_event_and_logging_comes_back(tmp_path: Path,
                                                                monkeypatch) -> None:
    """A state dir with no space left gave 11,920 tracebacks in 40 s. Now: one event, the
    agent untouched, its last lines kept in memory, the row says so, and when space returns
    the file is written again (with a note of what it missed)."""
    from fleettop.supervisor.core import logs

    monkeypatch.setattr(logs, "RETRY_S", 0.3)
    state = tmp_path / "state"
    state.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(state)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        text = {"state_dir": str(state), "agents": {"chatty": {
            "cmd": [sys.executable, "-c", CHATTY], "restart": "no"}}}
        async for sup in running(tmp_path, text):
            rt = sup.agents["chatty"]
            await wait_for(lambda: kinds(sup, "log.failing", "chatty"), 30, "the disk filled")
            seen = rt.log.lines(1)[-1]
            await wait_for(lambda: rt.log.lines(1)[-1] != seen, 10, "the tail goes on")
            assert rt.state is AgentState.RUNNING
            assert "No space left" in (sup.snapshot()["agents"][0]["log_error"] or "")
            await asyncio.sleep(1.0)  # many more writes fail meanwhile: still one event
            assert len(kinds(sup, "log.failing", "chatty")) == 1
            for f in state.rglob("chatty.log*"):
                os.truncate(f, 0)  # space comes back
            await wait_for(lambda: kinds(sup, "log.recovered", "chatty"), 10, "recovery")
            assert sup.snapshot()["agents"][0]["log_error"] is None
            written = (sup.log_dir / "chatty.log").read_text(errors="replace")
            assert "log file writable again" in written
    finally:
        subprocess.run(["umount", "-l", str(state)], check=False)
