"""Which capabilities a running fleet gets, and how the UI is put on top of the supervisor."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fleettop.supervisor import paths, units
from fleettop.supervisor.config import Fleet
from fleettop.supervisor.fleet import Supervisor

Setup = Callable[[Supervisor], Awaitable[None]]


def setup_for(args: argparse.Namespace) -> Setup:
    async def setup(sup: Supervisor) -> None:
        return None

    return setup


def _refresh(args: argparse.Namespace) -> float:
    return units.parse_duration(getattr(args, "refresh", "1s") or "1s")


def run_with_ui(fleet: Fleet, args: argparse.Namespace) -> int:
    from fleettop.supervisor.client import InProcessClient
    from fleettop.supervisor.runner import run_fleet
    from fleettop.tui.app import FleettopApp

    async def frontend(sup: Supervisor) -> str | None:
        app = FleettopApp(InProcessClient(sup, readonly=args.readonly),
                          readonly=args.readonly, refresh_s=_refresh(args),
                          keymap=dict(fleet.ui.get("keys", {}) or {}))
        result: Any = await app.run_async()
        return result if isinstance(result, str) else "stop"

    return asyncio.run(run_fleet(fleet, frontend, setup=setup_for(args)))


def attach_viewer(fleet: Fleet, args: argparse.Namespace) -> int:
    from fleettop.supervisor.client import SocketClient
    from fleettop.tui.app import run_app

    client = SocketClient(paths.socket_path(fleet.path), readonly=args.readonly)
    run_app(client, readonly=args.readonly, refresh_s=_refresh(args))
    return 0
