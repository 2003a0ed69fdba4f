"""Trip latency through the real supervisor; prints one JSON object.

A real agent process (urllib through HTTP_PROXY, in its own cgroup) streams from a paced SSE
upstream that falls into a loop after a prefix. The proxy trips (`token_loop: freeze`), the
supervisor freezes the agent, we resume it, and it asks again: `--trips` times. Latency is from
the upstream sending the chunk that completes the evidence (the event holding the trip's
`at_char`, stamped with CLOCK_MONOTONIC) to `cgroup.events` saying `frozen 1` (woken by poll;
the kernel signals that file on change) in a separate observer process (a thread of this one
would need the GIL, which the supervisor here may hold for up to the 5 ms switch interval), or
/proc state `T` on the SIGSTOP fallback.

    python bench/proxy_trip.py [--trips 50]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

AGENT = r"""
import json, os, time, urllib.request
url = os.environ["BENCH_UPSTREAM"] + "/v1/chat/completions"
while True:
    body = json.dumps({"model": "m", "stream": True,
                       "messages": [{"role": "user", "content": "go %f" % time.time()}]})
    req = urllib.request.Request(url, data=body.encode(), method="POST",
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            for _ in resp:
                pass
    except Exception:
        pass
    time.sleep(0.05)
"""


# Prints CLOCK_MONOTONIC ns each time cgroup.events turns to `frozen 1`.
OBSERVER = r"""
import os, select, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
poller = select.poll()
poller.register(fd, select.POLLPRI | select.POLLERR)
was = None
print("ready", flush=True)
while True:
    os.lseek(fd, 0, 0)
    frozen = b"frozen 1" in os.read(fd, 256)
    if frozen and not was:
        print(time.monotonic_ns(), flush=True)
    was = frozen
    poller.poll(1000)
"""


class FrozenObserver:
    """The observer process above, its timestamps queued as they come."""

    def __init__(self, cgroup: Path) -> None:
        import queue
        import subprocess

        self.proc = subprocess.Popen([sys.executable, "-c", OBSERVER,
                                      str(cgroup / "cgroup.events")],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "ready"
        self.times: queue.Queue[int] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.times.put(int(line))

    def next_after(self, t_ns: int, timeout: float) -> int | None:
        import queue

        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                t = self.times.get(timeout=left)
            except queue.Empty:
                return None
            if t >= t_ns:
                return t
        return None

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


class Upstream:
    def __init__(self, pace: float) -> None:
        self.pace = pace
        self.sent: list[tuple[int, int]] = []  # (chars so far, send time ns) of the last stream

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next((h.split(b":")[1] for h in head.split(b"\r\n")
                               if h.lower().startswith(b"content-length")), b"0"))
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")
            sent: list[tuple[int, int]] = []
            self.sent = sent
            chars = 0
            for i in range(2000):
                text = f"step {i} of the plan is fine. " if i < 30 else "I will try again. "
                chars += len(text)
                data = b"data: " + json.dumps({"choices": [{"delta": {"content": text}}]}).encode()
                data += b"\n\n"
                writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                sent.append((chars, time.monotonic_ns()))
                await writer.drain()
                await asyncio.sleep(self.pace)
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            pass
        writer.close()


def wait_frozen(pid: int, timeout: float) -> int | None:
    """SIGSTOP fallback: block until the agent shows state T; CLOCK_MONOTONIC ns then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return None
        if state == "T":
            return time.monotonic_ns()
        time.sleep(0.0002)
    return None


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else float("nan")


async def main(trips: int, loop: str = "uvloop") -> dict:
    from fleettop.supervisor.capabilities.proxy import ProxyBreaker
    from fleettop.supervisor.config.load import parse_fleet
    from fleettop.supervisor.core.supervisor import Supervisor

    up = Upstream(pace=0.002)
    server = await asyncio.start_server(up.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    tmp = Path(tempfile.mkdtemp(prefix="fleettop-trip-"))
    os.environ.setdefault("FLEETTOP_STATE_DIR", str(tmp / "state"))
    os.environ.setdefault("FLEETTOP_RUNTIME_DIR", str(tmp / "run"))
    fleet = {"proxy": {"event_loop": loop},
             "agents": {"looper": {"cmd": [sys.executable, "-c", AGENT], "restart": "no",
                                   "env": {"BENCH_UPSTREAM": f"http://127.0.0.1:{port}"}}}}
    text = json.dumps(fleet)
    (tmp / "fleet.yaml").write_text(text)
    sup = Supervisor(parse_fleet(text, str(tmp / "fleet.yaml")))
    link = ProxyBreaker.for_fleet(sup)
    sup.add(link)
    await link.start()
    events = sup.subscribe()
    await sup.start()
    lat_ms: list[float] = []
    detect_ms: list[float] = []  # upstream chunk sent → proxy trip decided
    report_ms: list[float] = []  # → the supervisor's ProxyBreaker has the report
    freeze_ms: list[float] = []  # → cgroup.events says frozen 1
    missed = resume_refused = 0
    observer = None
    try:
        rt = sup.agents["looper"]
        if rt.cgroup is not None:
            observer = FrozenObserver(rt.cgroup)
        for _ in range(trips):
            pids = rt.pids()
            t_asked = time.monotonic_ns()
            frozen = asyncio.create_task(asyncio.to_thread(
                observer.next_after, t_asked, 20.0) if observer is not None else
                asyncio.to_thread(wait_frozen, pids[0] if pids else 0, 20.0))
            trip = None
            try:
                while trip is None:
                    ev = await asyncio.wait_for(events.get(), 30)
                    if ev.kind == "breaker.trip" and ev.agent == "looper":
                        trip = ev
            except TimeoutError:
                missed += 1  # reported, not hidden: see "missed"
                await frozen
                break
            t_frozen = await frozen
            # Resume only once the supervisor has finished its freeze (`agent.frozen`): the
            # kernel says `frozen 1` before freeze_agent() marks the agent FROZEN, and a resume
            # sent in between is refused ("running, not frozen"), leaving the agent frozen
            # with nobody to thaw it (the stall this bench used to hit after ~10 trips).
            try:
                while not (ev.kind == "agent.frozen" and ev.agent == "looper"):
                    ev = await asyncio.wait_for(events.get(), 10)
            except TimeoutError:
                missed += 1
                break
            at_char = trip.data.get("evidence", {}).get("at_char")
            sent = up.sent
            t_chunk = next((t for chars, t in sent if chars >= (at_char or 0)), None)
            if t_frozen is None or t_chunk is None:
                missed += 1
            else:
                lat_ms.append((t_frozen - t_chunk) / 1e6)
                t_proxy = trip.data.get("proxy_mono_ns") or t_chunk
                t_link = trip.data.get("link_mono_ns") or t_proxy
                detect_ms.append((t_proxy - t_chunk) / 1e6)
                report_ms.append((t_link - t_proxy) / 1e6)
                freeze_ms.append((t_frozen - t_link) / 1e6)
            reply = await sup.resume_agent("looper", reason="bench")
            if not reply.get("ok"):
                resume_refused += 1
                break
            await asyncio.sleep(0.1)
    finally:
        if observer is not None:
            observer.close()
        sup.unsubscribe(events)
        await sup.shutdown()
        await link.stop()
        server.close()
    return {"trip_latency_ms": {"n": len(lat_ms), "missed": missed, "p50": pct(lat_ms, 0.5),
                                "p99": pct(lat_ms, 0.99), "max": pct(lat_ms, 1.0)},
            "resume_refused": resume_refused,
            "parts_p50_ms": {"chunk_to_trip": pct(detect_ms, 0.5),
                             "trip_to_link": pct(report_ms, 0.5),
                             "link_to_frozen": pct(freeze_ms, 0.5)},
            "parts_p99_ms": {"chunk_to_trip": pct(detect_ms, 0.99),
                             "trip_to_link": pct(report_ms, 0.99),
                             "link_to_frozen": pct(freeze_ms, 0.99)},
            "freezer": "cgroup" if rt.cgroup is not None else "sigstop",
            "proxy_event_loop": loop}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--trips", type=int, default=50)
    ap.add_argument("--proxy-loop", choices=("uvloop", "asyncio"), default="uvloop",
                    help="the proxy's event loop (proxy.event_loop)")
    args = ap.parse_args()
    threading.stack_size(1 << 20)
    print(json.dumps(asyncio.run(main(args.trips, args.proxy_loop))))
