"""Demo agents: small real programs that misbehave in the ways fleettop must catch.

Each subcommand is an agent the demo fleet launches: a healthy chatter (that can turn into a
token loop), a naive retry loop, a memory leak, a cron batch job, a sleeping process tree and a
CPU spinner. They talk to the LLM with plain `urllib` through the default opener on purpose:
that opener honours HTTP_PROXY for loopback too (unless NO_PROXY says otherwise), so the
fleettop proxy sees their traffic exactly as it would a real agent's.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import io
import json
import os
import re
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

DEFAULT_LLM = "http://127.0.0.1:11435"
_TOPICS = ["GPU scheduling", "log rotation", "retry backoff", "model quantisation",
           "memory leaks", "cron jitter", "prompt caching", "context windows"]


def base_url() -> str:
    return os.environ.get("FLEETTOP_DEMO_LLM", DEFAULT_LLM).rstrip("/")


def default_model() -> str:
    """The healthy model; FLEETTOP_DEMO_MODEL points the demo at a real backend's model."""
    return os.environ.get("FLEETTOP_DEMO_MODEL", "demo-chat")


def _url(path: str) -> str:
    # Accept an OpenAI-style base that already ends in /v1 (vLLM, api.openai.com).
    base = base_url()
    if base.endswith("/v1") and path.startswith("/v1/"):
        base = base[:-3]
    return base + path


def say(name: str, msg: str) -> None:
    print(f"[{name}] {msg}", flush=True)


def _post(path: str, body: dict[str, Any], timeout: float = 120.0) -> Any:
    headers = {"Content-Type": "application/json"}
    key = os.environ.get("FLEETTOP_DEMO_API_KEY") or os.environ.get("OPENAI_API_KEY")
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(_url(path), data=json.dumps(body).encode(), headers=headers,
                                 method="POST")
    return urllib.request.urlopen(req, timeout=timeout)


def _short(text: str, n: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n] + f"… (+{len(text) - n} chars)"


def _turns(limit: int) -> Iterator[int]:
    """1, 2, 3, ... forever, or up to `limit` when it is > 0 (tests make agents finite)."""
    n = 0
    while limit <= 0 or n < limit:
        n += 1
        yield n


def _prompt(turn: int) -> str:
    return f"Turn {turn}: explain {_TOPICS[turn % len(_TOPICS)]} in a few sentences."


# ---------------------------------------------------------------- LLM calls


def openai_stream(model: str, prompt: str) -> tuple[str, dict[str, Any] | None]:
    """Stream an OpenAI chat completion over SSE; returns (reply, usage)."""
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": prompt}]}
    parts: list[str] = []
    usage = None
    with _post("/v1/chat/completions", body) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                parts.append(choice.get("delta", {}).get("content") or "")
    return "".join(parts), usage


def ollama_chat(model: str, prompt: str) -> tuple[str, dict[str, Any]]:
    """Ollama /api/chat with its default NDJSON stream; returns (reply, final object)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}]}
    parts: list[str] = []
    final: dict[str, Any] = {}
    with _post("/api/chat", body) as resp:
        for raw in resp:
            if not raw.strip():
                continue
            obj = json.loads(raw)
            parts.append(obj.get("message", {}).get("content", ""))
            if obj.get("done"):
                final = obj
    return "".join(parts), final


def ollama_generate(model: str, prompt: str) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "stream": False}
    with _post("/api/generate", body) as resp:
        result: dict[str, Any] = json.load(resp)
        return result


def _http_error(exc: urllib.error.HTTPError) -> str:
    try:
        detail = exc.read().decode("utf-8", "replace")
    except OSError:
        detail = ""
    # One line in the log, even for an HTML error page from a proxy or gateway.
    detail = " ".join(re.sub(r"<[^>]+>", " ", detail).split())[:200]
    return f"HTTP {exc.code} {detail}".strip()


# ---------------------------------------------------------------- agents


def run_chat(args: argparse.Namespace) -> int:
    """Healthy chatter; with --loop-after it switches to demo-loop to feed the breaker."""
    for turn in _turns(args.turns):
        looping = args.loop_after > 0 and turn > args.loop_after
        model = "demo-loop" if looping else args.model
        try:
            reply, usage = openai_stream(model, _prompt(turn))
            tokens = (usage or {}).get("completion_tokens", "?")
            say("chat", f"turn {turn} {model}: {_short(reply)} [{tokens} tokens]")
        except urllib.error.HTTPError as exc:
            say("chat", f"turn {turn} {model}: {_http_error(exc)}")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            # A breaker that cuts the stream lands here; a real agent would try again.
            say("chat", f"turn {turn} {model}: stream failed: {exc}")
        if args.turns <= 0 or turn < args.turns:
            time.sleep(args.interval)
    return 0


def run_retry_loop(args: argparse.Namespace) -> int:
    """Works a few turns, then retries a failing request forever with no backoff."""
    for turn in range(1, args.ok_turns + 1):
        try:
            reply, final = ollama_chat(default_model(), _prompt(turn))
            say("retry-loop", f"turn {turn}: {_short(reply, 100)} "
                              f"[{final.get('eval_count')} tokens]")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            say("retry-loop", f"turn {turn}: failed: {exc}")
    prompt = "Summarise the nightly report."
    left = args.turns - args.ok_turns
    if args.turns > 0 and left <= 0:
        return 0
    for attempt in _turns(left if args.turns > 0 else 0):
        try:
            reply, _ = ollama_chat("demo-error", prompt)
            say("retry-loop", f"attempt {attempt}: ok {_short(reply, 80)}")
            return 0
        except urllib.error.HTTPError as exc:
            say("retry-loop", f"attempt {attempt}: {_http_error(exc)}; retrying in {args.delay}s")
        except (urllib.error.URLError, OSError) as exc:
            say("retry-loop", f"attempt {attempt}: {exc}; retrying in {args.delay}s")
        time.sleep(args.delay)
    return 1


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_leaky(args: argparse.Namespace) -> int:
    """Chats while holding ever more memory: a steady climb a leak fit should call."""
    hoard: list[bytearray] = []
    held, cap = 0, int(args.max * 2**20)
    last = time.monotonic()
    for turn in _turns(args.turns):
        now = time.monotonic()
        grow = min(int(args.rate * 2**20 * (now - last)), cap - held)
        last = now
        if grow > 0:
            hoard.append(bytearray(b"\x5a") * grow)  # written, so the pages count in RSS
            held += grow
        try:
            reply, _ = openai_stream(default_model(), _prompt(turn))
            note = _short(reply, 60)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            note = f"request failed: {exc}"
        say("leaky", f"turn {turn}: rss={rss_bytes() / 2**20:.1f} MiB "
                     f"held={held / 2**20:.0f} MiB {note}")
        if args.turns <= 0 or turn < args.turns:
            time.sleep(args.interval)
    return 0


def run_batch(args: argparse.Namespace) -> int:
    """One-shot cron worker: a few non-streamed /api/generate calls, a summary, exit 0."""
    total = 0
    started = time.monotonic()
    for i in range(1, args.calls + 1):
        try:
            result = ollama_generate(args.model, f"Batch item {i}: classify this log line.")
        except (urllib.error.URLError, OSError) as exc:
            say("batch", f"item {i} failed: {exc}")
            return 1
        total += int(result.get("eval_count", 0))
        say("batch", f"item {i}: {_short(result.get('response', ''), 80)}")
    say("batch", f"done: {args.calls} calls, {total} tokens, {time.monotonic() - started:.2f}s")
    return 0


def _sleep_child(orphans: bool) -> None:
    parent = os.getppid()
    while orphans or os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def run_sleeper(args: argparse.Namespace) -> int:
    """Sleeps, optionally with a real process tree of sleeping children."""
    children: list[int] = []
    for _ in range(args.children):
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _sleep_child(args.orphans)
        children.append(pid)

    def reap() -> None:
        for pid in children:
            try:
                os.kill(pid, signal.SIGTERM)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass

    def stop(signum: int, _frame: object) -> None:
        reap()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    say("sleeper", f"pid {os.getpid()} sleeping with children {children}")
    deadline = time.monotonic() + args.seconds if args.seconds > 0 else float("inf")
    while time.monotonic() < deadline:
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    reap()
    return 0


def run_spin(args: argparse.Namespace) -> int:
    """Burns one core: the CPU runaway the governor and breaker must notice."""
    say("spin", f"pid {os.getpid()} spinning")
    start = time.monotonic()
    deadline = start + args.seconds if args.seconds > 0 else float("inf")
    next_report, n = start + 1.0, 0
    while True:
        n += 1
        if n % 100_000 == 0:
            now = time.monotonic()
            if now >= deadline:
                break
            if now >= next_report:
                say("spin", f"{n} iterations")
                next_report = now + 1.0
    say("spin", f"stopped after {n} iterations")
    return 0


# ---------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fleettop demo", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="agent", required=True)

    s = sub.add_parser("chat", help="healthy OpenAI-SSE chat agent (optionally turns loopy)")
    s.add_argument("--interval", type=float, default=3.0)
    s.add_argument("--model", default=default_model())
    s.add_argument("--loop-after", type=int, default=0, help="switch to demo-loop after N turns")
    s.add_argument("--turns", type=int, default=0, help="stop after N turns (0 = forever)")
    s.set_defaults(run=run_chat)

    s = sub.add_parser("retry-loop", help="retries a failing request forever")
    s.add_argument("--delay", type=float, default=0.5)
    s.add_argument("--ok-turns", type=int, default=3, help="working turns before the failure")
    s.add_argument("--turns", type=int, default=0, help="stop after N requests (0 = forever)")
    s.set_defaults(run=run_retry_loop)

    s = sub.add_parser("leaky", help="chat agent whose memory grows steadily")
    s.add_argument("--rate", type=float, default=2.0, help="MiB per second")
    s.add_argument("--max", type=float, default=400.0, help="MiB cap, then holds")
    s.add_argument("--interval", type=float, default=1.0)
    s.add_argument("--turns", type=int, default=0)
    s.set_defaults(run=run_leaky)

    s = sub.add_parser("batch", help="one-shot cron worker")
    s.add_argument("--calls", type=int, default=2)
    s.add_argument("--model", default=default_model())
    s.set_defaults(run=run_batch)

    s = sub.add_parser("sleeper", help="sleeps, optionally with a process tree")
    s.add_argument("--children", type=int, default=0)
    s.add_argument("--seconds", type=float, default=0.0, help="0 = forever")
    s.add_argument("--orphans", action="store_true",
                   help="children outlive their parent (to test tree kills)")
    s.set_defaults(run=run_sleeper)

    s = sub.add_parser("spin", help="burns CPU")
    s.add_argument("--seconds", type=float, default=0.0, help="0 = forever")
    s.set_defaults(run=run_spin)
    return p


def _name_process(name: str) -> None:
    """Its own name in ps, top and the probes' exit events (not every demo agent's
    `fleettop`, which read as if fleettop itself had died)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME: 15 bytes of comm


def main(argv: list[str] | None = None) -> int:
    """`fleettop demo AGENT ...`."""
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)
    args = build_parser().parse_args(argv)
    words = list(sys.argv[1:] if argv is None else argv)
    _name_process(f"demo-{words[0]}" if words else "demo-agent")
    try:
        code: int = args.run(args)
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    raise SystemExit(main())
