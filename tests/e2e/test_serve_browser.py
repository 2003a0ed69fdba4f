"""serve in a REAL headless Chromium (Debian's `chromium`), driven over the DevTools protocol.

The page loads, shows the agents live from /ws, a click on freeze asks for the token once,
and the fleet receives the freeze: the fake fleet records the command, and with the real
supervisor the agent's cgroup reports `frozen 1`. A screenshot lands in test-artifacts/.
No extra Python dependency: the DevTools WebSocket is spoken with aiohttp.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fleettop.supervisor.core import cgroups
from fleettop.supervisor.web.server import MetricsServer
from tests.support.fake_serve_fleet import FakeFleetClient
from tests.support.processes import needs_cgroups

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--window-size=1280,900",
                  "--remote-debugging-port=0", "--remote-allow-origins=*"]
pytestmark = pytest.mark.timeout(240)


def find_chromium() -> tuple[str | None, str]:
    """The chromium binary, installing Debian's package when we may; else why not."""
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found, ""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return None, "no chromium on PATH, and no root+apt-get to install Debian's `chromium`"
    proc = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "chromium"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    found = shutil.which("chromium")
    if found:
        return found, ""
    return None, f"apt-get install chromium failed: {proc.stderr.strip()[-300:]}"


class DevTools:
    """Just enough of the Chrome DevTools protocol: commands by id, events ignored."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.ids = itertools.count(1)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self.ids)
        await self.ws.send_json({"id": msg_id, "method": method, "params": params})
        while True:
            msg = await self.ws.receive_json(timeout=30)
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    async def js(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression,
                                 returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def until(self, expression: str, what: str, within: float = 15.0) -> Any:
        deadline = time.monotonic() + within
        while True:
            try:
                value = await self.js(expression)
            except RuntimeError:  # the page may still be loading
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"page never showed {what}")
            await asyncio.sleep(0.1)

    async def screenshot(self, path: Path) -> None:
        shot = await self.call("Page.captureScreenshot", format="png")
        await asyncio.to_thread(_save, path, base64.b64decode(shot["data"]))


def _save(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


@contextlib.asynccontextmanager
async def chromium_page(url: str) -> AsyncIterator[DevTools]:
    binary, why = find_chromium()
    if binary is None:
        print(f"SKIP: {why}", file=sys.stderr)
        pytest.skip(why)
    with tempfile.TemporaryDirectory(prefix="fleettop-chromium-") as profile:
        proc = await asyncio.create_subprocess_exec(
            binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        try:
            assert proc.stderr is not None
            port = await asyncio.wait_for(_devtools_port(proc.stderr), 60)
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://127.0.0.1:{port}/json/list") as r:
                    targets = await r.json()
                page = next(t for t in targets if t["type"] == "page")
                async with http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                    tools = DevTools(ws)
                    await tools.call("Page.enable")
                    await tools.call("Page.navigate", url=url)
                    yield tools
        finally:
            if proc.returncode is None:
                proc.terminate()
                try:
                    await asyncio.wait_for(proc.wait(), 10)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()


async def _devtools_port(stderr: asyncio.StreamReader) -> int:
    lines = []
    while True:
        line = await stderr.readline()
        if not line:
            raise RuntimeError("chromium exited: " + b"".join(lines[-10:]).decode(errors="replace"))
        lines.append(line)
        match = re.search(rb"DevTools listening on ws://[^:]+:(\d+)/", line)
        if match:
            asyncio.get_running_loop().create_task(_drain(stderr))
            return int(match.group(1))


async def _drain(stream: asyncio.StreamReader) -> None:
    with contextlib.suppress(Exception):
        while await stream.read(65536):
            pass


def row(agent: str) -> str:
    return f'document.querySelector(\'#agents tbody tr[data-agent="{agent}"]\')'


async def freeze_through_the_page(page: DevTools, agent: str, token: str,
                                  frozen: Callable[[], bool], asks: bool = True) -> None:
    """Click freeze on `agent`, give the token if asked, wait for the fleet to freeze it."""
    await page.until(f"{row(agent)}?.querySelector('button[data-action=freeze]') !== null",
                     f"a freeze button for {agent}")
    await page.js(f"{row(agent)}.querySelector('button[data-action=freeze]').click()")
    if asks:
        await page.until("document.querySelector('#token-dialog').classList.contains('open')",
                         "the token dialog")
        await page.js(f"document.querySelector('#token-input').value = {json.dumps(token)};"
                      "document.querySelector('#token-ok').click()")
    deadline = time.monotonic() + 15
    while not frozen():
        assert time.monotonic() < deadline, f"{agent} was never frozen"
        await asyncio.sleep(0.05)
    await page.until(f"{row(agent)}.querySelector('.state').textContent === 'frozen'",
                     f"{agent} shown as frozen")
    assert await page.js("sessionStorage.getItem('fleettop.token')") == token


async def test_page_shows_agents_and_freezes_one_in_chromium() -> None:
    client = FakeFleetClient(6)
    server = MetricsServer(refresh_s=0.3)
    await server.start(client, port=0)
    try:
        async with chromium_page(server.url) as page:
            await page.until("document.querySelector('#conn').textContent === 'live'",
                             "a live connection")
            names = await page.until(
                "(() => { const r = [...document.querySelectorAll('#agents tbody tr')]"
                ".map((tr) => tr.dataset.agent); return r.length === 6 ? r : null })()",
                "six agents")
            assert names == [a["name"] for a in client.agents]
            assert "holder: agent-00" in await page.js("document.querySelector('#lock').innerText")
            assert "Fake GPU 6GB" in await page.js("document.querySelector('#gpus').innerText")

            await freeze_through_the_page(page, "agent-02", server.token, lambda: any(
                c == {"cmd": "freeze", "name": "agent-02", "reason": "from the web view",
                      "source": "web"} for c in client.commands))
            await page.until("document.querySelector('#events').innerText"
                             ".includes('agent.frozen agent-02')", "the freeze event")
            # A second action reuses the token kept in sessionStorage: no dialog this time.
            await page.js(f"{row('agent-02')}.querySelector('button[data-action=resume]')"
                          ".click()")
            deadline = time.monotonic() + 10
            while client.find("agent-02")["state"] != "running":
                assert time.monotonic() < deadline, "resume never arrived"
                await asyncio.sleep(0.05)
            assert not await page.js(
                "document.querySelector('#token-dialog').classList.contains('open')")
            await freeze_through_the_page(page, "agent-05", server.token,
                                          lambda: client.find("agent-05")["state"] == "frozen",
                                          asks=False)
            await page.until("document.querySelector('#events').innerText"
                             ".includes('agent.frozen agent-05')", "the second freeze event")
            await page.screenshot(ARTIFACTS / "serve.png")
        assert (ARTIFACTS / "serve.png").stat().st_size > 10_000
    finally:
        await server.stop()


SLEEPER = [sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)"]


@needs_cgroups
async def test_page_freezes_a_real_agent_and_its_cgroup_shows_frozen(tmp_path: Path) -> None:
    from fleettop.supervisor.config.load import parse_fleet
    from fleettop.supervisor.control.client import InProcessClient
    from fleettop.supervisor.core.agent import AgentState
    from fleettop.supervisor.core.supervisor import Supervisor

    text = json.dumps({"agents": {name: {"cmd": SLEEPER} for name in ("alpha", "beta")}})
    (tmp_path / "fleet.yaml").write_text(text)
    sup = Supervisor(parse_fleet(text, str(tmp_path / "fleet.yaml")))
    await sup.start()
    server = MetricsServer(refresh_s=0.3)
    try:
        deadline = time.monotonic() + 15
        while any(rt.state is not AgentState.RUNNING for rt in sup.agents.values()):
            assert time.monotonic() < deadline, "agents never started"
            await asyncio.sleep(0.05)
        beta = sup.agents["beta"]
        if beta.cgroup is None:
            pytest.skip(f"no cgroup for the agent: {sup.cgroup_reason}")
        await server.start(InProcessClient(sup), port=0)
        async with chromium_page(server.url) as page:
            await page.until(f"{row('alpha')} !== null && {row('beta')} !== null", "both agents")
            await freeze_through_the_page(
                page, "beta", server.token,
                lambda: cgroups.read_events(beta.cgroup)["frozen"] == 1)
            assert sup.agents["alpha"].state is AgentState.RUNNING
            await page.screenshot(ARTIFACTS / "serve-real.png")
    finally:
        await server.stop()
        await sup.shutdown()
