"""The proxy as a child process: start it, restart it when it dies, talk JSON lines to it.

    python -m fleettop.probes.proxy.main --state-dir DIR --config CFG --tokens TOK ...

Its reports (stdout) go to `on_report`; commands go to its stdin (`send`). Closing stdin
stops it cleanly. It is restarted on the same port, so agents' environments stay valid.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fleettop.supervisor.base import jsonlines

Report = Callable[[dict[str, Any]], Awaitable[None]]
Notice = Callable[[str, str, dict[str, Any]], None]
"""(kind, reason, data): proxy.exited, proxy.failed, proxy.error."""


class ProxyProcess:
    def __init__(self, state_dir: Path, config_file: Path, tokens_file: Path, *,
                 host: str, port: int, on_report: Report, on_notice: Notice,
                 on_ready: Callable[[dict[str, Any]], None],
                 restart_backoff: float = 1.0, python: str = sys.executable) -> None:
        self.state_dir = Path(state_dir)
        self.config_file = config_file
        self.tokens_file = tokens_file
        self.host = host
        self.port: int | None = port or None
        self.restarts = 0
        self.restart_backoff = restart_backoff
        self.python = python
        self._on_report, self._on_notice, self._on_ready = on_report, on_notice, on_ready
        self._proc: asyncio.subprocess.Process | None = None
        self._ready: asyncio.Future[dict[str, Any]] | None = None
        self._stopping = False
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def start(self, ready_s: float = 30.0) -> dict[str, Any]:
        ready = await self._spawn(ready_s)
        self._spawn_task(self._supervise())
        return ready

    async def _spawn(self, ready_s: float) -> dict[str, Any]:
        self._ready = asyncio.get_running_loop().create_future()
        args = [self.python, "-m", "fleettop.probes.proxy.main", "--state-dir",
                str(self.state_dir), "--config", str(self.config_file), "--tokens",
                str(self.tokens_file), "--host", self.host, "--port", str(self.port or 0)]
        self._proc = await asyncio.create_subprocess_exec(
            *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, limit=16 * 1024 * 1024)
        self._spawn_task(self._read(self._proc))
        ready = await asyncio.wait_for(self._ready, ready_s)
        self.port = int(ready["port"])
        self._on_ready(ready)
        return ready

    async def _supervise(self) -> None:
        while not self._stopping:
            proc = self._proc
            if proc is None:
                return
            code = await proc.wait()
            if self._stopping:
                return
            self._on_notice("proxy.exited", f"proxy exited with {code}; restarting",
                            {"exit_code": code})
            await asyncio.sleep(self.restart_backoff * min(2 ** self.restarts, 30))
            self.restarts += 1
            try:
                await self._spawn(30.0)  # same port: agents' env stays valid
            except (TimeoutError, OSError) as exc:
                self._on_notice("proxy.failed", f"proxy restart failed: {exc}", {})

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            report = jsonlines.decode(line)
            if report is None:
                continue
            if report.get("event") == "proxy.ready":
                if self._ready is not None and not self._ready.done():
                    self._ready.set_result(report)
                continue
            try:
                await self._on_report(report)
            except Exception as exc:  # a report must never end the reading
                self._on_notice("proxy.error", f"cannot handle proxy report: {exc}", {})

    def send(self, cmd: dict[str, Any]) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None or proc.returncode is not None:
            return
        with contextlib.suppress(ConnectionError, RuntimeError):
            proc.stdin.write(jsonlines.encode(cmd))

    async def stop(self) -> None:
        self._stopping = True
        proc = self._proc
        if proc is not None and proc.returncode is None:
            if proc.stdin is not None:
                proc.stdin.close()  # EOF: the proxy shuts down cleanly
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        for task in list(self._tasks):
            task.cancel()

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
