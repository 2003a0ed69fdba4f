"""End to end in a real terminal: the app on the fake fleet inside tmux (private socket).

Keys go in with send-keys, the screen comes back with capture-pane; the fake client's
commands are written to a file when the app exits.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
from tests.support.fake_fleet import FakeFleet
from fleettop.tui.app import run_app

fleet = FakeFleet()
code = run_app(fleet, refresh_s=0.5)
with open(sys.argv[1], "w") as f:
    json.dump({"code": code, "commands": fleet.commands}, f)
"""

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux not installed")


class Tmux:
    def __init__(self, tmp: Path, size: tuple[int, int]) -> None:
        self.socket = f"fleettop-test-{uuid.uuid4().hex[:8]}"
        self.out = tmp / "result.json"
        script = tmp / "app.py"
        script.write_text(SCRIPT)
        env = f"PYTHONPATH={ROOT} TZ=UTC"
        cmd = f"cd {ROOT} && env {env} {sys.executable} {script} {self.out}"
        self.tmux("-f", "/dev/null", "new-session", "-d", "-x", str(size[0]), "-y",
                  str(size[1]), cmd)
        self.tmux("set", "-s", "escape-time", "10")

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], check=True,
                              capture_output=True, text=True, timeout=10).stdout

    def capture(self) -> str:
        return self.tmux("capture-pane", "-p")

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", *keys)

    def wait_for(self, text: str, within: float = 15.0) -> str:
        end = time.monotonic() + within
        screen = ""
        while time.monotonic() < end:
            screen = self.capture()
            if text in screen:
                return screen
            time.sleep(0.1)
        raise AssertionError(f"{text!r} not on screen:\n{screen}")

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True,
                       timeout=10, check=False)


@pytest.fixture(params=[(80, 24), (120, 40)], ids=["80x24", "120x40"])
def tmux(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tmux]:
    t = Tmux(tmp_path, request.param)
    try:
        yield t
    finally:
        t.close()


def test_table_inspector_freeze_and_quit_in_tmux(tmux: Tmux) -> None:
    screen = tmux.wait_for("summarizer")
    assert "TRIPPED" in screen and "FROZEN" in screen and "wait-gpu" in screen

    time.sleep(1.0)  # keys typed within the app's first instant can be lost in the handshake
    tmux.keys("/")
    tmux.wait_for("esc clears")
    tmux.keys("-l", "vision")
    tmux.keys("Enter")
    tmux.wait_for("filter 'vision'")
    tmux.keys("f")
    screen = tmux.wait_for("FROZEN")
    assert "vision" in screen and "summarizer" not in screen

    tmux.keys("Enter")
    screen = tmux.wait_for("last tokens")
    assert "nightly jobs" in screen  # the agent's last generated text
    tmux.keys("Escape")
    tmux.wait_for("filter 'vision'")

    tmux.keys("q")
    tmux.wait_for("What happens to the frozen agents")
    tmux.keys("s")
    end = time.monotonic() + 15
    while not tmux.out.exists() and time.monotonic() < end:
        time.sleep(0.1)
    result = json.loads(tmux.out.read_text())
    assert result["code"] == 0
    assert {"cmd": "freeze", "name": "vision"} in result["commands"]
    assert result["commands"][-1] == {"cmd": "shutdown", "frozen": "stop"}
