"""serve: /ws stream, /metrics, /api, tokens, readonly, slow consumers (against a fake fleet)."""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from fleettop.supervisor.config.serve import ServeSection, is_loopback
from fleettop.supervisor.web.server import (
    SCHEMA_VERSION,
    MetricsServer,
    banner,
    parse_serve_address,
    start_serving,
)
from fleettop.supervisor.web.snapshot import snapshot_delta
from tests.support.fake_serve_fleet import FakeFleetClient

REFRESH = 0.3


@pytest.fixture
async def served() -> AsyncIterator[tuple[FakeFleetClient, MetricsServer]]:
    client = FakeFleetClient(5)
    server = MetricsServer(refresh_s=REFRESH)
    await server.start(client, port=0)
    try:
        yield client, server
    finally:
        await server.stop()


def apply_delta(snap: dict[str, Any], d: dict[str, Any]) -> None:
    """The client-side algorithm from docs/ws-schema.md."""
    by_name = {a["name"]: a for a in snap.get("agents", [])}
    for name in d.get("agents_removed", []):
        by_name.pop(name, None)
    for name, fields in d.get("agents", {}).items():
        by_name.setdefault(name, {}).update(fields)
    for name, keys in d.get("agents_unset", {}).items():
        for k in keys:
            by_name.get(name, {}).pop(k, None)
    order = d.get("agent_order") or [n for n in (a["name"] for a in snap["agents"])
                                     if n in by_name] + [n for n in by_name if n not in
                                                         {a["name"] for a in snap["agents"]}]
    snap["agents"] = [by_name[n] for n in order]
    snap.update(d.get("set", {}))
    for k in d.get("unset", []):
        snap.pop(k, None)


async def receive_until(ws: aiohttp.ClientWebSocketResponse, pred: Any,
                        within: float) -> dict[str, Any]:
    async def loop() -> dict[str, Any]:
        while True:
            msg = await ws.receive_json()
            if pred(msg):
                return msg
    return await asyncio.wait_for(loop(), within)


# -- /ws --------------------------------------------------------------------------------------

async def test_snapshot_on_connect_then_freeze_event_within_one_refresh(served):
    client, server = served
    async with aiohttp.ClientSession() as http, http.ws_connect(server.url + "ws") as ws:
        first = await ws.receive_json(timeout=5)
        assert first["schema_version"] == SCHEMA_VERSION
        assert first["type"] == "snapshot" and first["reason"] == "connect"
        assert [a["name"] for a in first["state"]["agents"]] == [a["name"] for a in
                                                                client.agents]
        assert first["server"] == {"readonly": False, "refresh_s": REFRESH,
                                   "mutations": ["freeze", "resume"]}
        # A freeze from anywhere (here: the fleet itself) reaches the viewer as an event
        # well within one refresh, and the state change follows in the next delta.
        await client.command({"cmd": "freeze", "name": "agent-02"})
        ev = await receive_until(ws, lambda m: m["type"] == "event", REFRESH)
        assert ev["schema_version"] == SCHEMA_VERSION and ev["seq"] > first["seq"]
        assert ev["event"]["kind"] == "agent.frozen" and ev["event"]["agent"] == "agent-02"
        delta = await receive_until(ws, lambda m: m["type"] == "delta", 2 * REFRESH + 1)
        assert delta["agents"]["agent-02"] == {"state": "frozen"}


async def test_deltas_rebuild_the_fleet_snapshot(served):
    client, server = served
    async with aiohttp.ClientSession() as http, http.ws_connect(server.url + "ws") as ws:
        snap = (await ws.receive_json(timeout=5))["state"]
        seq = 0
        for step in range(1, 4):
            client.tick(step)
            if step == 2:
                client.agents.pop(1)
                client.agents[0].pop("vram_bytes")
                client.lock["queue"] = []
            if step == 3:
                client.agents.insert(0, {"name": "late", "state": "starting"})
                client.governor = {"level": 2, "reason": "swap"}
            delta = await receive_until(ws, lambda m: m["type"] == "delta", 5)
            assert delta["seq"] > seq
            seq = delta["seq"]
            apply_delta(snap, delta)
            expected = await client.snapshot()
            for key in ("agents", "lock", "gpus", "governor", "fleet"):
                assert snap[key] == expected[key], key


async def test_client_can_ask_for_a_fresh_snapshot(served):
    _, server = served
    async with aiohttp.ClientSession() as http, http.ws_connect(server.url + "ws") as ws:
        await ws.receive_json(timeout=5)
        await ws.send_json({"type": "resync"})
        again = await receive_until(ws, lambda m: m["type"] == "snapshot", 5)
        assert again["reason"] == "requested"


def test_snapshot_delta_is_minimal() -> None:
    old = {"version": 1, "agents": [{"name": "a", "x": 1, "y": 2}, {"name": "b", "x": 1}],
           "lock": {"holder": "a"}, "governor": {"level": 0}, "events": [1]}
    assert snapshot_delta(old, copy.deepcopy(old)) == {}
    new = {"version": 1, "agents": [{"name": "c"}, {"name": "a", "x": 5}],
           "lock": {"holder": None}, "events": [1, 2]}
    assert snapshot_delta(old, new) == {
        "agents": {"c": {"name": "c"}, "a": {"x": 5}}, "agents_unset": {"a": ["y"]},
        "agents_removed": ["b"], "agent_order": ["c", "a"],
        "set": {"lock": {"holder": None}}, "unset": ["governor"],
    }


class _StalledPeer:
    """A WebSocket client that completes the handshake and then never reads a byte."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect(("127.0.0.1", port))
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                           "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                           f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
                           ).encode())

    def close(self) -> None:
        self.sock.close()


async def test_slow_consumer_is_bounded_skipped_then_dropped_without_stalling_others():
    client = FakeFleetClient(3)
    server = MetricsServer(refresh_s=REFRESH, queue_max=16, queue_max_bytes=256 * 1024,
                           max_skips=3, send_timeout_s=1.0)
    await server.start(client, port=0)
    stalled = _StalledPeer(server.port)
    try:
        async with aiohttp.ClientSession() as http, http.ws_connect(server.url + "ws") as ws:
            await ws.receive_json(timeout=5)
            for _ in range(100):  # until both sockets are registered
                if server.stats()["clients"] == 2:
                    break
                await asyncio.sleep(0.02)
            assert server.stats()["clients"] == 2

            seen: list[dict[str, Any]] = []

            async def read_fast() -> None:
                while True:
                    msg = await ws.receive_json()
                    seen.append(msg)
                    if msg["type"] == "event" and msg["event"]["kind"] == "test.last":
                        return

            reader = asyncio.create_task(read_fast())
            payload = "x" * 16384  # 400 × 16 KiB: far beyond what the kernel buffers hold
            worst_queue = worst_bytes = worst_buffer = 0
            for i in range(400):  # in bursts of 8, as a fleet's events come
                client.emit("test.flood", "agent-00", "", i=i, payload=payload)
                await asyncio.sleep(0 if i % 8 else 0.005)
                stats = server.stats()
                worst_queue = max([worst_queue, *stats["queued"]])
                worst_bytes = max([worst_bytes, *stats["queued_bytes"]])
                worst_buffer = max([worst_buffer, *stats["write_buffer_bytes"]])
            client.emit("test.last", None)
            await asyncio.wait_for(reader, 10)  # the reading client was never stalled

            assert worst_queue <= 16 and worst_bytes <= 256 * 1024
            assert worst_buffer <= 1024 * 1024  # the transport buffer stays bounded too
            flood = [m["event"]["data"]["i"] for m in seen
                     if m["type"] == "event" and m["event"]["kind"] == "test.flood"]
            assert flood == sorted(flood)

            for _ in range(300):  # skipped ahead, then disconnected after send_timeout_s
                if server.stats()["clients"] == 1:
                    break
                await asyncio.sleep(0.02)
            stats = server.stats()
            assert stats["skips"] >= 1
            assert stats["drops"] == 1 and stats["clients"] == 1
            assert stats["queued"] == [0] or stats["queued"][0] <= 16
            # ... and the survivor still gets live updates.
            await client.command({"cmd": "freeze", "name": "agent-01"})
            ev = await receive_until(ws, lambda m: m["type"] == "event", 5)
            assert ev["event"]["kind"] == "agent.frozen"
    finally:
        stalled.close()
        await server.stop()


# -- /metrics -------------------------------------------------------------------------------

async def test_metrics_parse_with_prometheus_parser(served):
    client, server = served
    client.emit("breaker.trip", "agent-01", "token loop", trip_kind="token_loop")
    client.emit("breaker.trip", "agent-01", "token loop", trip_kind="token_loop")
    client.emit("breaker.trip", "agent-03", "budget", trip_kind="budget")
    await asyncio.sleep(0.05)
    async with aiohttp.ClientSession() as http, http.get(server.url + "metrics") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await r.text()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in fams.values() for s in f.samples}

    assert fams["fleettop_agent_rss_bytes"].type == "gauge"
    for a in client.agents:
        assert samples[("fleettop_agent_rss_bytes", (("agent", a["name"]),))] == a["rss_bytes"]
        assert samples[("fleettop_agent_restarts_total", (("agent", a["name"]),))] == a["restarts"]
        assert samples[("fleettop_agent_state", (("agent", a["name"]), ("state", a["state"])))] == 1
    assert fams["fleettop_agent_restarts"].type == "counter"
    assert samples[("fleettop_agent_cpu_ratio", (("agent", "agent-04"),))] == pytest.approx(0.4)
    assert samples[("fleettop_agent_vram_bytes", (("agent", "agent-01"),))] == 256 * 1024**2
    assert samples[("fleettop_agent_tokens_total",
                    (("agent", "agent-02"), ("direction", "out")))] == 80
    assert samples[("fleettop_agent_cost_usd_total", (("agent", "agent-03"),))] == 0.003
    assert samples[("fleettop_agent_trips_total",
                    (("agent", "agent-01"), ("kind", "token_loop")))] == 2
    assert samples[("fleettop_agent_trips_total",
                    (("agent", "agent-03"), ("kind", "budget")))] == 1
    assert samples[("fleettop_gpu_lock_queue_length", ())] == 2
    assert samples[("fleettop_gpu_lock_wait_seconds", (("agent", "agent-02"),))] == 3.0
    assert samples[("fleettop_gpu_lock_max_wait_seconds", ())] == 3.0
    gpu = (("gpu", "0"), ("name", "Fake GPU 6GB"))
    assert samples[("fleettop_gpu_memory_used_bytes", gpu)] == 2 * 1024**3
    assert samples[("fleettop_gpu_memory_total_bytes", gpu)] == 6 * 1024**3
    assert samples[("fleettop_governor_level", ())] == 1
    assert samples[("fleettop_agents", (("state", "running"),))] == sum(
        a["state"] == "running" for a in client.agents)
    for name, fam in fams.items():  # Prometheus conventions
        assert name.startswith("fleettop_")
        if fam.type == "counter":
            assert all(s.name.endswith("_total") for s in fam.samples)


# -- /api -----------------------------------------------------------------------------------

async def test_mutations_need_the_token(served):
    client, server = served
    url = server.url + "api/agents/agent-02/freeze"
    async with aiohttp.ClientSession() as http:
        async with http.post(url) as r:
            assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        async with http.post(url, headers={"Authorization": "Bearer nope"}) as r:
            assert r.status == 401
        assert client.commands == []
        auth = {"Authorization": f"Bearer {server.token}"}
        async with http.post(url, headers=auth, json={"reason": "looks stuck"}) as r:
            assert r.status == 200 and (await r.json())["state"] == "frozen"
        assert client.commands == [{"cmd": "freeze", "name": "agent-02",
                                    "reason": "looks stuck", "source": "web"}]
        async with http.post(server.url + "api/agents/agent-02/resume", headers=auth) as r:
            assert r.status == 200
        async with http.post(server.url + "api/agents/ghost/freeze", headers=auth) as r:
            assert r.status == 404
        async with http.get(server.url + "api/state") as r:
            body = await r.json()
            assert body["schema_version"] == SCHEMA_VERSION
            assert body["state"]["agents"][2]["state"] == "running"


@pytest.mark.parametrize("how", ["server", "client"])
async def test_readonly_mode_has_no_mutations(how: str):
    client = FakeFleetClient(2, readonly=how == "client")
    server = MetricsServer(refresh_s=REFRESH)
    await server.start(client, port=0, readonly=how == "server")
    try:
        auth = {"Authorization": f"Bearer {server.token}"}
        async with aiohttp.ClientSession() as http:
            for action in ("freeze", "resume"):
                async with http.post(f"{server.url}api/agents/agent-00/{action}",
                                     headers=auth) as r:
                    assert r.status in (404, 405)
            async with http.ws_connect(server.url + "ws") as ws:
                first = await ws.receive_json(timeout=5)
                assert first["server"]["readonly"] is True
                assert first["server"]["mutations"] == []
            async with http.get(server.url + "metrics") as r:
                assert r.status == 200
        assert client.commands == []
    finally:
        await server.stop()


async def test_foreign_host_and_cross_origin_are_refused(served):
    _, server = served
    async with aiohttp.ClientSession() as http:
        async with http.get(server.url + "api/state", headers={"Host": "evil.example"}) as r:
            assert r.status == 421  # DNS rebinding: a foreign name for our loopback socket
        local = server.url.replace("127.0.0.1", "localhost")
        async with http.get(local + "api/state") as r:
            assert r.status == 200
        with pytest.raises(aiohttp.WSServerHandshakeError) as err:
            await http.ws_connect(server.url + "ws", headers={"Origin": "http://evil.example"})
        assert err.value.status == 403
        origin = server.url.rstrip("/")
        async with http.ws_connect(server.url + "ws", headers={"Origin": origin}) as ws:
            assert (await ws.receive_json(timeout=5))["type"] == "snapshot"


async def test_the_token_is_never_served(served):
    client, server = served
    original = client.snapshot

    async def leaky() -> dict[str, Any]:  # a status reply used as a snapshot
        return {**(await original()), "serve_token": server.token}

    client.snapshot = leaky  # type: ignore[method-assign]
    async with aiohttp.ClientSession() as http:
        for path in ("api/state", "metrics"):
            async with http.get(server.url + path) as r:
                assert server.token not in await r.text()
        await asyncio.sleep(REFRESH)  # so the connect takes a fresh (leaky) snapshot
        calls = client.snapshot_calls
        async with http.ws_connect(server.url + "ws") as ws:
            msg = await ws.receive(timeout=5)
            assert server.token not in msg.data
        assert client.snapshot_calls > calls


async def test_page_is_self_contained(served):
    _, server = served
    async with aiohttp.ClientSession() as http, http.get(server.url) as r:
        assert r.status == 200 and r.content_type == "text/html"
        html = await r.text()
    assert "<table id=\"agents\"" in html and "sessionStorage" in html
    for external in ("src=\"http", "href=\"http", "@import", "url(http", "//cdn"):
        assert external not in html


async def test_remote_bind_needs_explicit_consent(caplog):
    client = FakeFleetClient(1)
    server = MetricsServer()
    with pytest.raises(ValueError, match="allow_remote"):
        await server.start(client, host="0.0.0.0", port=0)
    with caplog.at_level(logging.WARNING, logger="fleettop.serve"):
        await server.start(client, host="0.0.0.0", port=0, allow_remote=True)
    try:
        assert any("reachable from other machines" in r.message for r in caplog.records)
    finally:
        await server.stop()


# -- config and CLI pieces ------------------------------------------------------------------

def test_serve_section() -> None:
    s = ServeSection()
    assert (s.enabled, s.host, s.port, s.readonly, s.allow_remote, s.refresh) == (
        False, "127.0.0.1", 8765, False, False, 1.0)
    assert ServeSection(refresh="500ms").refresh == 0.5
    assert ServeSection(host="0.0.0.0", allow_remote=True).host == "0.0.0.0"
    for bad in ({"host": "0.0.0.0"}, {"prot": 1}, {"port": 70000}, {"refresh": "1y"}):
        with pytest.raises(ValidationError):
            ServeSection(**bad)


async def test_start_serving_merges_file_and_flag() -> None:
    client = FakeFleetClient(1)
    assert await start_serving(client, ServeSection(), None) is None  # nobody asked
    server = await start_serving(client, ServeSection(port=0, readonly=True), "")
    assert server is not None
    try:
        assert server.readonly and server.host == "127.0.0.1" and server.port > 0
        assert banner(server) == f"serve: {server.url}  (read-only)"
    finally:
        await server.stop()
    server = await start_serving(client, ServeSection(enabled=True, port=0, refresh="2s"))
    assert server is not None
    try:
        assert server.refresh_s == 2.0 and not server.readonly
        assert server.token in banner(server)
    finally:
        await server.stop()
    with pytest.raises(ValueError, match="allow_remote"):
        await start_serving(client, ServeSection(), "0.0.0.0:0")


def test_parse_serve_address() -> None:
    assert parse_serve_address(None) == ("127.0.0.1", 8765)
    assert parse_serve_address("9000") == ("127.0.0.1", 9000)
    assert parse_serve_address(":9000") == ("127.0.0.1", 9000)
    assert parse_serve_address("0.0.0.0:80") == ("0.0.0.0", 80)
    assert parse_serve_address("[::1]:9000") == ("::1", 9000)
    assert parse_serve_address("localhost") == ("localhost", 8765)
    with pytest.raises(ValueError):
        parse_serve_address("host:99999")
    assert is_loopback("127.0.0.2") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.com")


def test_serve_never_imports_textual() -> None:
    code = ("import sys, fleettop.supervisor.web.server, fleettop.supervisor.config.serve; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('textual'))))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], check=True,
                         capture_output=True, text=True).stdout
    assert json.loads(out) == []


# -- against the real supervisor ------------------------------------------------------------

async def test_real_supervisor_stream_metrics_and_freeze(tmp_path: Path) -> None:
    from fleettop.supervisor.config.load import parse_fleet
    from fleettop.supervisor.control.client import InProcessClient
    from fleettop.supervisor.core.agent import AgentState
    from fleettop.supervisor.core.supervisor import Supervisor

    sleeper = [sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)"]
    text = json.dumps({"agents": {"alpha": {"cmd": sleeper}, "beta": {"cmd": sleeper}}})
    (tmp_path / "fleet.yaml").write_text(text)
    sup = Supervisor(parse_fleet(text, str(tmp_path / "fleet.yaml")), use_cgroups=False)
    await sup.start()
    server = MetricsServer(refresh_s=REFRESH)
    try:
        for _ in range(300):
            if all(rt.state is AgentState.RUNNING for rt in sup.agents.values()):
                break
            await asyncio.sleep(0.05)
        await server.start(InProcessClient(sup), port=0)
        auth = {"Authorization": f"Bearer {server.token}"}
        async with aiohttp.ClientSession() as http, http.ws_connect(server.url + "ws") as ws:
            first = await ws.receive_json(timeout=5)
            assert {a["name"] for a in first["state"]["agents"]} == {"alpha", "beta"}
            async with http.post(server.url + "api/agents/beta/freeze", headers=auth) as r:
                assert r.status == 200, await r.text()
            ev = await receive_until(ws, lambda m: m["type"] == "event"
                                     and m["event"]["kind"] == "agent.frozen", REFRESH + 1)
            assert ev["event"]["agent"] == "beta"
            delta = await receive_until(ws, lambda m: m["type"] == "delta"
                                        and "beta" in m.get("agents", {}), 2 * REFRESH + 1)
            assert delta["agents"]["beta"]["state"] == "frozen"
            async with http.get(server.url + "metrics") as r:
                fams = {f.name: f for f in text_string_to_metric_families(await r.text())}
            state = {(s.labels["agent"], s.labels["state"]): s.value
                     for s in fams["fleettop_agent_state"].samples}
            assert state[("beta", "frozen")] == 1 and state[("alpha", "running")] == 1
    finally:
        await server.stop()
        await sup.shutdown()
