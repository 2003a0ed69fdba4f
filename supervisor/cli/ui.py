"""`fleettop FILE`: the terminal UI on top of a supervisor in this process, or as a viewer.

The only module of the core that imports the UI, and only when a UI is asked for.
"""

from __future__ import annotations

import argparse
import asyncio

from fleettop.supervisor.base import paths
from fleettop.supervisor.config.fleet import Fleet
from fleettop.supervisor.core.supervisor import Supervisor


def _refresh(fleet: Fleet, args: argparse.Namespace) -> float:
    from fleettop.supervisor.config import units

    given = getattr(args, "refresh", None)
    return units.parse_duration(given) if given else float(fleet.ui.refresh)


def run_with_ui(fleet: Fleet, args: argparse.Namespace) -> int:
    from fleettop.supervisor.cli.run import run_fleet
    from fleettop.supervisor.control.client import InProcessClient
    from fleettop.tui.app import run_app_async

    readonly = bool(args.readonly or fleet.ui.readonly)

    async def frontend(sup: Supervisor) -> str | None:
        # Quitting the UI stops the fleet; the quit dialog's choice for frozen agents
        # arrives first as a `shutdown` command and sets sup.shutdown_mode.
        await run_app_async(InProcessClient(sup, readonly=readonly), readonly=readonly,
                            refresh_s=_refresh(fleet, args), keymap=dict(fleet.ui.keys))
        return None

    from fleettop.supervisor.cli.assemble import setup_for

    return asyncio.run(run_fleet(fleet, frontend, setup=setup_for(args), hangup_exits=True))


def attach_viewer(fleet: Fleet, args: argparse.Namespace) -> int:
    """A second `fleettop FILE` on a running fleet: a viewer over the control socket."""
    import os
    import signal

    from fleettop.supervisor.control.client import SocketClient
    from fleettop.tui.app import run_app

    # A viewer owns no agents: when its terminal hangs up it just goes (Textual would block).
    signal.signal(signal.SIGHUP, lambda signum, frame: os._exit(128 + signum))
    readonly = bool(args.readonly or fleet.ui.readonly)
    # A viewer may freeze and resume, but quitting it never shuts the fleet down.
    client = SocketClient(paths.socket_path(fleet.path), readonly=readonly,
                          allow_shutdown=False)
    return int(run_app(client, readonly=readonly, refresh_s=_refresh(fleet, args),
                       keymap=dict(fleet.ui.keys)) or 0)
