"""The one interface every front end uses to reach a supervisor, declared once.

The TUI, the web view and `fleettop ctl` all speak to a fleet through a `FleetClient`: a
snapshot (plain dicts), a command (a request dict, a reply dict) and a stream of events.
`MUTATING` is the one list of commands that change the fleet; every read-only check asks it.
This module imports nothing of fleettop, so a front end can depend on it and on nothing else.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

MUTATING: frozenset[str] = frozenset(
    {"freeze", "resume", "restart", "stop", "start", "shutdown", "reload"})
"""Commands that change the fleet; refused by a read-only client, server or viewer."""


class FleetClient(Protocol):
    """What a front end needs from a supervisor, wherever it runs."""

    readonly: bool
    """Every command in MUTATING is refused."""
    viewer: bool
    """A second window on a fleet that runs elsewhere: quitting it leaves the fleet running."""

    async def snapshot(self) -> dict[str, Any]: ...

    async def command(self, req: dict[str, Any]) -> dict[str, Any]: ...

    def events(self) -> AsyncIterator[dict[str, Any]]: ...


def mutates(req: dict[str, Any]) -> bool:
    """Whether this request would change the fleet."""
    return req.get("cmd") in MUTATING


def refusal(req: dict[str, Any], readonly: bool, who: str = "read-only mode"
            ) -> dict[str, Any] | None:
    """The reply for a request that read-only mode refuses, or None when it may go on."""
    if readonly and mutates(req):
        return {"ok": False, "error": who}
    return None
