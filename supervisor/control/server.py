"""The control socket: JSON lines over a Unix socket, mode 0600, in a 0700 runtime dir.

One request per line, one reply per line; `{"cmd": "events", "follow": true}` turns the
connection into an event stream until the client hangs up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleettop.supervisor.core.supervisor import Supervisor

MAX_LINE = 1 << 20


class ControlServer:
    def __init__(self, sup: Supervisor, path: Path, readonly: bool = False) -> None:
        self.sup = sup
        self.path = path
        self.readonly = readonly
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # only reached while holding the fleet's pid lock
        old = os.umask(0o177)  # the socket is born 0600: no window where others can connect
        try:
            self._server = await asyncio.start_unix_server(self._client, path=str(self.path),
                                                           limit=MAX_LINE)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        from fleettop.supervisor.control.dispatch import MUTATING

        try:
            while True:
                try:
                    line = await reader.readline()
                except (ValueError, asyncio.LimitOverrunError):
                    await _send(writer, {"ok": False, "error": "request line too long"})
                    return
                if not line:
                    return
                try:
                    req = json.loads(line)
                    if not isinstance(req, dict):
                        raise ValueError("a request is a JSON object")
                except ValueError as exc:
                    await _send(writer, {"ok": False, "error": f"bad request: {exc}"})
                    continue
                if req.get("cmd") == "events" and req.get("follow"):
                    await self._follow(writer, int(req.get("n", 20)))
                    return
                if self.readonly and req.get("cmd") in MUTATING:
                    await _send(writer, {"ok": False, "error": "read-only supervisor"})
                    continue
                await _send(writer, await self.sup.command(req))
        except (ConnectionError, BrokenPipeError):
            return
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _follow(self, writer: asyncio.StreamWriter, backlog: int) -> None:
        q = self.sup.subscribe()
        try:
            for event in list(self.sup.events)[-backlog:] if backlog > 0 else []:
                await _send(writer, event.to_json())
            while True:
                event = await q.get()
                await _send(writer, event.to_json())
        finally:
            self.sup.unsubscribe(q)


async def _send(writer: asyncio.StreamWriter, obj: dict[str, Any]) -> None:
    writer.write(json.dumps(obj, default=str).encode() + b"\n")
    await writer.drain()


class ControlError(Exception):
    pass


def request(path: Path, req: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    """Send one request to a running supervisor and return its reply (blocking)."""
    with _connect(path, timeout) as sock:
        sock.sendall(json.dumps(req).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                raise ControlError("the supervisor closed the connection")
            buf += chunk
    return json.loads(buf)


def follow(path: Path, backlog: int = 20) -> Iterator[dict[str, Any]]:
    with _connect(path, None) as sock:
        sock.sendall(json.dumps({"cmd": "events", "follow": True, "n": backlog}).encode() + b"\n")
        for line in sock.makefile("rb"):
            yield json.loads(line)


def _connect(path: Path, timeout: float | None) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        raise ControlError(f"no fleettop is running for this fleet (no socket at {path})"
                           ) from None
    return sock
