"""Benchmark the token proxy; prints one JSON object.

- added latency per chunk, direct vs through the proxy vs through plain mitmproxy, alternating
  rounds in one run (p50/p99): the upstream stamps each SSE event with CLOCK_MONOTONIC, the
  client subtracts on receipt;
- events/s flat out through plain mitmdump and through fleettop's proxy, and each proxy's CPU
  time per event (steadier than events/s when other work shares the cores); plain mitmdump
  streams every response (`stream_large_bodies=1`, so `stream = True` after the first read),
  fleettop's addon through its `stream` callable;
- proxy RSS, and peak RSS + CPU with 50 concurrent paced streams (fleettop and plain mitmproxy);
  trip latency (loop onset at the upstream → `breaker.trip` on the proxy's stdout)
  in ms and in chunks; detector chars-after-onset (median/p90) and ns/char on tests/data.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import queue
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "benchtoken0123456789"


async def sse_server(pace: float) -> tuple[asyncio.AbstractServer, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next((h.split(b":")[1] for h in head.split(b"\r\n")
                           if h.lower().startswith(b"content-length")), b"0"))
        body = json.loads(await reader.readexactly(length))
        n, loop_at = body.get("n", 1000), body.get("loop_at")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")
        try:
            for i in range(n):
                text = ("I will try again. " if loop_at is not None and i >= loop_at
                        else f"word{i} {random.random():.6f} ")
                ev = json.dumps({"choices": [{"delta": {"content": text}}], "i": i,
                                 "t": time.monotonic_ns()}).encode()
                data = b"data: " + ev + b"\n\n"
                writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                if pace:
                    await writer.drain()
                    await asyncio.sleep(pace)
                elif i % 64 == 0:
                    await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        except (ConnectionError, OSError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def stream(port: int, via: int | None, n: int, loop_at: int | None = None,
                 agent: str = "bench") -> tuple[list[float], int, float]:
    body = json.dumps({"model": "m", "stream": True, "n": n, "loop_at": loop_at,
                       "messages": [{"role": "user", "content": f"go {random.random()}"}]})
    import base64

    auth = base64.b64encode(f"{agent}:{TOKEN}".encode()).decode()
    target = f"http://127.0.0.1:{port}/v1/chat/completions" if via else "/v1/chat/completions"
    reader, writer = await asyncio.open_connection("127.0.0.1", via or port)
    writer.write((f"POST {target} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
                  f"proxy-authorization: Basic {auth}\r\ncontent-type: application/json\r\n"
                  f"content-length: {len(body)}\r\n\r\n{body}").encode())
    await writer.drain()
    lat, count, t0 = [], 0, time.perf_counter()
    buf = b""
    try:
        await reader.readuntil(b"\r\n\r\n")
        while size := int((await reader.readline()).strip() or b"0", 16):
            buf += await reader.readexactly(size + 2)
            buf = buf[:-2]
            now = time.monotonic_ns()
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if line.startswith(b"data: {"):
                    lat.append((now - json.loads(line[6:])["t"]) / 1000)
                    count += 1
    except (ConnectionError, OSError, asyncio.IncompleteReadError, ValueError):
        pass
    writer.close()
    return lat, count, time.perf_counter() - t0


def start_proxy(tmp: Path, plain: bool = False) -> tuple[subprocess.Popen, int]:
    if plain:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([str(Path(sys.executable).parent / "mitmdump"), "-q",
                                 "--listen-host", "127.0.0.1", "-p", str(port), "--set",
                                 "stream_large_bodies=1", "--set", f"confdir={tmp}/plain"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(2.5)
        return proc, port
    (tmp / "tokens.json").write_text(json.dumps({"bench": TOKEN, "looper": TOKEN}))
    (tmp / "cfg.json").write_text(json.dumps({"breaker": {"policy": {"token_loop": "warn",
                                                                    "retry_loop": "warn"}}}))
    # The bench's requests differ only in a masked number: a retry loop, rightly.
    proc = subprocess.Popen([sys.executable, "-m", "fleettop.probes.proxy_main", "--state-dir",
                             str(tmp), "--config", str(tmp / "cfg.json"), "--tokens",
                             str(tmp / "tokens.json")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    ready = json.loads(proc.stdout.readline())
    # Drain reports continuously: a full pipe would stall the proxy's event loop.
    proc.reports = queue.Queue()
    threading.Thread(target=lambda: [proc.reports.put(json.loads(x)) for x in proc.stdout],
                     daemon=True).start()
    return proc, ready["port"]


async def concurrent_load(up: int, via: int, pid: int, streams: int = 50,
                          n: int = 300) -> dict:
    """`streams` paced streams at once through one proxy: its peak RSS and CPU meanwhile."""
    proc = psutil.Process(pid)
    cpu0, t0 = proc.cpu_times(), time.perf_counter()
    peak = proc.memory_info().rss
    tasks = [asyncio.create_task(stream(up, via, n, agent="bench")) for _ in range(streams)]
    while not all(t.done() for t in tasks):
        peak = max(peak, proc.memory_info().rss)
        await asyncio.sleep(0.1)
    results = [t.result() for t in tasks]
    cpu1, secs = proc.cpu_times(), time.perf_counter() - t0
    used = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return {"streams": streams, "events": sum(r[1] for r in results),
            "complete": sum(r[1] == n for r in results), "seconds": round(secs, 2),
            "rss_peak_mib": round(peak / 2**20, 1), "cpu_percent": round(100 * used / secs, 1),
            "latency_p50_us": pct([x for r in results for x in r[0]], 0.5)}


def _cpu(pid: int | None) -> float:
    if pid is None:
        return 0.0
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 1) if xs else float("nan")


def corpus_numbers() -> dict:
    sys.path.insert(0, str(ROOT))
    from fleettop.supervisor.loops import LoopDetector

    with gzip.open(ROOT / "tests/data/loop_corpus.jsonl.gz", "rt", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    rng = random.Random(1)
    delays, fp, chars, spent = [], 0, 0, 0.0
    loops = [r for r in rows if r["label"] == "loop"]
    for r in rows:
        if r["label"] == "ambiguous":
            continue
        det, text, i, trip = LoopDetector(), r["text"], 0, None
        t0 = time.perf_counter()
        while i < len(text) and trip is None:
            k = rng.randint(2, 24)
            trip = det.feed(text[i : i + k])
            i += k
        spent += time.perf_counter() - t0
        chars += i
        if trip and r["label"] == "loop":
            delays.append(trip.at_char - r["loop_start"])
        elif trip:
            fp += 1
    delays.sort()
    return {"loops": len(loops), "caught": len(delays),
            "recall": round(len(delays) / len(loops), 4),
            "legit": sum(r["label"] == "legit" for r in rows), "false_trips": fp,
            "chars_after_onset_median": delays[len(delays) // 2],
            "chars_after_onset_p90": delays[int(0.9 * len(delays))],
            "detector_ns_per_char": round(spent / chars * 1e9)}


async def main() -> None:
    out: dict = {}
    server, up = await sse_server(pace=0.001)
    flat, up_flat = await sse_server(pace=0.0)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        proc, port = start_proxy(tmp)
        plain, plain_port = start_proxy(tmp, plain=True)
        try:
            await stream(up, port, 50)
            await stream(up, plain_port, 50)
            direct, proxied, plain_lat = [], [], []
            for _ in range(3):  # alternate so drift hits all sides alike
                direct += (await stream(up, None, 600))[0]
                plain_lat += (await stream(up, plain_port, 600))[0]
                proxied += (await stream(up, port, 600))[0]
            out["latency_us"] = {
                "direct_p50": pct(direct, 0.5), "direct_p99": pct(direct, 0.99),
                "proxy_p50": pct(proxied, 0.5), "proxy_p99": pct(proxied, 0.99),
                "added_p50": round(pct(proxied, 0.5) - pct(direct, 0.5), 1),
                "added_p99": round(pct(proxied, 0.99) - pct(direct, 0.99), 1),
                # The same through plain mitmproxy: what mitmproxy itself adds here.
                "plain_added_p50": round(pct(plain_lat, 0.5) - pct(direct, 0.5), 1),
                "plain_added_p99": round(pct(plain_lat, 0.99) - pct(direct, 0.99), 1)}
            rates = {"direct": [], "plain_mitmproxy": [], "fleettop": []}
            # CPU seconds the proxy process spent per event: unlike events/s, it hardly moves
            # when other work on the machine takes the cores away.
            cpu = {"plain_mitmproxy": [0.0, 0], "fleettop": [0.0, 0]}  # seconds, events
            pids = {"plain_mitmproxy": plain.pid, "fleettop": proc.pid}
            for _ in range(5):
                for name, via in (("direct", None), ("plain_mitmproxy", plain_port),
                                  ("fleettop", port)):
                    cpu0 = _cpu(pids.get(name))
                    try:
                        _, count, secs = await asyncio.wait_for(stream(up_flat, via, 2000), 30)
                    except TimeoutError:
                        print("timeout", name, file=sys.stderr)
                        continue
                    rates[name].append(count / secs)
                    if name in cpu:
                        cpu[name][0] += _cpu(pids[name]) - cpu0
                        cpu[name][1] += count
            out["events_per_s"] = {k: round(statistics.median(v)) for k, v in rates.items()}
            out["events_per_s"]["fleettop_vs_plain"] = round(
                out["events_per_s"]["fleettop"] / out["events_per_s"]["plain_mitmproxy"], 3)
            per = {k: secs / max(1, n) * 1e6 for k, (secs, n) in cpu.items()}
            out["proxy_cpu_us_per_event"] = {k: round(v, 1) for k, v in per.items()}
            out["proxy_cpu_us_per_event"]["plain_vs_fleettop"] = round(
                per["plain_mitmproxy"] / per["fleettop"], 3)
            out["proxy_rss_mib"] = round(psutil.Process(proc.pid).memory_info().rss / 2**20, 1)
            # 50 concurrent streams, each paced at 10 ms (5k events/s in all), same upstream.
            slow, up_slow = await sse_server(pace=0.01)
            out["concurrent_50"] = {
                "fleettop": await concurrent_load(up_slow, port, proc.pid),
                "plain_mitmproxy": await concurrent_load(up_slow, plain_port, plain.pid)}
            slow.close()
            # Trip latency: loop onset at event 40, paced 1 ms; `warn` keeps the stream going.
            trips_ms, trips_chunks = [], []
            for _ in range(5):
                t_onset = time.monotonic_ns()
                task = asyncio.create_task(stream(up, port, 400, loop_at=40, agent="looper"))
                ev = {}
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    try:
                        ev = await asyncio.to_thread(proc.reports.get, True, 1.0)
                    except queue.Empty:
                        continue
                    if ev.get("event") == "breaker.trip" and ev.get("kind") == "token_loop":
                        break
                if ev.get("kind") != "token_loop":
                    print("no trip", file=sys.stderr)
                    task.cancel()
                    continue
                t_trip = time.monotonic_ns()
                await task
                # onset = when event 40 was sent: 40 paced events after the stream began
                onset = t_onset + 40 * 1_000_000
                trips_ms.append((t_trip - onset) / 1e6)
                trips_chunks.append(ev["at_char"] and round(
                    (ev["at_char"] - sum(len(f"word{i} 0.000000 ") for i in range(40))) / 18))
            out["trip_latency_ms_from_loop_onset"] = {"p50": pct(trips_ms, 0.5),
                                                      "max": round(max(trips_ms), 1)}
            out["trip_after_onset_chunks"] = {"p50": pct(trips_chunks, 0.5)}
        finally:
            proc.stdin.close()
            proc.wait(timeout=10)
            plain.terminate()
            plain.wait(timeout=10)
    server.close()
    flat.close()
    out["corpus"] = corpus_numbers()
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
