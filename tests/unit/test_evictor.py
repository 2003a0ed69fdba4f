"""VRAM watchdog against the mock LLM's Ollama API (/api/ps, keep_alive: 0) and a fake GPU
whose used memory is the mock's loaded models: it drops only once the unload happened."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from datetime import time as dtime
from pathlib import Path

import pytest

from fleettop.supervisor.config.gpu import GpuSection, ThresholdWindow
from fleettop.supervisor.gpu.evictor import (
    ActivityTracker,
    Evictor,
    GpuMemory,
    OllamaBackend,
    Use,
    model_key,
    read_activity,
    threshold_at,
)

GIB = 1024**3
BASE = 300 * 1024**2


@pytest.fixture(scope="module")
def mock_url() -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, "-m", "fleettop.supervisor.demo.mock_llm",
                             "--port", "0"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "listening on" in line, line
    yield line.rsplit(" ", 1)[1].strip()
    proc.terminate()
    proc.wait(10)


def _post(url: str, body: dict[str, object]) -> None:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=10).read()


def _loaded(url: str) -> list[str]:
    with urllib.request.urlopen(url + "/api/ps", timeout=10) as r:
        return sorted(m["name"].split(":")[0] for m in json.load(r)["models"])


@pytest.fixture
def loaded(mock_url: str) -> str:
    for name in _loaded(mock_url):
        _post(mock_url + "/api/generate", {"model": name, "keep_alive": 0})
    for name in ("demo-chat", "demo-slow"):  # 2 GiB + 4 GiB of VRAM
        _post(mock_url + "/api/generate", {"model": name, "keep_alive": -1})
    assert _loaded(mock_url) == ["demo-chat", "demo-slow"]
    return mock_url


class FakeGpu:
    """8 GiB card; used = a base + what the mock says is loaded (its size_vram)."""

    def __init__(self, url: str, total: int = 8 * GIB, stuck: bool = False) -> None:
        self.url, self.total, self.stuck = url, total, stuck
        self.frozen: GpuMemory | None = None

    def read_memory(self) -> GpuMemory | None:
        if self.stuck and self.frozen is not None:
            return self.frozen
        with urllib.request.urlopen(self.url + "/api/ps", timeout=10) as r:
            used = BASE + sum(m["size_vram"] for m in json.load(r)["models"])
        mem = GpuMemory(self.total, used)
        if self.stuck:
            self.frozen = mem
        return mem


class Events(list[tuple[str, str, dict[str, object]]]):
    def __call__(self, kind: str, agent: str | None = None, reason: str = "",
                 **data: object) -> None:
        self.append((kind, reason, data))

    def kinds(self) -> list[str]:
        return [k for k, _, _ in self]


def _evictor(url: str, events: Events, **kw: object) -> Evictor:
    defaults: dict[str, object] = dict(emit=events, idle_after=0.0, confirm_timeout=2.0,
                                       confirm_poll=0.05)
    defaults.update(kw)
    gpu = defaults.pop("gpu", FakeGpu(url))
    return Evictor(gpu, [OllamaBackend(url)], **defaults)  # type: ignore[arg-type]


async def test_evicts_idle_models_until_under_threshold(loaded: str) -> None:
    events = Events()
    result = await _evictor(loaded, events, threshold=0.5).tick()
    # 6.3 GiB of 8 is over 50%; dropping the 4 GiB model alone gets under it.
    assert [e.model.name for e in result.evictions] == ["demo-slow:latest"]
    assert result.evictions[0].reclaimed == 4 * GIB
    assert _loaded(loaded) == ["demo-chat"]
    kind, reason, data = events[0]
    assert kind == "gpu.evicted" and "over the 50% threshold" in reason
    assert data["size_vram"] == 4 * GIB and data["used_before"] == BASE + 6 * GIB


async def test_under_threshold_nothing_happens(loaded: str) -> None:
    events = Events()
    result = await _evictor(loaded, events, threshold=0.85).tick()
    assert result.evictions == [] and events == []
    assert _loaded(loaded) == ["demo-chat", "demo-slow"]


async def test_never_evicts_a_model_with_a_request_in_flight(loaded: str) -> None:
    busy = {model_key(loaded, "demo-slow"): Use(in_flight=1)}
    events = Events()
    result = await _evictor(loaded, events, threshold=0.2, activity=lambda: busy).tick()
    assert [e.model.name for e in result.evictions] == ["demo-chat:latest"]
    assert "demo-slow:latest: request in flight" in result.skipped
    assert _loaded(loaded) == ["demo-slow"]


async def test_recently_used_models_stay(loaded: str) -> None:
    now = 1_000_000.0
    uses = {model_key(loaded, "demo-slow"): Use(0, now - 30, now - 10)}
    ev = _evictor(loaded, Events(), threshold=0.2, idle_after=60.0, activity=lambda: uses,
                  clock=lambda: now)
    ev.first_seen[model_key(loaded, "demo-chat")] = now - 600
    result = await ev.tick()
    assert [e.model.name for e in result.evictions] == ["demo-chat:latest"]
    assert _loaded(loaded) == ["demo-slow"]


async def test_night_threshold_with_injected_clock(loaded: str) -> None:
    section = GpuSection.model_validate({"threshold": "85%", "evict_idle_after": "0s",
                                         "schedule": [{"from": "22:00", "to": "06:00",
                                                       "threshold": "50%"}]})
    clock = {"now": dtime(14, 0)}
    events = Events()
    ev = Evictor(FakeGpu(loaded), [OllamaBackend(loaded)], emit=events,
                 threshold=section.threshold, schedule=section.schedule,
                 idle_after=section.evict_idle_after, confirm_poll=0.05,
                 local_now=lambda: clock["now"])
    assert (await ev.tick()).evictions == []  # 79% by day is fine
    clock["now"] = dtime(23, 30)
    result = await ev.tick()
    assert result.threshold == 0.5 and len(result.evictions) == 1
    assert _loaded(loaded) == ["demo-chat"]


async def test_memory_that_does_not_come_back_is_flagged(loaded: str) -> None:
    events = Events()
    ev = _evictor(loaded, events, threshold=0.5, gpu=FakeGpu(loaded, stuck=True),
                  confirm_timeout=0.3)
    result = await ev.tick()
    assert result.evictions[0].reclaimed == 0
    assert events.kinds()[:2] == ["gpu.evicted", "gpu.unreclaimed"]
    # Nothing came back, so it kept going down the list.
    assert _loaded(loaded) == []


async def test_governor_style_evict_all_skips_in_flight(loaded: str) -> None:
    busy = {model_key(loaded, "demo-chat"): Use(in_flight=2)}
    ev = _evictor(loaded, Events(), idle_after=3600.0, activity=lambda: busy)
    result = await ev.evict_idle("governor level 4", idle_only=False)
    assert [e.model.name for e in result.evictions] == ["demo-slow:latest"]
    assert _loaded(loaded) == ["demo-chat"]


def test_threshold_windows_wrap_midnight() -> None:
    night = [ThresholdWindow.model_validate({"from": "22:00", "to": "06:00",
                                             "threshold": "50%"})]
    assert threshold_at(0.85, night, dtime(21, 59)) == 0.85
    assert threshold_at(0.85, night, dtime(22, 0)) == 0.5
    assert threshold_at(0.85, night, dtime(3, 0)) == 0.5
    assert threshold_at(0.85, night, dtime(6, 0)) == 0.85


def test_activity_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "activity.json"
    tracker = ActivityTracker(path, clock=lambda: 100.0)
    tracker.begin("http://127.0.0.1:11434/", "qwen:latest")
    uses = read_activity(path)
    assert uses[model_key("http://127.0.0.1:11434", "qwen")] == Use(1, 100.0, 0.0)
    tracker.end("http://127.0.0.1:11434", "qwen")
    assert read_activity(path)[model_key("http://127.0.0.1:11434", "qwen")].in_flight == 0
    # A dead writer's in-flight count doesn't pin a model forever.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    path.write_text(json.dumps({"pid": int(dead), "uses": {"u|m": [3, 1.0, 0.0]}}))
    assert read_activity(path)["u|m"].in_flight == 0
    assert read_activity(tmp_path / "missing.json") == {}
    assert os.path.exists(path)
