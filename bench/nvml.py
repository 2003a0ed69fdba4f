"""Print what NVML sees, as one JSON object: GPUs, memory, utilisation, per-process VRAM.

    python bench/nvml.py
"""

from __future__ import annotations

import json
import time

from fleettop.probes.sensors.nvml import NvmlGpu


def main() -> None:
    t0 = time.perf_counter()
    gpu = NvmlGpu()
    init_s = time.perf_counter() - t0
    out: dict[str, object] = {"available": gpu.available, "why": gpu.why,
                              "driver": gpu.driver, "init_s": round(init_s, 4)}
    if gpu.available:
        t1 = time.perf_counter()
        snap = gpu.sample()
        out["sample_s"] = round(time.perf_counter() - t1, 4)
        out.update(snap.to_json())
    gpu.close()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
