"""VRAM watchdog: above a threshold (by time of day), unload idle models through their server.

Every `interval` it reads GPU memory; when the used share is over the threshold in force now
(e.g. 85% by day, 50% from 22:00 to 06:00), it unloads models that are idle — no request for
`evict_idle_after`, and never one with a request in flight — least recently used first, through
the backend's own API (Ollama `keep_alive: 0`, vLLM `/sleep`, llama-swap unload, or a command).
Then it polls memory for a bounded time and flags memory that did not come back: CUDA's free
figure lags, and a model server that keeps its VRAM after an unload is the leak/fragmentation
signal NVML cannot give directly.

Request activity comes from the proxy (another process) through `ActivityTracker` writing a
small JSON file that `read_activity` reads; in-flight counts of a dead writer are ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from datetime import time as dtime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from fleettop.supervisor.base.files import atomic_write_json
from fleettop.supervisor.base.periodic import every

if TYPE_CHECKING:  # aiohttp loads with the first backend: the proxy only reads activity
    import aiohttp

Emit = Callable[..., Any]


@dataclass(frozen=True, slots=True)
class GpuMemory:
    total: int
    used: int

    @property
    def share(self) -> float:
        return self.used / self.total if self.total else 0.0


class GpuMemorySource(Protocol):
    """What the watchdog needs from the probes' GPU interface (summed over devices)."""

    def read_memory(self) -> GpuMemory | None: ...


def threshold_at(default: float, schedule: Sequence[Any], now: dtime) -> float:
    """The threshold in force at `now`; windows may wrap midnight (22:00–06:00). Last wins."""
    value = default
    for window in schedule:
        start, end = window.start, window.end
        inside = start <= now < end if start <= end else (now >= start or now < end)
        if inside:
            value = window.threshold
    return value


def model_key(url: str, model: str) -> str:
    """One key per (server, model); Ollama's implicit `:latest` tag is dropped."""
    model = model[:-7] if model.endswith(":latest") else model
    return f"{url.rstrip('/')}|{model}"


# --- activity (written by the proxy, read by the watchdog) ---------------------------------


@dataclass(slots=True)
class Use:
    in_flight: int = 0
    last_start: float = 0.0
    last_end: float = 0.0


class ActivityTracker:
    """Proxy side: `begin(url, model)` when a request goes upstream, `end(...)` when it ends."""

    def __init__(self, path: str | os.PathLike[str] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path) if path else None
        self.clock = clock
        self.uses: dict[str, Use] = {}

    def begin(self, url: str, model: str) -> None:
        use = self.uses.setdefault(model_key(url, model), Use())
        use.in_flight += 1
        use.last_start = self.clock()
        self._save()

    def end(self, url: str, model: str) -> None:
        use = self.uses.setdefault(model_key(url, model), Use())
        use.in_flight = max(0, use.in_flight - 1)
        use.last_end = self.clock()
        self._save()

    def snapshot(self) -> dict[str, Use]:
        return {k: Use(u.in_flight, u.last_start, u.last_end) for k, u in self.uses.items()}

    def _save(self) -> None:
        if self.path is None:
            return
        data = {"pid": os.getpid(), "uses": {k: [u.in_flight, u.last_start, u.last_end]
                                             for k, u in self.uses.items()}}
        atomic_write_json(self.path, data)


def read_activity(path: str | os.PathLike[str]) -> dict[str, Use]:
    """The proxy's activity file; a dead writer's in-flight requests count as ended."""
    try:
        data = json.loads(Path(path).read_text())
        pid = int(data["pid"])
        raw = data["uses"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    try:
        os.kill(pid, 0)
        alive = True
    except ProcessLookupError:
        alive = False
    except PermissionError:
        alive = True
    out = {}
    for key, (n, start, end) in raw.items():
        out[key] = Use(int(n) if alive else 0, float(start), float(end))
    return out


# --- backends ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LoadedModel:
    backend: str
    """The backend's URL (or command) — with `name`, the model's key."""
    name: str
    size_vram: int | None = None


class Backend(Protocol):
    id: str

    async def loaded(self) -> list[LoadedModel]: ...

    async def unload(self, model: str) -> None: ...


class _Http:
    def __init__(self, url: str, session: aiohttp.ClientSession | None = None,
                 timeout: float = 10.0) -> None:
        import aiohttp

        self.id = url.rstrip("/")
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout)

    @contextlib.asynccontextmanager
    async def _sess(self) -> Any:
        if self._session is not None:
            yield self._session
            return
        import aiohttp

        async with aiohttp.ClientSession(timeout=self._timeout) as s:
            yield s

    async def _get(self, path: str) -> Any:
        async with self._sess() as s, s.get(self.id + path, timeout=self._timeout) as r:
            r.raise_for_status()
            return await r.json(content_type=None)

    async def _post(self, path: str, body: Any = None) -> None:
        async with self._sess() as s, s.post(self.id + path, json=body,
                                             timeout=self._timeout) as r:
            r.raise_for_status()
            await r.read()


class OllamaBackend(_Http):
    async def loaded(self) -> list[LoadedModel]:
        data = await self._get("/api/ps")
        return [LoadedModel(self.id, m.get("model") or m["name"], m.get("size_vram"))
                for m in data.get("models") or []]

    async def unload(self, model: str) -> None:
        # Ollama's documented idiom: a request with no prompt and keep_alive 0.
        await self._post("/api/generate", {"model": model, "keep_alive": 0})


class VllmBackend(_Http):
    """vLLM with --enable-sleep-mode (and VLLM_SERVER_DEV_MODE=1): one model per server."""

    def __init__(self, url: str, session: aiohttp.ClientSession | None = None,
                 level: int = 1) -> None:
        super().__init__(url, session)
        self.level = level

    async def loaded(self) -> list[LoadedModel]:
        import aiohttp

        with contextlib.suppress(aiohttp.ClientError, ValueError):
            if (await self._get("/is_sleeping")).get("is_sleeping"):
                return []
        data = await self._get("/v1/models")
        return [LoadedModel(self.id, m["id"]) for m in data.get("data") or []]

    async def unload(self, model: str) -> None:
        await self._post(f"/sleep?level={self.level}")


class LlamaSwapBackend(_Http):
    async def loaded(self) -> list[LoadedModel]:
        data = await self._get("/running")
        return [LoadedModel(self.id, m["model"]) for m in data.get("running") or []
                if m.get("state", "ready") == "ready"]

    async def unload(self, model: str) -> None:
        await self._post(f"/api/models/unload/{model}")


class CommandBackend:
    def __init__(self, unload_cmd: str, loaded_cmd: str | None = None) -> None:
        self.id = f"command:{unload_cmd}"
        self.unload_cmd = unload_cmd
        self.loaded_cmd = loaded_cmd

    async def _sh(self, cmd: str) -> str:
        proc = await asyncio.create_subprocess_shell(cmd, stdout=asyncio.subprocess.PIPE)
        out, _ = await proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"{cmd!r} exited {proc.returncode}")
        return out.decode(errors="replace")

    async def loaded(self) -> list[LoadedModel]:
        if not self.loaded_cmd:
            return []
        lines = (await self._sh(self.loaded_cmd)).splitlines()
        return [LoadedModel(self.id, line.strip()) for line in lines if line.strip()]

    async def unload(self, model: str) -> None:
        await self._sh(self.unload_cmd.replace("{model}", shlex.quote(model)))


def backend_from_config(entry: Any, session: aiohttp.ClientSession | None = None) -> Backend:
    """A `gpu.backends` entry (sections_gpu.GpuBackend) → a backend client."""
    if entry.kind == "ollama":
        return OllamaBackend(entry.url, session)
    if entry.kind == "vllm":
        return VllmBackend(entry.url, session, level=entry.sleep_level)
    if entry.kind == "llama-swap":
        return LlamaSwapBackend(entry.url, session)
    return CommandBackend(entry.unload_cmd, entry.loaded_cmd)


# --- the watchdog --------------------------------------------------------------------------


@dataclass(slots=True)
class Eviction:
    model: LoadedModel
    idle_s: float
    reclaimed: int | None = None
    ok: bool = True
    error: str | None = None


@dataclass(slots=True)
class TickResult:
    memory: GpuMemory | None
    threshold: float
    evictions: list[Eviction] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


class Evictor:
    def __init__(self, gpu: GpuMemorySource, backends: Sequence[Backend], *,
                 activity: Callable[[], Mapping[str, Use]] = dict,
                 emit: Emit | None = None, threshold: float = 0.85,
                 schedule: Sequence[Any] = (), idle_after: float = 300.0,
                 interval: float = 10.0, confirm_timeout: float = 5.0,
                 confirm_poll: float = 0.25, clock: Callable[[], float] = time.time,
                 local_now: Callable[[], dtime] = lambda: datetime.now().time()) -> None:
        self.gpu = gpu
        self.backends = list(backends)
        self.activity = activity
        self.emit = emit if emit is not None else (lambda *a, **k: None)
        self.threshold = threshold
        self.schedule = list(schedule)
        self.idle_after = idle_after
        self.interval = interval
        self.confirm_timeout = confirm_timeout
        self.confirm_poll = confirm_poll
        self.clock = clock
        self.local_now = local_now
        self.first_seen: dict[str, float] = {}
        self._busy = asyncio.Lock()

    @classmethod
    def from_config(cls, gpu: GpuMemorySource, section: Any, **kw: Any) -> Evictor:
        """From a `gpu:` section (sections_gpu.GpuSection)."""
        return cls(gpu, [backend_from_config(b) for b in section.backends],
                   threshold=section.threshold, schedule=section.schedule,
                   idle_after=section.evict_idle_after, interval=section.interval,
                   confirm_timeout=section.confirm_timeout, **kw)

    def threshold_now(self) -> float:
        return threshold_at(self.threshold, self.schedule, self.local_now())

    async def tick(self) -> TickResult:
        """One look: evict idle models if memory is over the threshold in force now."""
        mem = self.gpu.read_memory()
        thr = self.threshold_now()
        result = TickResult(mem, thr)
        if mem is None or mem.share <= thr:
            return result
        target = int(thr * mem.total)
        return await self._evict(result, mem, target, f"GPU memory {mem.share:.0%} is over "
                                 f"the {thr:.0%} threshold", idle_only=True)

    async def evict_idle(self, reason: str, *, idle_only: bool = True) -> TickResult:
        """Evict every idle model now (governor's evict_idle / evict_all: `idle_only=False`
        drops the idle-time rule, never the in-flight one)."""
        mem = self.gpu.read_memory()
        result = TickResult(mem, self.threshold_now())
        return await self._evict(result, mem, 0, reason, idle_only=idle_only)

    async def _loaded(self, result: TickResult) -> list[LoadedModel]:
        models: list[LoadedModel] = []
        for backend in self.backends:
            try:
                models.extend(await backend.loaded())
            except Exception as exc:  # noqa: BLE001 - a down server must not stop the others
                result.skipped.append(f"{backend.id}: {exc}")
        return models

    async def _evict(self, result: TickResult, mem: GpuMemory | None, target: int,
                     reason: str, *, idle_only: bool) -> TickResult:
        async with self._busy:
            now = self.clock()
            uses = self.activity()
            candidates: list[tuple[float, LoadedModel]] = []
            for model in await self._loaded(result):
                key = model_key(model.backend, model.name)
                seen = self.first_seen.setdefault(key, now)
                use = uses.get(key)
                if use is not None and use.in_flight > 0:
                    result.skipped.append(f"{model.name}: request in flight")
                    continue
                last = max(seen, use.last_end if use else 0.0, use.last_start if use else 0.0)
                idle = now - last
                if idle_only and idle < self.idle_after:
                    result.skipped.append(f"{model.name}: used {idle:.0f}s ago")
                    continue
                candidates.append((idle, model))
            # Least recently used first; among equals the biggest frees the most.
            candidates.sort(key=lambda c: (-c[0], -(c[1].size_vram or 0)))
            used = mem.used if mem else 0
            for idle, model in candidates:
                if mem is not None and target and used <= target:
                    break
                ev = await self._unload(model, idle, mem, reason)
                result.evictions.append(ev)
                if ev.ok:
                    used -= ev.reclaimed if ev.reclaimed is not None else (model.size_vram or 0)
            return result

    async def _unload(self, model: LoadedModel, idle: float, mem: GpuMemory | None,
                      reason: str) -> Eviction:
        ev = Eviction(model, idle)
        backend = next(b for b in self.backends if b.id == model.backend)
        try:
            await backend.unload(model.name)
        except Exception as exc:  # noqa: BLE001 - reported as an event, the loop goes on
            ev.ok, ev.error = False, str(exc)
            self.emit("gpu.evict_failed", None, f"could not unload {model.name}: {exc}",
                      model=model.name, backend=model.backend)
            return ev
        self.first_seen.pop(model_key(model.backend, model.name), None)
        figures = {"model": model.name, "backend": model.backend, "idle_s": round(idle, 1),
                   "size_vram": model.size_vram,
                   "used_before": mem.used if mem else None,
                   "total": mem.total if mem else None}
        self.emit("gpu.evicted", None, f"unloaded {model.name} (idle {idle:.0f}s): {reason}",
                  **figures)
        if mem is not None:
            ev.reclaimed = await self._confirm(model, mem)
        return ev

    async def _confirm(self, model: LoadedModel, before: GpuMemory) -> int:
        """Poll until the memory comes back; flag it if it doesn't within confirm_timeout."""
        want = (model.size_vram or 0) // 2 or 1
        deadline = time.monotonic() + self.confirm_timeout
        reclaimed = 0
        while True:
            now_mem = self.gpu.read_memory()
            if now_mem is not None:
                reclaimed = before.used - now_mem.used
                if reclaimed >= want:
                    return reclaimed
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(self.confirm_poll)
        self.emit("gpu.unreclaimed", None,
                  f"{model.name} unloaded but only {reclaimed / 2**20:.0f} MiB of GPU memory "
                  f"came back within {self.confirm_timeout:g}s",
                  model=model.name, backend=model.backend, reclaimed=reclaimed,
                  expected=model.size_vram, used_before=before.used)
        return reclaimed

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Tick every `interval` until `stop` is set; the next tick starts after this one."""
        await every(self.interval, self.tick, stop,
                    lambda exc: self.emit("gpu.watchdog_error", None, str(exc)))
