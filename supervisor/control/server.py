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

from fleettop.supervisor.base import jsonlines
from fleettop.supervisor.control.api import refusal
from fleettop.supervisor.control.dispatch import dispatch

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
        try:
            while True:
                try:
                    line = await reader.readline()
                except (ValueError, asyncio.LimitOverrunError):
                    await _send(writer, {"ok": False, "error": "request line too long"})
                    return
                if not line:
                    return
                req = jsonlines.decode(line)
                if req is None:
                    await _send(writer, {"ok": False,
                                         "error": "bad request: not a JSON object"})
                    continue
                if req.get("cmd") == "events" and req.get("follow"):
                    await self._follow(writer, int(req.get("n", 20)))
                    return
                await _send(writer, refusal(req, self.readonly, "read-only supervisor")
                            or await dispatch(self.sup, req))
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
    writer.write(jsonlines.encode(obj))
    await writer.drain()


class ControlError(Exception):
    pass


def request(path: Path, req: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    """Send one request to a running supervisor and return its reply (blocking)."""
    with _connect(path, timeout) as sock:
        sock.sendall(jsonlines.encode(req))
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                raise ControlError("the supervisor closed the connection")
            buf += chunk
    return json.loads(buf)


def follow(path: Path, backlog: int = 20) -> Iterator[dict[str, Any]]:
    with _connect(path, None) as sock:
        sock.sendall(jsonlines.encode({"cmd": "events", "follow": True, "n": backlog}))
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
