"""Benchmark the GPU gate at the proxy; prints one JSON object.

One proxy process, one mock backend marked as a local-GPU server, two agents: `shared` (its
requests wait for the fleet's GPU lock at the proxy) and `none` (straight through). Requests
alternate between them in one run, so the difference is what the gate adds per request:
queueing, the file lock taken and given back (the gate lets it go when idle), the activity
file written for the VRAM watchdog. Then two shared agents at once, to show the serialisation
itself: every request's wait for the other's.

    python bench/proxy_gpu.py [--rounds 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

TOKENS = {"gated": "g" * 32, "free": "f" * 32, "other": "o" * 32}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def start_mock() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "fleettop.supervisor.demo.mock_llm",
                             "--port", "0", "--token-delay", "0"], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().split()[-1].rstrip("/")


def start_proxy(tmp: Path, mock: str) -> tuple[subprocess.Popen[str], int]:
    (tmp / "tokens.json").write_text(json.dumps(TOKENS))
    cfg = {"gpu": {"lock_dir": str(tmp / "gpu"), "backends": [mock],
                   "activity": str(tmp / "activity.json"),
                   "agents": {"gated": "shared", "other": "shared", "free": "none"}}}
    (tmp / "cfg.json").write_text(json.dumps(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "fleettop.probes.proxy.main", "--state-dir",
                             str(tmp), "--config", str(tmp / "cfg.json"), "--tokens",
                             str(tmp / "tokens.json")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    while True:
        ev = json.loads(proc.stdout.readline())
        if ev.get("event") == "proxy.ready":
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, int(ev["port"])


def opener(agent: str, port: int) -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(urllib.request.ProxyHandler(
        {"http": f"http://{agent}:{TOKENS[agent]}@127.0.0.1:{port}"}))


def one(op: urllib.request.OpenerDirector, url: str, i: int) -> float:
    body = {"model": "demo-chat", "stream": False, "max_tokens": 4,
            "messages": [{"role": "user", "content": f"q{i}"}]}
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    with op.open(req, timeout=30) as r:
        r.read()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    out: dict[str, object] = {"bench": "proxy_gpu", "rounds": args.rounds}
    with tempfile.TemporaryDirectory() as tmp:
        mock, url = start_mock()
        proxy, port = start_proxy(Path(tmp), url)
        try:
            chat = url + "/v1/chat/completions"
            gated, free = opener("gated", port), opener("free", port)
            for i in range(20):  # warm-up: imports, connections, the lock folder
                one(gated, chat, i)
                one(free, chat, i)
            g, f = [], []
            for i in range(args.rounds):
                order = ((gated, g), (free, f)) if i % 2 else ((free, f), (gated, g))
                for op, acc in order:
                    acc.append(one(op, chat, i))
            out["uncontended_ms"] = {
                "gated_p50": round(pct(g, 0.5), 3), "gated_p99": round(pct(g, 0.99), 3),
                "direct_p50": round(pct(f, 0.5), 3), "direct_p99": round(pct(f, 0.99), 3),
                "added_p50": round(pct(g, 0.5) - pct(f, 0.5), 3),
                "added_mean": round(statistics.mean(g) - statistics.mean(f), 3)}
            # Two shared agents at once: each request now also waits for the other's.
            waits: dict[str, list[float]] = {"gated": [], "other": []}

            def agent(name: str) -> None:
                op = opener(name, port)
                for i in range(args.rounds // 2):
                    waits[name].append(one(op, chat, i))

            t0 = time.perf_counter()
            threads = [threading.Thread(target=agent, args=(n,)) for n in waits]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            both = waits["gated"] + waits["other"]
            out["two_shared_agents"] = {
                "requests": len(both), "requests_per_s": round(len(both) / wall, 1),
                "latency_p50_ms": round(pct(both, 0.5), 3),
                "latency_p99_ms": round(pct(both, 0.99), 3)}
            stats = json.loads(urllib.request.urlopen(url + "/mock/stats").read())
            out["upstream_max_in_flight"] = stats["max_in_flight"]
        finally:
            proxy.terminate()
            mock.terminate()
            proxy.wait(10)
            mock.wait(10)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
