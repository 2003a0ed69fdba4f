"""Which capabilities a running fleet gets, from its fleet file and the command line.

Each is added to the supervisor with `sup.add(...)` (core/capability.py); the core knows
none of them by name. Heavy imports stay inside the branch that needs them: a fleet without
a proxy never loads mitmproxy, one without `serve:` never loads aiohttp.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable

from fleettop.supervisor.core.supervisor import Supervisor

Setup = Callable[[Supervisor], Awaitable[None]]


def setup_for(args: argparse.Namespace) -> Setup:
    telemetry = not getattr(args, "no_telemetry", False)

    async def setup(sup: Supervisor) -> None:
        if sup.fleet.proxy.enabled and any(s.proxy for s in sup.fleet.agents.values()):
            await _proxy(sup)
        _gpu(sup)
        if telemetry:
            await _telemetry(sup)
        await _serve(sup, args)

    return setup


async def _proxy(sup: Supervisor) -> None:
    """The token proxy, up before any agent starts so every agent gets its credentials."""
    from fleettop.supervisor.capabilities.proxy import ProxyBreaker

    breaker = ProxyBreaker.for_fleet(sup)
    sup.add(breaker)
    await breaker.start()


async def _telemetry(sup: Supervisor) -> None:
    from fleettop.supervisor.capabilities.telemetry import TelemetryWatch

    watch = TelemetryWatch(sup, sup.fleet.probes, sup.fleet.leak)
    sup.add(watch)
    await watch.start()


async def _serve(sup: Supervisor, args: argparse.Namespace) -> None:
    if not sup.fleet.serve.enabled and getattr(args, "serve", None) is None:
        return  # aiohttp and prometheus-client stay unloaded
    from fleettop.supervisor.control.client import InProcessClient
    from fleettop.supervisor.web.server import WebView, banner, start_serving

    readonly = bool(getattr(args, "readonly", False))
    server = await start_serving(InProcessClient(sup, readonly=readonly), sup.fleet.serve,
                                 getattr(args, "serve", None), readonly=readonly)
    if server is None:
        return
    sup.add(WebView(server))
    sup.serve_token = None if server.readonly else server.token
    print(banner(server), file=sys.stderr, flush=True)


def _gpu(sup: Supervisor) -> None:
    from fleettop.supervisor.capabilities.gpu import GpuStartGate, GpuWatchdogs

    section = sup.fleet.gpu
    GpuStartGate.install(sup, section)
    from fleettop.probes.sensors.nvml import open_nvml

    gpu = open_nvml()  # the watchdog (and aiohttp) only load on a machine with a GPU
    watchdogs = GpuWatchdogs()
    evictor = None
    if gpu is not None and section.evict and section.backends:
        from fleettop.supervisor.gpu.evictor import Evictor, read_activity

        activity = sup.state_dir / "gpu-activity.json"
        evictor = Evictor.from_config(gpu, section, emit=sup.emit,
                                      activity=lambda: read_activity(activity))
        watchdogs.run(evictor.run)
    if sup.fleet.governor.enabled:
        from fleettop.supervisor.gpu.governor import Governor, Sampler

        sampler = Sampler("/", gpu=gpu,
                          cgroups=lambda: {n: rt.cgroup for n, rt in sup.agents.items()})
        governor = Governor(sampler, sup.fleet.governor, supervisor=sup, evictor=evictor,
                            state_path=sup.state_dir / "governor.json")
        watchdogs.run(governor.run)
    sup.add(watchdogs)
