"""serve bench: one JSON object on stdout.

- serve-side CPU (percent of one core, this process only) with 50 agents changing every
  refresh and ~10 events/s, first with no viewers, then with 10 WebSocket clients that run in
  a separate process (so their CPU is not counted); messages and bytes each client received;
- `/metrics` scrape time over HTTP with 200 agents (p50/p95/max ms), the render alone, and
  the size of the exposition.

The fleet is the deterministic fake from tests/ (no processes); its own tick and emit cost
is included in both CPU numbers, so their difference is what the viewers cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fleettop.supervisor.web.metrics import render_metrics
from fleettop.supervisor.web.server import MetricsServer
from tests.support.fake_serve_fleet import FakeFleetClient  # noqa: E402

VIEWERS = """
import asyncio, json, sys, time
import aiohttp
url, n, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
async def viewer(http, stats):
    async with http.ws_connect(url, max_msg_size=0) as ws:
        stats["connected"] = True
        async for msg in ws:
            stats["messages"] += 1
            stats["bytes"] += len(msg.data)
async def main():
    stats = [{"messages": 0, "bytes": 0, "connected": False} for _ in range(n)]
    async with aiohttp.ClientSession() as http:
        tasks = [asyncio.create_task(viewer(http, s)) for s in stats]
        while not all(s["connected"] for s in stats):
            await asyncio.sleep(0.01)
        print("connected", flush=True)
        await asyncio.sleep(seconds)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    print(json.dumps(stats), flush=True)
asyncio.run(main())
"""


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def drive(client: FakeFleetClient, stop: asyncio.Event) -> None:
    """Every agent's numbers move every 0.5 s; about 10 events a second."""
    step = 0
    while not stop.is_set():
        step += 1
        if step % 5 == 0:
            client.tick(step)
        agent = client.agents[step % len(client.agents)]["name"]
        client.emit("agent.sample", agent, "", step=step, cpu=step % 100)
        await asyncio.sleep(0.1)


async def cpu_over(seconds: float) -> float:
    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.sleep(seconds)
    return 100.0 * (time.process_time() - cpu0) / (time.perf_counter() - wall0)


async def stream_bench(seconds: float, n_agents: int, n_viewers: int) -> dict[str, Any]:
    client = FakeFleetClient(n_agents)
    server = MetricsServer(refresh_s=1.0)
    await server.start(client, port=0)
    stop = asyncio.Event()
    driver = asyncio.create_task(drive(client, stop))
    try:
        await asyncio.sleep(1.0)
        idle = await cpu_over(seconds)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", VIEWERS, server.url + "ws", str(n_viewers), str(seconds + 1),
            stdout=asyncio.subprocess.PIPE)
        assert proc.stdout is not None
        await asyncio.wait_for(proc.stdout.readline(), 30)
        await asyncio.sleep(0.5)
        busy = await cpu_over(seconds)
        out, _ = await proc.communicate()
        viewers = json.loads(out.decode().strip().splitlines()[-1])
        stats = server.stats()
    finally:
        stop.set()
        await driver
        await server.stop()
    return {
        "agents": n_agents, "viewers": n_viewers, "seconds": seconds, "refresh_s": 1.0,
        "cpu_percent_no_viewers": round(idle, 2),
        f"cpu_percent_{n_viewers}_viewers": round(busy, 2),
        "viewer_messages_per_s": round(statistics.mean(v["messages"] for v in viewers)
                                       / (seconds + 1), 2),
        "viewer_kib_per_s": round(statistics.mean(v["bytes"] for v in viewers)
                                  / (seconds + 1) / 1024, 2),
        "skips": stats["skips"], "drops": stats["drops"],
    }


async def scrape_bench(n_agents: int, scrapes: int) -> dict[str, Any]:
    client = FakeFleetClient(n_agents)
    for a in client.agents:
        a["trips"] = {"token_loop": 1}
    server = MetricsServer()
    await server.start(client, port=0)
    times: list[float] = []
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(scrapes):
                t0 = time.perf_counter()
                async with http.get(server.url + "metrics") as r:
                    body = await r.read()
                times.append((time.perf_counter() - t0) * 1000)
        snap = await client.snapshot()
        render: list[float] = []
        for _ in range(scrapes):
            t0 = time.perf_counter()
            render_metrics(snap)
            render.append((time.perf_counter() - t0) * 1000)
    finally:
        await server.stop()
    series = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))
    return {
        "agents": n_agents, "scrapes": scrapes,
        "scrape_ms_p50": round(pct(times, 0.5), 2), "scrape_ms_p95": round(pct(times, 0.95), 2),
        "scrape_ms_max": round(max(times), 2), "render_ms_p50": round(pct(render, 0.5), 2),
        "bytes": len(body), "series": series,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--scrapes", type=int, default=50)
    args = parser.parse_args()
    stream = await stream_bench(args.seconds, 50, 10)
    scrape = await scrape_bench(200, args.scrapes)
    print(json.dumps({"bench": "serve", "stream": stream, "metrics": scrape}))


if __name__ == "__main__":
    asyncio.run(main())
