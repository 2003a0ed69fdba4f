"""Live metrics over the network: a WebSocket stream, a Prometheus endpoint and a local page.

`MetricsServer` is a viewer: it reaches the fleet only through the FleetClient interface
(snapshot / command / events / readonly), exactly like the TUI and `ctl`.

Routes (read-only unless noted):
- `/ws`           versioned JSON stream (docs/ws-schema.md): a full snapshot on connect, then
                  events as they happen and deltas every `refresh_s`.
- `/metrics`      Prometheus text exposition, built from one snapshot per scrape.
- `/api/state`    the snapshot as JSON.
- `/`             the self-contained page (serve_page.html).
- `POST /api/agents/{name}/freeze|resume`  mutating; `Authorization: Bearer TOKEN`.
                  Not registered at all in readonly mode.

Caveats:
- Slow consumers never grow memory or stall anyone: each WebSocket has its own bounded queue
  (messages and bytes) drained by its own writer task; broadcasting only appends. On overflow
  the queue is thrown away and the client is skipped ahead to a fresh snapshot; a client that
  overflows `max_skips` times without catching up, or blocks one send for `send_timeout_s`,
  is disconnected (its transport aborted, so nothing stays buffered for it).
- Every message is serialised once and shared by all clients.
- Bound to loopback, requests must name a loopback Host (a DNS-rebinding page cannot read the
  fleet); a browser Origin on `/ws` and on mutations must match the Host (no cross-site
  WebSocket hijacking). Any other bind address needs `allow_remote=True` and logs a warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aiohttp import WSMsgType, web

from fleettop.supervisor.config.serve import DEFAULT_HOST, DEFAULT_PORT, ServeSection, is_loopback
from fleettop.supervisor.control.api import FleetClient
from fleettop.supervisor.core.capability import Capability
from fleettop.supervisor.web.metrics import render_metrics
from fleettop.supervisor.web.snapshot import dumps, public_view, snapshot_delta

log = logging.getLogger("fleettop.serve")

SCHEMA_VERSION = 1
"""Version of the /ws and /api/state JSON (docs/ws-schema.md). Bump on incompatible change."""
SNAPSHOT_EVENTS_MAX_BYTES = 256 * 1024
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The classic text format: every Prometheus 2.x and 3.x scraper reads it."""
PAGE_PATH = Path(__file__).with_name("page.html")


def parse_serve_address(text: str | None, default_host: str = DEFAULT_HOST,
                        default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """`--serve` argument → (host, port): `HOST:PORT`, `:PORT`, `PORT`, `HOST`, `[::1]:PORT`."""
    text = (text or "").strip()
    if not text:
        return default_host, default_port
    if text.isdigit():
        return default_host, _port(text)
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        return host, _port(rest[1:]) if rest.startswith(":") else default_port
    if text.count(":") == 1:
        host, _, port = text.partition(":")
        return host or default_host, _port(port)
    return text, default_port


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise ValueError(f"port out of range: {port}")
    return port


# -- the server ----------------------------------------------------------------------------

@dataclass(eq=False)
class _Conn:
    ws: web.WebSocketResponse
    request: web.Request
    queue: deque[tuple[int, str]] = field(default_factory=deque)
    queued_bytes: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    resync: bool = True
    reason: str = "connect"
    skipped_messages: int = 0
    skips: int = 0
    floor: int = 0
    sent: int = 0
    task: asyncio.Task[None] | None = None


class MetricsServer:
    """HTTP + WebSocket server over a FleetClient. `start()` it, `stop()` it."""

    def __init__(self, *, refresh_s: float = 1.0, queue_max: int = 256,
                 queue_max_bytes: int = 4 * 1024 * 1024, max_skips: int = 3,
                 send_timeout_s: float = 10.0) -> None:
        self.refresh_s = refresh_s
        self.queue_max = queue_max
        self.queue_max_bytes = queue_max_bytes
        self.max_skips = max_skips
        self.send_timeout_s = send_timeout_s
        self.client: FleetClient | None = None
        self.host = DEFAULT_HOST
        self.port = 0
        self.token = ""
        self.readonly = False
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._conns: set[_Conn] = set()
        self._poll_lock = asyncio.Lock()
        self._base: dict[str, Any] = {}
        self._base_at = 0.0
        self._state_text: tuple[int, str] | None = None
        self._recent: deque[tuple[int, dict[str, Any], int]] = deque(maxlen=200)
        self._seq = 0
        self._trips: Counter[tuple[str, str]] = Counter()
        self._event_kinds: Counter[str] = Counter()
        self._sent = self._skips = self._drops = 0
        self._page = ""

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, client: FleetClient, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                    token: str | None = None, readonly: bool = False,
                    allow_remote: bool = False) -> None:
        if not is_loopback(host):
            if not allow_remote:
                raise ValueError(f"refusing to serve on {host}: not a loopback address; "
                                 "set serve.allow_remote: true to expose the fleet")
            log.warning("serving fleet metrics on %s:%s, reachable from other machines; "
                        "anyone who can reach it sees the fleet (mutations need the token)",
                        host, port)
        self.client = client
        self.host = host
        self.token = token or secrets.token_urlsafe(24)
        self.readonly = readonly or bool(getattr(client, "readonly", False))
        self._page = PAGE_PATH.read_text(encoding="utf-8")
        await self._refresh()
        runner = web.AppRunner(self._make_app(), access_log=None, shutdown_timeout=2.0)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        self._tasks = [asyncio.create_task(self._pump_events(), name="serve-events"),
                       asyncio.create_task(self._poll(), name="serve-poll")]
        log.info("serving on %s%s", self.url, " (read-only)" if self.readonly else "")

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        await asyncio.gather(*(self._close(conn) for conn in list(self._conns)))
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def stats(self) -> dict[str, Any]:
        """Counters for tests, bench and `ctl status`."""
        return {
            "url": self.url, "readonly": self.readonly, "clients": len(self._conns),
            "queued": [len(c.queue) for c in self._conns],
            "queued_bytes": [c.queued_bytes for c in self._conns],
            "write_buffer_bytes": [_write_buffer(c) for c in self._conns],
            "sent": self._sent, "skips": self._skips, "drops": self._drops, "seq": self._seq,
            "queue_max": self.queue_max, "queue_max_bytes": self.queue_max_bytes,
        }

    # -- fleet side --------------------------------------------------------------------------
    async def _refresh(self) -> None:
        """Take a snapshot; broadcast what changed. Never overlaps itself."""
        assert self.client is not None
        async with self._poll_lock:
            # A private copy, normalised as clients will see it: a supervisor may hand out
            # live dicts that it mutates in place, which would make every diff empty.
            snap = json.loads(dumps(public_view(await self.client.snapshot())))
            if not self._base:
                for ev in (snap.get("events") or [])[-200:]:
                    self._seq += 1
                    self._recent.append((self._seq, ev, len(dumps(ev))))
            snap.pop("events", None)
            delta = snapshot_delta(self._base, snap) if self._base else {}
            self._base, self._base_at = snap, time.monotonic()
            if delta:
                self._broadcast({"type": "delta", "ts": time.time(), **delta})

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            if not self._conns:
                continue  # nobody to send deltas to; a new viewer refreshes on connect
            try:
                await self._refresh()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a failing snapshot must not end the stream
                log.warning("serve: snapshot failed: %s", exc)

    async def _pump_events(self) -> None:
        assert self.client is not None
        while True:
            try:
                async for event in self.client.events():
                    self._on_event(event)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("serve: event stream failed: %s", exc)
            await asyncio.sleep(1.0)

    def _on_event(self, event: dict[str, Any]) -> None:
        kind = str(event.get("kind", ""))
        self._event_kinds[kind] += 1
        if kind == "breaker.trip" and event.get("agent"):
            data = event.get("data") or {}
            trip_kind = (data.get("trip_kind") or data.get("kind")
                         or (data.get("trip") or {}).get("kind") or "unknown")
            self._trips[(str(event["agent"]), str(trip_kind))] += 1
        seq, size = self._broadcast({"type": "event", "event": event})
        self._recent.append((seq, event, size))

    # -- fan-out -----------------------------------------------------------------------------
    def _broadcast(self, msg: dict[str, Any]) -> tuple[int, int]:
        """Queue `msg` for every client; returns its seq and its size in bytes."""
        self._seq += 1
        text = dumps({"schema_version": SCHEMA_VERSION, "seq": self._seq, **msg})
        size = len(text)
        for conn in list(self._conns):
            if conn.resync:
                continue  # it will get a fresh snapshot that already includes this
            if (len(conn.queue) >= self.queue_max
                    or conn.queued_bytes + size > self.queue_max_bytes):
                self._skip(conn)
                continue
            conn.queue.append((self._seq, text))
            conn.queued_bytes += size
            conn.wake.set()
        return self._seq, size

    def _recent_events(self) -> list[dict[str, Any]]:
        """The last events, newest kept, within SNAPSHOT_EVENTS_MAX_BYTES.

        Without the byte cap a burst of fat events (trip evidence) makes every resync
        snapshot huge, and a client resyncing slowly falls behind again while it is sent.
        """
        kept: list[dict[str, Any]] = []
        total = 0
        for _, event, size in reversed(self._recent):
            total += size
            if total > SNAPSHOT_EVENTS_MAX_BYTES:
                break
            kept.append(event)
        kept.reverse()
        return kept

    def _skip(self, conn: _Conn) -> None:
        conn.skipped_messages += len(conn.queue) + 1
        conn.queue.clear()
        conn.queued_bytes = 0
        conn.skips += 1
        self._skips += 1
        if conn.skips > self.max_skips:
            self._drop(conn, "too slow: skipped ahead too often")
            return
        conn.resync, conn.reason = True, "skipped"
        conn.wake.set()

    def _drop(self, conn: _Conn, why: str) -> None:
        if conn not in self._conns:
            return
        self._conns.discard(conn)
        self._drops += 1
        conn.queue.clear()
        conn.queued_bytes = 0
        log.info("serve: dropping WebSocket client %s: %s", conn.request.remote, why)
        transport = conn.request.transport
        if transport is not None:
            transport.abort()  # discard what is buffered for it, now
        if conn.task is not None and conn.task is not asyncio.current_task():
            conn.task.cancel()

    def _snapshot_message(self, conn: _Conn) -> tuple[int, str]:
        if self._state_text is None or self._state_text[0] != self._seq:
            state = dict(self._base)
            state["events"] = self._recent_events()
            self._state_text = (self._seq, dumps(state))
        seq, state_text = self._state_text
        head = dumps({
            "schema_version": SCHEMA_VERSION, "type": "snapshot", "seq": seq, "ts": time.time(),
            "reason": conn.reason, "skipped_messages": conn.skipped_messages,
            "server": {"readonly": self.readonly, "refresh_s": self.refresh_s,
                       "mutations": [] if self.readonly else ["freeze", "resume"]},
        })
        return seq, head[:-1] + ',"state":' + state_text + "}"

    async def _writer(self, conn: _Conn) -> None:
        try:
            while conn in self._conns:
                if conn.resync:
                    conn.resync = False
                    seq, text = self._snapshot_message(conn)
                    conn.floor = seq
                    conn.skipped_messages = 0
                    await self._send(conn, text)
                    continue
                if not conn.queue:
                    conn.skips = 0  # caught up
                    conn.wake.clear()
                    await conn.wake.wait()
                    continue
                seq, text = conn.queue.popleft()
                conn.queued_bytes -= len(text)
                if seq > conn.floor:
                    await self._send(conn, text)
        except (ConnectionError, RuntimeError) as exc:
            self._drop(conn, f"send failed: {exc}")

    async def _send(self, conn: _Conn, text: str) -> None:
        try:
            await asyncio.wait_for(conn.ws.send_str(text), self.send_timeout_s)
        except TimeoutError:
            self._drop(conn, f"a send blocked for {self.send_timeout_s:g}s")
            return
        conn.sent += 1
        self._sent += 1

    async def _close(self, conn: _Conn) -> None:
        self._conns.discard(conn)
        if conn.task is not None:
            conn.task.cancel()
        try:
            await asyncio.wait_for(conn.ws.close(code=1001, message=b"server stopping"), 1.0)
        except (TimeoutError, ConnectionError, RuntimeError):
            if conn.request.transport is not None:
                conn.request.transport.abort()

    # -- HTTP --------------------------------------------------------------------------------
    def _make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard], client_max_size=64 * 1024)
        app.router.add_get("/", self._page_handler)
        app.router.add_get("/ws", self._ws_handler)
        app.router.add_get("/metrics", self._metrics_handler)
        app.router.add_get("/api/state", self._state_handler)
        if not self.readonly:
            app.router.add_post("/api/agents/{name}/freeze", self._mutate_handler)
            app.router.add_post("/api/agents/{name}/resume", self._mutate_handler)
        return app

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if is_loopback(self.host):
            host = urlsplit(f"//{request.host}").hostname or ""
            if not is_loopback(host):
                return web.json_response({"error": "this server answers to localhost only"},
                                         status=421)
        origin = request.headers.get("Origin")
        if (origin and (request.path == "/ws" or request.method != "GET")
                and urlsplit(origin).netloc.lower() != request.host.lower()):
            return web.json_response({"error": "cross-origin request refused"},
                                         status=403)
        return await handler(request)

    async def _page_handler(self, request: web.Request) -> web.Response:
        return web.Response(text=self._page, content_type="text/html", headers={
            "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
            "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; "
                                       "style-src 'unsafe-inline'; img-src data:; "
                                       "frame-ancestors 'none'",
        })

    async def _state_handler(self, request: web.Request) -> web.Response:
        assert self.client is not None
        snap = public_view(await self.client.snapshot())
        return web.Response(text=dumps({"schema_version": SCHEMA_VERSION, "state": snap}),
                            content_type="application/json",
                            headers={"Cache-Control": "no-store"})

    async def _metrics_handler(self, request: web.Request) -> web.Response:
        assert self.client is not None
        snap = await self.client.snapshot()
        body = render_metrics(snap, self._trips, self._event_kinds, {
            "ws_clients": len(self._conns), "ws_messages_sent": self._sent,
            "ws_skips": self._skips, "ws_drops": self._drops})
        return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def _mutate_handler(self, request: web.Request) -> web.Response:
        assert self.client is not None
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                  self.token.encode()):
            return web.json_response({"ok": False, "error": "missing or wrong token"},
                                     status=401, headers={"WWW-Authenticate": "Bearer"})
        action = request.path.rsplit("/", 1)[-1]
        reason = "from the web view"
        body: dict[str, Any] = {}
        if request.can_read_body:
            with contextlib.suppress(ValueError):
                body = await request.json()
                if isinstance(body, dict) and isinstance(body.get("reason"), str):
                    reason = body["reason"][:200]
        req = {"cmd": action, "name": request.match_info["name"], "reason": reason,
               "source": "web"}
        if action == "resume" and isinstance(body, dict) and isinstance(body.get("breaker"), str):
            # {"breaker": "warn", "for": "10m"}: resume with a lower breaker for a while
            req.update(breaker=body["breaker"], **{"for": str(body.get("for") or "10m")})
        reply = await self.client.command(req)
        if reply.get("ok"):
            return web.json_response(reply)
        error = str(reply.get("error", ""))
        status = 404 if any(w in error for w in ("unknown", "no agent", "no such")) else 409
        return web.json_response(reply, status=status)

    async def _ws_handler(self, request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(heartbeat=20.0, max_msg_size=64 * 1024)
        await ws.prepare(request)
        conn = _Conn(ws=ws, request=request)
        # A fresh base so the new client starts current; registration happens with no await
        # after it, so the deltas it then receives start exactly at its snapshot.
        if time.monotonic() - self._base_at > min(0.25, self.refresh_s):
            with contextlib.suppress(Exception):
                await self._refresh()
        self._conns.add(conn)
        conn.task = asyncio.create_task(self._writer(conn), name="serve-ws-writer")
        try:
            async for msg in ws:
                if msg.type == WSMsgType.TEXT and _wants_resync(msg.data):
                    conn.resync, conn.reason = True, "requested"
                    conn.wake.set()
        finally:
            if conn in self._conns:
                self._conns.discard(conn)
            conn.task.cancel()
        return ws


class WebView(Capability):
    """The running server as a capability of the supervisor: its row, its stop."""

    name = "serve"

    def __init__(self, server: MetricsServer) -> None:
        self.server = server

    def component(self) -> dict[str, Any]:
        return {"state": "running", "detail": self.server.url}

    async def stop(self) -> None:
        await self.server.stop()


async def start_serving(client: FleetClient, section: ServeSection | None = None,
                        address: str | None = None, *, readonly: bool = False,
                        allow_remote: bool = False) -> MetricsServer | None:
    """The fleet file's `serve:` merged with `--serve [HOST:PORT]`; None when neither asks.

    `address` is None when `--serve` was not given and "" when it was given bare (then the
    file's host and port apply). `readonly`/`allow_remote` add to the file's settings.
    Raises ValueError for a non-loopback host without allow_remote, OSError if the port is
    taken.
    """
    section = section or ServeSection()
    if address is None and not section.enabled:
        return None
    host, port = parse_serve_address(address, section.host, section.port)
    server = MetricsServer(refresh_s=section.refresh)
    await server.start(client, host=host, port=port, readonly=readonly or section.readonly,
                       allow_remote=allow_remote or section.allow_remote)
    return server


def banner(server: MetricsServer) -> str:
    """The line to print at start. Holds the token: print it to the terminal/journal only,
    never put it in the snapshot (that is served to everyone who can read)."""
    if server.readonly:
        return f"serve: {server.url}  (read-only)"
    return f"serve: {server.url}  token: {server.token}"


def _write_buffer(conn: _Conn) -> int:
    transport = conn.request.transport
    return transport.get_write_buffer_size() if transport is not None else 0


def _wants_resync(text: str) -> bool:
    try:
        msg = json.loads(text)
    except ValueError:
        return False
    return isinstance(msg, dict) and msg.get("type") == "resync"
