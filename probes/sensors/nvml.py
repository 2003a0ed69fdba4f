"""GPU memory and utilisation through NVML (nvidia-ml-py, module ``pynvml``): the one wrapper.

The telemetry samples (`sample`), the VRAM watchdog, the governor and the router
(`read_memory`, summed over devices) all read the GPU through ``NvmlGpu``; `open_nvml` gives
one only where an NVIDIA driver is installed, without loading pynvml elsewhere.

``NvmlGpu`` reports "no GPU" cleanly where NVML can't start (no driver, no library,
no device): ``available`` is False and ``why`` says what NVML said. ``FakeGpu`` sits
behind the same ``GpuSource`` protocol for tests and demos. Per-process VRAM comes
from NVML's running compute and graphics processes; an agent's VRAM is the sum over
its process tree (a model server that owns the VRAM is its own agent).
"""

from __future__ import annotations

import contextlib
import ctypes.util
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from fleettop.supervisor.gpu.evictor import GpuMemory


@dataclass
class GpuInfo:
    index: int
    name: str
    uuid: str
    mem_used: int
    mem_total: int
    util_percent: float | None
    mem_util_percent: float | None = None
    temperature_c: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GpuSnapshot:
    gpus: list[GpuInfo] = field(default_factory=list)
    process_vram: dict[int, int] = field(default_factory=dict)  # pid -> bytes, all GPUs
    per_gpu: dict[int, dict[int, int]] = field(default_factory=dict)
    """GPU index -> pid -> bytes: which card each process's memory is on."""

    def vram_of(self, pids: list[int]) -> int:
        return sum(self.process_vram.get(p, 0) for p in pids)

    def to_json(self) -> dict[str, Any]:
        return {"gpus": [g.to_json() for g in self.gpus],
                "process_vram": {str(k): v for k, v in self.process_vram.items()},
                "per_gpu": {str(i): {str(k): v for k, v in procs.items()}
                            for i, procs in self.per_gpu.items()}}


class GpuSource(Protocol):
    available: bool
    why: str

    def sample(self) -> GpuSnapshot: ...

    def close(self) -> None: ...


class NvmlGpu:
    """NVML-backed source. Never raises from sample(): a lost GPU reads as empty."""

    def __init__(self) -> None:
        self.available = False
        self.why = ""
        self.driver = ""
        try:
            import pynvml
        except ImportError as exc:
            self.why = f"no GPU: nvidia-ml-py not installed ({exc})"
            return
        self._nv = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            # LibraryNotFound (no driver), DriverNotLoaded, NoPermission, ...
            self.why = f"no GPU: {exc}"
            return
        try:
            self.count = pynvml.nvmlDeviceGetCount()
            self.driver = _text(pynvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError as exc:
            self.why = f"no GPU: {exc}"
            return
        if self.count == 0:
            self.why = "no GPU: NVML found no devices"
            return
        self.available = True

    def sample(self) -> GpuSnapshot:
        snap = GpuSnapshot()
        if not self.available:
            return snap
        nv = self._nv
        for i in range(self.count):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                mem = nv.nvmlDeviceGetMemoryInfo(h)
            except nv.NVMLError:
                continue
            util = mem_util = temp = None
            try:
                u = nv.nvmlDeviceGetUtilizationRates(h)
                util, mem_util = float(u.gpu), float(u.memory)
            except nv.NVMLError:
                pass
            with contextlib.suppress(nv.NVMLError):
                temp = float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
            snap.gpus.append(GpuInfo(i, _text(nv.nvmlDeviceGetName(h)),
                                     _text(nv.nvmlDeviceGetUUID(h)), int(mem.used),
                                     int(mem.total), util, mem_util, temp))
            for getter in (nv.nvmlDeviceGetComputeRunningProcesses,
                           nv.nvmlDeviceGetGraphicsRunningProcesses):
                try:
                    procs = getter(h)
                except nv.NVMLError:
                    continue
                for p in procs:
                    used = p.usedGpuMemory
                    # None / NVML_VALUE_NOT_AVAILABLE where the driver hides it (containers).
                    if used is None or used >= 1 << 63:
                        continue
                    snap.process_vram[p.pid] = snap.process_vram.get(p.pid, 0) + int(used)
                    on = snap.per_gpu.setdefault(i, {})
                    on[p.pid] = on.get(p.pid, 0) + int(used)
        return snap

    def read_memory(self) -> GpuMemory | None:
        """Memory summed over devices (the watchdog's and the router's view); None if none."""
        if not self.available:
            return None
        nv = self._nv
        total = used = 0
        for i in range(self.count):
            try:
                info = nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(i))
            except nv.NVMLError:
                continue
            total += int(info.total)
            used += int(info.used)
        return GpuMemory(total, used) if total else None

    def close(self) -> None:
        if self.available:
            with contextlib.suppress(self._nv.NVMLError):
                self._nv.nvmlShutdown()
            self.available = False


class FakeGpu:
    """A scripted GPU for tests: set ``gpus`` and ``process_vram`` directly."""

    def __init__(self, total: int = 6 << 30, name: str = "Fake GPU", count: int = 1) -> None:
        self.available = count > 0
        self.why = "" if self.available else "no GPU: fake with no devices"
        self.gpus = [GpuInfo(i, name, f"GPU-fake-{i}", 0, total, 0.0) for i in range(count)]
        self.per_gpu: dict[int, dict[int, int]] = {}

    @property
    def process_vram(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for procs in self.per_gpu.values():
            for pid, used in procs.items():
                out[pid] = out.get(pid, 0) + used
        return out

    def set_process_vram(self, pid: int, used: int, gpu: int = 0) -> None:
        self.per_gpu.setdefault(gpu, {})[pid] = used
        self.gpus[gpu].mem_used = sum(self.per_gpu[gpu].values())

    def sample(self) -> GpuSnapshot:
        return GpuSnapshot([GpuInfo(**asdict(g)) for g in self.gpus], self.process_vram,
                           {i: dict(p) for i, p in self.per_gpu.items()})

    def close(self) -> None:
        pass


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


def open_gpu() -> GpuSource:
    return NvmlGpu()


def open_nvml() -> NvmlGpu | None:
    """An NVML handle where a driver is installed and a GPU answers; else None, and pynvml
    is not even imported (a CPU box pays nothing)."""
    if ctypes.util.find_library("nvidia-ml") is None:
        return None
    gpu = NvmlGpu()
    return gpu if gpu.available else None
