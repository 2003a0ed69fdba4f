"""Which capabilities a running fleet gets, and how the UI is put on top of the supervisor.

Each capability hooks itself into the supervisor (env, start, exit, status and snapshot
hooks) and registers how it stops; the core knows none of them by name.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable

from fleettop.supervisor.base import paths
from fleettop.supervisor.config.fleet import Fleet
from fleettop.supervisor.core.supervisor import Supervisor

Setup = Callable[[Supervisor], Awaitable[None]]
log = logging.getLogger(__name__)


def setup_for(args: argparse.Namespace) -> Setup:
    telemetry = not getattr(args, "no_telemetry", False)

    async def setup(sup: Supervisor) -> None:
        stop = asyncio.Event()
        sup.stop_hooks.append(stop.set)
        if sup.fleet.proxy.enabled and any(s.proxy for s in sup.fleet.agents.values()):
            await _proxy(sup)
        _gpu(sup, stop)
        if telemetry:
            await _telemetry(sup)
        await _serve(sup, args)

    return setup


async def _proxy(sup: Supervisor) -> None:
    """The token proxy, up before any agent starts so every agent gets its credentials."""
    from fleettop.supervisor.capabilities.gpu_start import proxy_gpu_config
    from fleettop.supervisor.capabilities.proxy import ProxyLink

    fleet = sup.fleet
    link = ProxyLink(sup, fleet.proxy, fleet.breaker, sup.state_dir / "proxy",
                     agent_breakers={n: s.breaker for n, s in fleet.agents.items()},
                     gpu=proxy_gpu_config(fleet, sup.state_dir))
    link.register()
    sup.reload_hooks.append(lambda new: link.reload(
        {n: s.breaker for n, s in new.agents.items()}, proxy_gpu_config(new, sup.state_dir)))
    await link.start()
    sup.stop_hooks.append(link.stop)
    sup.components["proxy"] = lambda: {
        **link.component(), "detail": f"{link.proxy.host}:{link.port} ({link.relay})"}


async def _telemetry(sup: Supervisor) -> None:
    from fleettop.supervisor.capabilities.telemetry import TelemetryLink

    link = TelemetryLink(sup, sup.fleet.probes, sup.fleet.leak)
    await link.start()
    sup.stop_hooks.append(link.stop)
    sup.snapshot_hooks.append(lambda: _gpus_part(sup, link))


def _gpus_part(sup: Supervisor, link: object) -> dict[str, object]:
    """The probes' GPU sample in the snapshot's shape, with each process's agent named."""
    gpu = getattr(link, "gpu", None)
    snap = getattr(link, "gpu_snapshot", None)
    if gpu is None or snap is None or not snap.gpus:
        why = getattr(gpu, "why", "") or "no GPU data yet"
        return {"gpus": [], "gpu_reason": why}
    owner = {pid: name for name, rt in sup.agents.items() if rt.pid for pid in rt.pids()}

    def procs(index: int) -> list[dict[str, object]]:
        on = snap.per_gpu.get(index)
        if on is None and index == snap.gpus[0].index and not snap.per_gpu:
            on = snap.process_vram  # a source that can't tell the cards apart
        return [{"pid": pid, "agent": owner.get(pid), "used_bytes": used}
                for pid, used in (on or {}).items()]

    return {"gpus": [{"index": g.index, "name": g.name, "used_bytes": g.mem_used,
                      "total_bytes": g.mem_total, "util_percent": g.util_percent,
                      "processes": procs(g.index)}
                     for g in snap.gpus]}


async def _serve(sup: Supervisor, args: argparse.Namespace) -> None:
    if not sup.fleet.serve.enabled and getattr(args, "serve", None) is None:
        return  # aiohttp and prometheus-client stay unloaded
    from fleettop.supervisor.control.client import InProcessClient
    from fleettop.supervisor.web.server import banner, start_serving

    readonly = bool(getattr(args, "readonly", False))
    server = await start_serving(InProcessClient(sup, readonly=readonly), sup.fleet.serve,
                                 getattr(args, "serve", None), readonly=readonly)
    if server is None:
        return
    sup.stop_hooks.append(server.stop)
    sup.components["serve"] = {"state": "running", "detail": server.url}
    sup.serve_token = None if server.readonly else server.token
    print(banner(server), file=sys.stderr, flush=True)


def _nvml_present() -> bool:
    import ctypes.util

    return ctypes.util.find_library("nvidia-ml") is not None


def _gpu(sup: Supervisor, stop: asyncio.Event) -> None:
    from fleettop.supervisor.capabilities.gpu_start import GpuLink
    from fleettop.supervisor.gpu.governor import Governor, Sampler

    section = sup.fleet.gpu
    GpuLink.install(sup, section)
    gpu = None
    if _nvml_present():  # the watchdog (and aiohttp) only load on a machine with a driver
        from fleettop.supervisor.gpu.evictor import NvmlMemory

        gpu = NvmlMemory.open()
    evictor = None
    if gpu is not None and section.evict and section.backends:
        from fleettop.supervisor.gpu.evictor import Evictor, read_activity

        activity = sup.state_dir / "gpu-activity.json"
        evictor = Evictor.from_config(gpu, section, emit=sup.emit,
                                      activity=lambda: read_activity(activity))
        sup._spawn_task(evictor.run(stop))
    if sup.fleet.governor.enabled:
        sampler = Sampler("/", gpu=gpu,
                          cgroups=lambda: {n: rt.cgroup for n, rt in sup.agents.items()})
        governor = Governor(sampler, sup.fleet.governor, supervisor=sup, evictor=evictor,
                            state_path=sup.state_dir / "governor.json")
        sup._spawn_task(governor.run(stop))


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
