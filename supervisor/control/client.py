"""The two FleetClients: in the supervisor's own process, and over its control socket."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleettop.supervisor.base import jsonlines
from fleettop.supervisor.control.api import FleetClient, refusal
from fleettop.supervisor.control.dispatch import dispatch

if TYPE_CHECKING:
    from fleettop.supervisor.core.supervisor import Supervisor


__all__ = ["FleetClient", "InProcessClient", "SocketClient"]


class InProcessClient:
    """Same process, same loop: no serialisation, the UI reads the supervisor directly."""

    def __init__(self, supervisor: Supervisor, readonly: bool = False) -> None:
        self.sup = supervisor
        self.readonly = readonly
        self.viewer = False

    async def snapshot(self) -> dict[str, Any]:
        return self.sup.snapshot()

    async def command(self, req: dict[str, Any]) -> dict[str, Any]:
        return refusal(req, self.readonly) or await dispatch(self.sup, req)

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        q = self.sup.subscribe()
        try:
            while True:
                yield (await q.get()).to_json()
        finally:
            self.sup.unsubscribe(q)


class SocketClient:
    """A viewer attached to a running supervisor over its control socket."""

    def __init__(self, socket_path: Path, readonly: bool = False,
                 allow_shutdown: bool = True) -> None:
        self.path = socket_path
        self.readonly = readonly
        self.allow_shutdown = allow_shutdown
        self.viewer = not allow_shutdown
        self._lock = asyncio.Lock()
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def _request(self, req: dict[str, Any]) -> dict[str, Any]:
        async with self._lock:
            for attempt in (0, 1):
                try:
                    if self._conn is None:
                        self._conn = await asyncio.open_unix_connection(str(self.path),
                                                                        limit=1 << 24)
                    reader, writer = self._conn
                    writer.write(jsonlines.encode(req))
                    await writer.drain()
                    line = await reader.readline()
                    if not line:
                        raise ConnectionError("supervisor closed the connection")
                    return json.loads(line)
                except (ConnectionError, FileNotFoundError, OSError) as exc:
                    self._conn = None
                    if attempt:
                        return {"ok": False, "error": f"supervisor unreachable: {exc}"}
        return {"ok": False, "error": "supervisor unreachable"}

    async def snapshot(self) -> dict[str, Any]:
        reply = await self._request({"cmd": "status"})
        reply.pop("ok", None)
        return reply

    async def command(self, req: dict[str, Any]) -> dict[str, Any]:
        refused = refusal(req, self.readonly)
        if refused is not None:
            return refused
        if req.get("cmd") == "shutdown" and not self.allow_shutdown:
            return {"ok": True, "ignored": "a viewer leaves the fleet running"}
        return await self._request(req)

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        reader, writer = await asyncio.open_unix_connection(str(self.path), limit=1 << 24)
        writer.write(jsonlines.encode({"cmd": "events", "follow": True, "n": 0}))
        await writer.drain()
        try:
            while line := await reader.readline():
                yield json.loads(line)
        finally:
            writer.close()
