"""Running a fleet: one supervisor per fleet file, its control socket, and a front end.

The front end is either the headless event printer or the Textual UI; both run on the
supervisor's own loop, so the core never waits on the screen and vice versa.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import IO, Any

from fleettop.supervisor.base import paths
from fleettop.supervisor.config.fleet import Fleet
from fleettop.supervisor.control.server import ControlServer
from fleettop.supervisor.core.supervisor import Supervisor

Frontend = Callable[[Supervisor], Coroutine[Any, Any, str | None]]


class AlreadyRunning(Exception):
    def __init__(self, pid: str, fleet_file: str) -> None:
        super().__init__(
            f"a fleet is already running for {fleet_file} (pid {pid}); attach a viewer with "
            f"`fleettop {fleet_file}`, or control it with `fleettop ctl -f {fleet_file} status`")


class FleetLock:
    """An flock on the fleet's lock file: released by the kernel if we die."""

    def __init__(self, fleet_file: str) -> None:
        self.path = paths.pid_lock_path(fleet_file)
        self.fleet_file = fleet_file
        self.fh: IO[str] | None = None

    def acquire(self) -> None:
        fh = open(self.path, "a+")  # noqa: SIM115 - held for the life of the fleet
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            pid = fh.read().strip() or "?"
            fh.close()
            raise AlreadyRunning(pid, self.fleet_file) from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        self.fh = fh

    def release(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None


def running_pid(fleet_file: str) -> int | None:
    """The pid of the supervisor running this fleet file, if one is."""
    path = paths.pid_lock_path(fleet_file)
    try:
        with open(path) as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                text = fh.read().strip()
                return int(text) if text.isdigit() else -1
            return None
    except FileNotFoundError:
        return None


def print_events(fmt: str, out: IO[str] = sys.stdout) -> Frontend:
    async def frontend(sup: Supervisor) -> str | None:
        q = sup.subscribe(maxsize=10000)
        for event in list(sup.events):
            _write_event(event, fmt, out)
        try:
            while True:
                _write_event(await q.get(), fmt, out)
        finally:
            sup.unsubscribe(q)

    return frontend


def _write_event(event: Any, fmt: str, out: IO[str]) -> None:
    line = json.dumps(event.to_json(), default=str) if fmt == "json" else event.to_text()
    with contextlib.suppress(BrokenPipeError, ValueError):
        out.write(line + "\n")
        out.flush()


def _on_hangup(sup: Supervisor) -> Callable[[int, Any], None]:
    """SIGHUP with a terminal UI: the terminal is gone (ssh dropped, tmux server killed).

    Textual then blocks the main thread trying to restore a terminal that no longer exists,
    so the event loop — and an asyncio signal handler — never runs again. This handler runs
    between bytecodes instead: SIGTERM to every agent's tree, a short grace, then exit; the
    reaper sees us go and SIGKILLs what is left and removes the cgroups.
    """

    def handler(signum: int, frame: Any) -> None:
        for rt in sup.agents.values():
            with contextlib.suppress(Exception):
                sup._signal_tree(rt, signal.SIGTERM)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and any(rt.pids() for rt in sup.agents.values()):
            time.sleep(0.05)
        os._exit(128 + signum)

    return handler


async def run_fleet(fleet: Fleet, frontend: Frontend, *, duration: float | None = None,
                    readonly: bool = False,
                    setup: Callable[[Supervisor], Awaitable[None]] | None = None,
                    hangup_exits: bool = False) -> int:
    lock = FleetLock(fleet.path)
    lock.acquire()
    sup = Supervisor(fleet)
    control = ControlServer(sup, paths.socket_path(fleet.path), readonly=readonly)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, sup.shutdown_requested.set)
    if hangup_exits:
        signal.signal(signal.SIGHUP, _on_hangup(sup))
    front: asyncio.Task[Any] | None = None
    try:
        await control.start()
        if setup is not None:
            await setup(sup)
        front = asyncio.create_task(frontend(sup))
        await sup.start()
        waits = [asyncio.create_task(sup.shutdown_requested.wait()), front]
        done, _ = await asyncio.wait(waits, timeout=duration,
                                     return_when=asyncio.FIRST_COMPLETED)
        if front in done and front.exception() is not None:
            sup.emit("fleet.warning", None, f"the front end failed: {front.exception()!r}")
        waits[0].cancel()
    finally:
        await sup.shutdown(sup.shutdown_mode)
        await asyncio.sleep(0)  # let the printer flush the last events
        if front is not None and not front.done():
            front.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await front
        await control.stop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
        lock.release()
    if sup.failed_starts:
        names = ", ".join(f"{n} ({why})" for n, why in sorted(sup.failed_starts.items()))
        print(f"fleettop: {len(sup.failed_starts)} agent(s) could not start: {names}",
              file=sys.stderr)
        return 1
    return 0


def socket_for(fleet_file: str | Path) -> Path:
    return paths.socket_path(fleet_file)
