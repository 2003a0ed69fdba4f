"""End to end: `fleettop fleet.yaml` on the demo fleet inside tmux, driven by keys.

Freezes an agent by keyboard and checks the kernel agrees (cgroup.events or /proc), opens the
inspector and finds the agent's last output on screen, resumes it and checks it runs again.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from fleettop.supervisor.base import paths
from fleettop.supervisor.core import proctree

ROOT = Path(__file__).resolve().parents[2]
FLEETTOP = str(Path(sys.executable).parent / "fleettop")

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None,
                                reason="tmux is not installed (apt-get install tmux)")


class Tmux:
    def __init__(self, width: int, height: int, command: str, env: dict[str, str]) -> None:
        self.sock = f"ft-e2e-{uuid.uuid4().hex[:8]}"
        self.env = env
        subprocess.run(["tmux", "-L", self.sock, "new-session", "-d", "-s", "e2e", "-x",
                        str(width), "-y", str(height), command], check=True, env=env)

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "-L", self.sock, "send-keys", "-t", "e2e", *keys], check=True)

    def screen(self) -> str:
        return subprocess.run(["tmux", "-L", self.sock, "capture-pane", "-p", "-t", "e2e"],
                              capture_output=True, text=True).stdout

    def alive(self) -> bool:
        return subprocess.run(["tmux", "-L", self.sock, "has-session", "-t", "e2e"],
                              capture_output=True).returncode == 0

    def press_until(self, key: str, done: Callable[[], bool], what: str,
                    timeout: float = 30.0) -> None:
        """Press `key` (an idempotent one) until `done()`: a key sent while the app is still
        starting is lost, and how long starting takes depends on the machine's load."""
        deadline = time.monotonic() + timeout
        while True:
            self.keys(key)
            pressed = time.monotonic()
            while time.monotonic() - pressed < 2.0:
                if done():
                    return
                time.sleep(0.2)
            assert time.monotonic() < deadline, f"{what}:\n{self.screen()}"

    def quit(self, done: Callable[[], bool], timeout: float = 30.0) -> None:
        """`q`, then `s` in the quit dialog if one comes (it asks about frozen agents)."""
        self.keys("q")
        deadline = time.monotonic() + timeout
        while not done():
            if "frozen:" in self.screen():
                self.keys("s")
            assert time.monotonic() < deadline, f"did not quit:\n{self.screen()}"
            time.sleep(0.3)

    def wait_for(self, text: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if text in screen:
                return screen
            time.sleep(0.2)
        raise AssertionError(f"{text!r} never appeared on screen:\n{self.screen()}")

    def kill(self) -> None:
        subprocess.run(["tmux", "-L", self.sock, "kill-server"], capture_output=True)


def ctl_status(fleet: Path, env: dict[str, str]) -> dict:
    out = subprocess.run([FLEETTOP, "ctl", "-f", str(fleet), "status", "--json"],
                         capture_output=True, text=True, env=env, timeout=30)
    return json.loads(out.stdout)


def agent(fleet: Path, env: dict[str, str], name: str) -> dict:
    return next(a for a in ctl_status(fleet, env)["agents"] if a["name"] == name)


def test_demo_fleet_in_tmux_freeze_inspect_resume(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    # The demo fleet itself, on a free port so a running demo elsewhere doesn't collide.
    port = 20000 + os.getpid() % 20000
    fleet.write_text((ROOT / "fleet.yaml").read_text().replace("11435", str(port)))
    env = dict(os.environ, TERM="screen-256color", FLEETTOP_DEMO_LLM=f"http://127.0.0.1:{port}")
    tmux = Tmux(100, 32, f"{FLEETTOP} {fleet}", env)
    try:
        tmux.wait_for("looper", 60)
        deadline = time.monotonic() + 60
        while True:  # the chat agent has printed a reply: there is something to inspect
            chat = next(a for a in ctl_status(fleet, env)["agents"] if a["name"] == "chat")
            logs = subprocess.run([FLEETTOP, "ctl", "-f", str(fleet), "logs", "chat"],
                                  capture_output=True, text=True, env=env).stdout
            said = [line for line in logs.splitlines() if line.startswith("[chat] turn")
                    and "HTTP" not in line and "failed" not in line]
            if chat["state"] == "running" and said:
                break
            assert time.monotonic() < deadline, f"chat never talked:\n{logs}"
            time.sleep(0.5)
        tmux.press_until("/", lambda: "filter:" in tmux.screen(), "the filter never opened")
        tmux.keys("chat", "Enter")
        tmux.wait_for("filter 'chat'", 10)
        tmux.press_until("f", lambda: agent(fleet, env, "chat")["state"] == "frozen",
                         "freeze by key never reached the supervisor")
        screen = tmux.wait_for("FROZEN", 10)
        snap = ctl_status(fleet, env)
        chat = next(a for a in snap["agents"] if a["name"] == "chat")
        assert chat["state"] == "frozen"
        if chat["cgroup"]:
            events = (Path(chat["cgroup"]) / "cgroup.events").read_text()
            assert "frozen 1" in events
        else:
            assert all(proctree.proc_state(p) == "T" for p in chat["pids"])

        tmux.keys("Enter")  # the inspector on the frozen agent
        last_line = said[-1].strip()[:30]
        screen = tmux.wait_for("chat", 10)
        deadline = time.monotonic() + 10
        while last_line not in screen and time.monotonic() < deadline:
            time.sleep(0.3)
            screen = tmux.screen()
        assert last_line in screen, f"last output {last_line!r} not in the inspector:\n{screen}"
        assert "frozen" in screen.lower()
        assert "no token capture" not in screen, "the proxy's last tokens are missing"
        tmux.keys("Escape")
        tmux.wait_for("filter 'chat'", 10)  # back on the table

        def turns() -> int:
            logs = subprocess.run([FLEETTOP, "ctl", "-f", str(fleet), "logs", "chat", "-n",
                                   "500"], capture_output=True, text=True, env=env).stdout
            return sum(line.startswith("[chat] turn") for line in logs.splitlines())

        before = turns()
        tmux.press_until("r", lambda: agent(fleet, env, "chat")["state"] == "running",
                         "resume by key never reached the supervisor")
        chat = agent(fleet, env, "chat")
        if chat["cgroup"]:
            assert "frozen 0" in (Path(chat["cgroup"]) / "cgroup.events").read_text()
        deadline = time.monotonic() + 60
        while turns() <= before:  # it runs again: it takes another turn
            assert time.monotonic() < deadline, "resumed agent never took another turn"
            time.sleep(0.5)

        tmux.quit(lambda: not paths.socket_path(fleet).exists())
    finally:
        tmux.kill()


def test_second_fleettop_attaches_as_a_viewer(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(json.dumps({"agents": {"solo": {"cmd": ["sleep", "1000"]}}}))
    env = dict(os.environ, TERM="screen-256color")
    headless = subprocess.Popen([FLEETTOP, "run", "--headless", str(fleet), "--no-telemetry"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    tmux = None
    try:
        deadline = time.monotonic() + 30
        while not paths.socket_path(fleet).exists():
            assert time.monotonic() < deadline, "headless fleet never came up"
            time.sleep(0.1)
        tmux = Tmux(100, 30, f"{FLEETTOP} {fleet}", env)
        tmux.wait_for("solo", 30)
        # The viewer steers the running fleet.
        tmux.press_until("f", lambda: agent(fleet, env, "solo")["state"] == "frozen",
                         "freeze from the viewer never arrived")
        tmux.quit(lambda: not tmux.alive())  # quitting a viewer never stops the fleet
        assert headless.poll() is None and agent(fleet, env, "solo")["state"] == "frozen"
    finally:
        if tmux is not None:
            tmux.kill()
        headless.terminate()
        headless.wait(timeout=30)


def test_terminal_hangup_stops_the_fleet(tmp_path: Path) -> None:
    """ssh drops or the tmux server dies: fleettop must not hang on the dead terminal."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(json.dumps({"agents": {"held": {"cmd": ["sleep", "1000"]}}}))
    env = dict(os.environ, TERM="screen-256color")
    tmux = Tmux(100, 30, f"{FLEETTOP} {fleet}", env)
    try:
        tmux.wait_for("held", 30)
        snap = ctl_status(fleet, env)
        supervisor_pid = snap["fleet"]["pid"]
        pids = snap["agents"][0]["pids"]
        assert pids
    finally:
        tmux.kill()  # SIGHUP to the pane: the terminal is gone
    deadline = time.monotonic() + 15
    while proctree.proc_state(supervisor_pid) not in (None, "Z"):
        assert time.monotonic() < deadline, "fleettop hung after its terminal went away"
        time.sleep(0.2)
    deadline = time.monotonic() + 10
    while any(proctree.proc_state(p) not in (None, "Z") for p in pids):
        assert time.monotonic() < deadline, "an agent outlived its supervisor's hangup"
        time.sleep(0.2)
