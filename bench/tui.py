"""UI cost: CPU% and RSS of the UI process with 50 and 200 agents at the default refresh, and
the time from a state change in the supervisor to it being on screen.

Each configuration runs in its own process over the fake client in tests/support/fake_fleet.py, in
two cases and two terminal sizes (80×24 and 160×60, where every row of 50 agents is visible):

- worst: every running agent's numbers change on every poll, so every row repaints;
- realistic: about 20% of the agents change per poll (a different fifth each time), the rest
  sit idle with steady numbers.

Textual's headless driver skips turning frames into terminal bytes; the bench does that step
itself (and throws the bytes away) so the cost of a real terminal is counted, and reports the
frames and bytes per poll. Prints one JSON object.

    .venv/bin/python bench/tui.py [--seconds 10]
    .venv/bin/python bench/tui.py --child 50 --case realistic --size 80x24   # one run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


SIZES = {"80x24": (80, 24), "160x60": (160, 60)}
CASES = ("worst", "realistic")


def _fleet(n: int, case: str) -> Any:
    from tests.support.fake_fleet import FakeFleet

    class WorstFleet(FakeFleet):
        async def snapshot(self) -> dict[str, Any]:
            self.tick()  # every running agent moves
            return await super().snapshot()

    class RealisticFleet(FakeFleet):
        polls = 0

        async def snapshot(self) -> dict[str, Any]:
            self.polls += 1
            self.now += 1
            for i, a in enumerate(self.agents):
                if a["state"] == "running" and (i + self.polls) % 5 == 0:
                    a["cpu_percent"] = float((i * 7 + self.polls) % 90)
                    a["tokens_per_s"] = float((i + self.polls) % 60)
                    a["requests"] += 1
            return await super().snapshot()

    return (WorstFleet if case == "worst" else RealisticFleet)(n)


async def _child(n: int, seconds: float, refresh_s: float, case: str,
                 size: str) -> dict[str, Any]:
    from textual._compositor import CompositorUpdate

    from fleettop.tui.app import FleettopApp
    from fleettop.tui.widgets import AgentsTable

    fleet = _fleet(n, case)
    app = FleettopApp(fleet, refresh_s=refresh_s)
    frames = {"n": 0, "bytes": 0}
    display = app._display

    def to_terminal(screen: Any, renderable: Any) -> None:
        # what App._display does for a real terminal, minus the write
        if isinstance(renderable, CompositorUpdate) and not app._batch_count:
            frames["n"] += 1
            frames["bytes"] += len(renderable.render_segments(app.console).encode())
        display(screen, renderable)

    app._display = to_terminal  # type: ignore[method-assign]
    out: dict[str, Any] = {"agents": n, "case": case, "size": size, "refresh_s": refresh_s}
    async with app.run_test(size=SIZES[size]) as pilot:
        table = app.query_one(AgentsTable)
        await pilot.pause(2.0)  # warm up: first layout, imports, history fill
        polls0, cells0, cpu0, t0 = app.polls, table.cell_updates, _cpu_s(), time.monotonic()
        frames0, bytes0 = frames["n"], frames["bytes"]
        await asyncio.sleep(seconds)
        cpu, wall = _cpu_s() - cpu0, time.monotonic() - t0
        polls = max(1, app.polls - polls0)
        out.update(cpu_percent=round(100 * cpu / wall, 2), rss_mib=round(_rss_mib(), 1),
                   max_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                                     1),
                   polls_per_s=round((app.polls - polls0) / wall, 2),
                   cells_per_poll=round((table.cell_updates - cells0) / polls, 1),
                   frames_per_poll=round((frames["n"] - frames0) / polls, 2),
                   bytes_per_poll=round((frames["bytes"] - bytes0) / polls))

        # latency: state change → in the table and a frame drawn after it; with the event
        # stream (early poll) and without it (the periodic poll alone)
        async def shown(name: str, word: str) -> float:
            start = time.monotonic()
            while word not in str(table.get_row(name)[1]):  # noqa: ASYNC110 (polls the UI)
                await asyncio.sleep(0.002)
            drawn = frames["n"]
            while frames["n"] == drawn:  # noqa: ASYNC110
                await asyncio.sleep(0.002)
            return time.monotonic() - start

        names = [a["name"] for a in fleet.agents if a["state"] == "running"][:8]
        with_event, poll_only = [], []
        for name in names[:4]:
            fleet.set_state(name, "frozen", reason="bench")  # emits agent.state
            with_event.append(await shown(name, "FROZEN"))
        for name in names[4:8]:
            await asyncio.sleep(0.37 * refresh_s)  # land at varied points of the cycle
            next(a for a in fleet.agents if a["name"] == name)["state"] = "frozen"
            poll_only.append(await shown(name, "FROZEN"))
        out["latency_ms_event"] = round(1000 * statistics.median(with_event), 1)
        out["latency_ms_poll_only_max"] = round(1000 * max(poll_only), 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--refresh", type=float, default=1.0, help="refresh period (default 1 s)")
    ap.add_argument("--child", type=int, help="run one configuration with N agents")
    ap.add_argument("--case", choices=CASES, default="worst")
    ap.add_argument("--size", choices=sorted(SIZES), default="160x60")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(_child(args.child, args.seconds, args.refresh, args.case,
                                            args.size))))
        return
    runs = []
    for n, case, size in [(50, c, s) for c in CASES for s in SIZES] + [
            (200, c, "160x60") for c in CASES]:
        proc = subprocess.run([sys.executable, __file__, "--child", str(n), "--seconds",
                               str(args.seconds), "--refresh", str(args.refresh), "--case",
                               case, "--size", size],
                              capture_output=True, text=True, check=True, cwd=ROOT)
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(json.dumps({
        "bench": "tui", "driver": "textual headless", "refresh_s": args.refresh,
        "window_s": args.seconds, "cpus": os.cpu_count(), "runs": runs,
        "targets": {"cpu_percent_50_agents": 5, "rss_mib": 80,
                    "latency": "a freeze on screen within one refresh"},
    }))


if __name__ == "__main__":
    main()
