"""Benchmark the token proxy; prints one JSON object.

Side by side (`PROXIES`): fleettop's proxy as shipped; plain mitmdump as shipped; plain
mitmdump on uvloop and fleettop on mitmproxy's own relay (chunk by chunk, asyncio's loop, no
direct writes: what the relay changes do apart from the addon); a bare asyncio byte relay, the
floor.
- added latency per chunk, direct vs through each, alternating rounds in one run (p50/p99):
  the upstream (a process of its own) stamps each SSE event with CLOCK_MONOTONIC, the client
  subtracts on receipt;
- events/s flat out through each, and each proxy's CPU time per event (steadier than events/s
  when other work shares the cores; medians over rounds); plain mitmdump streams every
  response (`stream_large_bodies=1`, so `stream = True` after the first read), fleettop's addon
  through its `stream` callable. Flat out, one read brings many events;
- proxy RSS, and peak RSS + CPU with 50 concurrent paced streams (one event per read: the
  usual shape of token streams);
  trip latency (loop onset at the upstream → `breaker.trip` on the proxy's stdout)
  in ms and in chunks; detector chars-after-onset (median/p90) and ns per char and per byte
  on tests/unit/data, fed in 2–24-char deltas (as replay does) and in the proxy's 128-char batches.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import queue
import random
import ssl
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


async def sse_server(pace: float, tls: ssl.SSLContext | None = None
                     ) -> tuple[asyncio.AbstractServer, int]:
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

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=tls)
    return server, server.sockets[0].getsockname()[1]


def make_cert(folder: Path) -> Path:
    """A self-signed certificate for 127.0.0.1 (cert.pem, key.pem in `folder`): the HTTPS
    upstream's, trusted by the proxies (`upstream_ca`) and the direct client."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(key, hashes.SHA256()))
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return folder / "cert.pem"


def client_tls(cafile: Path | str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cafile))


async def stream(port: int, via: int | None, n: int, loop_at: int | None = None,
                 agent: str = "bench", tls: ssl.SSLContext | None = None
                 ) -> tuple[list[float], int, float]:
    """One streamed request, direct or through the proxy at `via`; with `tls`, HTTPS (through
    a proxy: CONNECT, then TLS to the proxy's certificate for the upstream)."""
    body = json.dumps({"model": "m", "stream": True, "n": n, "loop_at": loop_at,
                       "messages": [{"role": "user", "content": f"go {random.random()}"}]})
    import base64

    auth = base64.b64encode(f"{agent}:{TOKEN}".encode()).decode()
    target = f"http://127.0.0.1:{port}/v1/chat/completions" if via else "/v1/chat/completions"
    if tls is not None and via is None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=tls)
    else:
        reader, writer = await asyncio.open_connection("127.0.0.1", via or port)
    if tls is not None and via is not None:
        writer.write(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
                     f"proxy-authorization: Basic {auth}\r\n\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        await writer.start_tls(tls, server_hostname="127.0.0.1")
        target = "/v1/chat/completions"
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


def start_upstream(pace: float, cert: Path | None = None) -> tuple[subprocess.Popen, int]:
    """The SSE upstream in a process of its own, as an LLM server is: the client then wakes
    from its own wait for every event, direct or proxied (in one loop with the client, a
    direct read came without a wake-up, and "added" counted the client's wake-up too)."""
    proc = subprocess.Popen([sys.executable, __file__, "--upstream", str(pace),
                             *([str(cert.parent)] if cert else [])],
                            stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


async def _serve_upstream(pace: float, certdir: str | None) -> None:
    tls = None
    if certdir:  # HTTPS, with make_cert's certificate
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(Path(certdir) / "cert.pem", Path(certdir) / "key.pem")
    server, port = await sse_server(pace, tls)
    print(port, flush=True)
    async with server:
        await server.serve_forever()


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_proxy(tmp: Path, plain: bool = False, uvloop: bool = False,
                relay: dict | None = None, upstream_ca: Path | None = None
                ) -> tuple[subprocess.Popen, int]:
    """Plain mitmdump (as shipped, or on uvloop), or fleettop's proxy (`relay`: its
    `proxy.merge_reads` / `proxy.event_loop`, default on / uvloop); each trusts `upstream_ca`
    for HTTPS upstreams. The process's `ca_cert` is its CA for clients."""
    if plain:
        port = _port()
        confdir = tmp / f"plain{len(list(tmp.glob('plain*')))}"
        args = ["-q", "--listen-host", "127.0.0.1", "-p", str(port), "--set",
                "stream_large_bodies=1", "--set", f"confdir={confdir}",
                *(["--set", f"ssl_verify_upstream_trusted_ca={upstream_ca}"] if upstream_ca
                  else [])]
        head = "import uvloop; uvloop.install()\n" if uvloop else ""
        code = (f"{head}import sys\nfrom mitmproxy.tools.main import mitmdump\n"
                f"sys.argv = ['mitmdump', *{args!r}]\nmitmdump()")
        proc = subprocess.Popen([sys.executable, "-c", code],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(3)
        proc.ca_cert = confdir / "mitmproxy-ca-cert.pem"
        return proc, port
    tmp = tmp / f"fleettop{len(list(tmp.glob('fleettop*')))}"
    tmp.mkdir()
    (tmp / "tokens.json").write_text(json.dumps({"bench": TOKEN, "looper": TOKEN}))
    (tmp / "cfg.json").write_text(json.dumps({
        "proxy": {**(relay or {}), **({"upstream_ca": str(upstream_ca)} if upstream_ca else {})},
        "breaker": {"policy": {"token_loop": "warn", "retry_loop": "warn"}}}))
    # The bench's requests differ only in a masked number: a retry loop, rightly.
    proc = subprocess.Popen([sys.executable, "-m", "fleettop.probes.proxy.main", "--state-dir",
                             str(tmp), "--config", str(tmp / "cfg.json"), "--tokens",
                             str(tmp / "tokens.json")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    ready = json.loads(proc.stdout.readline())
    proc.ca_cert = ready["ca_cert"]
    # Drain reports continuously: a full pipe would stall the proxy's event loop.
    proc.reports = queue.Queue()
    threading.Thread(target=lambda: [proc.reports.put(json.loads(x)) for x in proc.stdout],
                     daemon=True).start()
    return proc, ready["port"]


def start_bare(uvloop: bool) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench/bare_relay.py"),
                             *(["uvloop"] if uvloop else [])], stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


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
    from fleettop.supervisor.detect.token_loop import LoopDetector

    with gzip.open(ROOT / "tests/unit/data/loop_corpus.jsonl.gz", "rt", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    rng = random.Random(1)
    delays, fp, chars, nbytes, spent = [], 0, 0, 0, 0.0
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
        nbytes += len(text[:i].encode())
        if trip and r["label"] == "loop":
            delays.append(trip.at_char - r["loop_start"])
        elif trip:
            fp += 1
    delays.sort()
    # The proxy feeds the detector 128 chars at a time (_DETECT_CHARS): its cost there, on the
    # legit texts (fed whole: none trips).
    legit = [r["text"] for r in rows if r["label"] == "legit"]
    t0 = time.perf_counter()
    for text in legit:
        det = LoopDetector()
        for j in range(0, len(text), 128):
            det.feed(text[j : j + 128])
    batched = (time.perf_counter() - t0) / sum(map(len, legit)) * 1e9
    return {"loops": len(loops), "caught": len(delays),
            "recall": round(len(delays) / len(loops), 4),
            "legit": sum(r["label"] == "legit" for r in rows), "false_trips": fp,
            "chars_after_onset_median": delays[len(delays) // 2],
            "chars_after_onset_p90": delays[int(0.9 * len(delays))],
            "detector_ns_per_char": round(spent / chars * 1e9),
            "detector_ns_per_byte": round(spent / nbytes * 1e9),
            "detector_ns_per_char_128_char_feeds_legit": round(batched)}


async def https_numbers(cert: Path, procs: dict[str, tuple[subprocess.Popen, int]]) -> dict:
    """The same through TLS at both ends (an HTTPS upstream; the client CONNECTs and trusts
    the proxy's CA): added latency p50 and events/s flat out, fleettop vs plain mitmproxy."""
    paced, up = start_upstream(0.001, cert)
    flat, up_flat = start_upstream(0.0, cert)
    try:
        direct = client_tls(cert)
        tls = {k: client_tls(p.ca_cert) for k, (p, _) in procs.items()}
        for name, (_, via) in procs.items():
            await stream(up, via, 20, tls=tls[name])
        lat: dict[str, list[float]] = {"direct": [], **{k: [] for k in procs}}
        for _ in range(3):
            lat["direct"] += (await stream(up, None, 600, tls=direct))[0]
            for name, (_, via) in procs.items():
                lat[name] += (await stream(up, via, 600, tls=tls[name]))[0]
        rates: dict[str, list[float]] = {"direct": [], **{k: [] for k in procs}}
        for _ in range(5):
            for name, via in (("direct", None), *((k, v[1]) for k, v in procs.items())):
                _, count, secs = await stream(up_flat, via, 3000,
                                              tls=tls.get(name, direct))
                rates[name].append(count / secs)
    finally:
        paced.terminate()
        flat.terminate()
    d50 = pct(lat["direct"], 0.5)
    eps = {k: round(statistics.median(v)) for k, v in rates.items()}
    return {"direct_p50_us": d50,
            "added_p50_us": {k: round(pct(v, 0.5) - d50, 1) for k, v in lat.items()
                             if k != "direct"},
            "events_per_s": eps,
            "fleettop_vs_plain": ratio(eps["fleettop"], eps["plain_mitmproxy"])}


# Every proxy the bench runs side by side; rounds alternate between them.
PROXIES = {
    "fleettop": {},  # as shipped: one piece per read, uvloop, direct writes
    "plain_mitmproxy": {"plain": True},  # mitmdump as shipped
    # What fleettop's relay changes do without the addon, and the addon without them:
    "plain_mitmproxy_uvloop": {"plain": True, "uvloop": True},
    "fleettop_chunkwise_asyncio": {"relay": {"merge_reads": False, "event_loop": "asyncio",
                                             "direct_writes": False}},
    # The floor: a bare byte relay (no HTTP parsing) — what a hop through any asyncio proxy
    # costs on this machine.
    "bare_relay": {"bare": True},
    "bare_relay_uvloop": {"bare": True, "uvloop": True},
}


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("nan")


async def main() -> None:
    out: dict = {}
    server, up = start_upstream(pace=0.001)
    flat, up_flat = start_upstream(pace=0.0)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cert = make_cert(tmp)
        procs: dict[str, tuple[subprocess.Popen, int]] = {}
        for name, spec in PROXIES.items():
            procs[name] = (start_bare(spec.get("uvloop", False)) if spec.get("bare") else
                           start_proxy(tmp, spec.get("plain", False), spec.get("uvloop", False),
                                       spec.get("relay"), upstream_ca=cert))
        proc, port = procs["fleettop"]
        plain, plain_port = procs["plain_mitmproxy"]
        try:
            for _, via in procs.values():
                await stream(up, via, 50)
            lat: dict[str, list[float]] = {"direct": [], **{k: [] for k in procs}}
            for _ in range(4):  # alternate so drift hits all sides alike
                lat["direct"] += (await stream(up, None, 600))[0]
                for name, (_, via) in procs.items():
                    lat[name] += (await stream(up, via, 600))[0]
            d50, d99 = pct(lat["direct"], 0.5), pct(lat["direct"], 0.99)
            out["latency_us"] = {
                "direct_p50": d50, "direct_p99": d99,
                "proxy_p50": pct(lat["fleettop"], 0.5), "proxy_p99": pct(lat["fleettop"], 0.99),
                "added_p50": round(pct(lat["fleettop"], 0.5) - d50, 1),
                "added_p99": round(pct(lat["fleettop"], 0.99) - d99, 1),
                # The same through plain mitmproxy: what mitmproxy itself adds here.
                "plain_added_p50": round(pct(lat["plain_mitmproxy"], 0.5) - d50, 1),
                "plain_added_p99": round(pct(lat["plain_mitmproxy"], 0.99) - d99, 1),
                "added_p50_each": {k: round(pct(v, 0.5) - d50, 1) for k, v in lat.items()
                                   if k != "direct"}}
            rates: dict[str, list[float]] = {"direct": [], **{k: [] for k in procs}}
            # CPU seconds the proxy process spent per event: unlike events/s, it hardly moves
            # when other work on the machine takes the cores away.
            cpu: dict[str, list[float]] = {k: [] for k in procs}
            for _ in range(7):
                for name, via in (("direct", None), *((k, v[1]) for k, v in procs.items())):
                    pid = procs[name][0].pid if name in procs else None
                    cpu0 = _cpu(pid)
                    try:
                        _, count, secs = await asyncio.wait_for(stream(up_flat, via, 3000), 30)
                    except TimeoutError:
                        print("timeout", name, file=sys.stderr)
                        continue
                    rates[name].append(count / secs)
                    if name in cpu and count:
                        cpu[name].append((_cpu(pid) - cpu0) / count * 1e6)
            eps = {k: round(statistics.median(v)) for k, v in rates.items() if v}
            out["events_per_s"] = {**{k: eps.get(k) for k in ("direct", "plain_mitmproxy",
                                                              "fleettop")},
                                   "fleettop_vs_plain": ratio(eps["fleettop"],
                                                              eps["plain_mitmproxy"]),
                                   "each": eps,
                                   "each_vs_plain": {k: ratio(v, eps["plain_mitmproxy"])
                                                     for k, v in eps.items()}}
            per = {k: statistics.median(v) for k, v in cpu.items() if v}
            out["proxy_cpu_us_per_event"] = {
                "plain_mitmproxy": round(per["plain_mitmproxy"], 1),
                "fleettop": round(per["fleettop"], 1),
                "plain_vs_fleettop": ratio(per["plain_mitmproxy"], per["fleettop"]),
                "each": {k: round(v, 1) for k, v in per.items()}}
            out["proxy_rss_mib"] = round(psutil.Process(proc.pid).memory_info().rss / 2**20, 1)
            # 50 concurrent streams, each paced at 10 ms (5k events/s in all), same upstream:
            # one event per read, the usual shape of token streams.
            slow, up_slow = start_upstream(pace=0.01)
            out["concurrent_50"] = {
                name: await concurrent_load(up_slow, procs[name][1], procs[name][0].pid)
                for name in ("fleettop", "plain_mitmproxy", "fleettop_chunkwise_asyncio")}
            slow.terminate()
            out["https"] = await https_numbers(cert, {k: procs[k] for k in ("fleettop",
                                                                          "plain_mitmproxy")})
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
            for p, _ in procs.values():
                if p.stdin:
                    p.stdin.close()
                else:
                    p.terminate()
                p.wait(timeout=10)
    server.terminate()
    flat.terminate()
    out["corpus"] = corpus_numbers()
    print(json.dumps(out))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--upstream"]:
        asyncio.run(_serve_upstream(float(sys.argv[2]), (sys.argv[3:] or [None])[0]))
    else:
        asyncio.run(main())
