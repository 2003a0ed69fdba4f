"""GPU sampling: a fake behind the same interface, and the real NVML path on a GPU box."""

from __future__ import annotations

import pytest

from fleettop.probes.sensors.nvml import FakeGpu, GpuSource, NvmlGpu


def test_fake_gpu_attributes_vram_to_a_tree():
    gpu: GpuSource = FakeGpu(total=6 << 30)
    gpu.set_process_vram(100, 1 << 30)
    gpu.set_process_vram(101, 512 << 20)
    gpu.set_process_vram(200, 2 << 30)
    snap = gpu.sample()
    assert snap.vram_of([100, 101, 999]) == (1 << 30) + (512 << 20)
    assert snap.gpus[0].mem_used == (3 << 30) + (512 << 20)
    assert snap.gpus[0].mem_total == 6 << 30
    assert snap.to_json()["process_vram"]["200"] == 2 << 30


def test_fake_without_devices_says_no_gpu():
    gpu = FakeGpu(count=0)
    assert not gpu.available and gpu.why.startswith("no GPU")
    assert gpu.sample().gpus == []


def test_nvml_never_raises_and_explains():
    gpu = NvmlGpu()
    try:
        snap = gpu.sample()
        if gpu.available:
            assert snap.gpus
        else:
            assert gpu.why.startswith("no GPU") and snap.gpus == [] and snap.vram_of([1]) == 0
    finally:
        gpu.close()


@pytest.mark.gpu
def test_real_nvml_sees_the_gpu_and_a_process_using_it():
    gpu = NvmlGpu()
    if not gpu.available:
        pytest.skip(gpu.why)
    try:
        snap = gpu.sample()
        assert snap.gpus, "NVML initialised but listed no GPU"
        for g in snap.gpus:
            assert g.mem_total > 0 and 0 <= g.mem_used <= g.mem_total
            assert g.util_percent is None or 0 <= g.util_percent <= 100
            assert g.name and g.uuid.startswith("GPU-")
        assert all(v >= 0 for v in snap.process_vram.values())
    finally:
        gpu.close()


def test_each_gpu_lists_the_processes_on_it():
    from types import SimpleNamespace

    from fleettop.supervisor.capabilities.telemetry import TelemetryWatch

    gpu = FakeGpu(total=8 << 30, count=2)
    gpu.set_process_vram(100, 1 << 30, gpu=0)
    gpu.set_process_vram(200, 3 << 30, gpu=1)
    gpu.set_process_vram(300, 1 << 20, gpu=1)
    rt = SimpleNamespace(pid=200, pids=lambda: [200, 201])
    sup = SimpleNamespace(agents={"trainer": rt})
    watch = TelemetryWatch(sup, source=SimpleNamespace(source="procfs"), gpu=gpu)
    watch.gpu_snapshot = gpu.sample()
    part = watch.snapshot_part()
    on = {g["index"]: {p["pid"]: (p["agent"], p["used_bytes"]) for p in g["processes"]}
          for g in part["gpus"]}
    assert on == {0: {100: (None, 1 << 30)}, 1: {200: ("trainer", 3 << 30), 300: (None, 1 << 20)}}
    assert [g["used_bytes"] for g in part["gpus"]] == [1 << 30, (3 << 30) + (1 << 20)]
