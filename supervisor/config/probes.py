"""Fleet-file sections owned by the probes capability: ``probes:`` and ``leak:``.

```yaml
probes:
  source: auto        # auto | ebpf | procfs
  interval: 1s        # how often the supervisor takes a sample (the kernel side runs at 10 Hz)
  syscalls: false     # count syscalls: costs every process on the machine ~200 ns per syscall
  gpu_interval: 2s
  spin: {cpu_percent: 95, duration: 60s, policy: freeze}
leak:
  policy: warn        # warn | freeze (freeze only when the projected time to limit < horizon)
  horizon: 20m
  metrics: [rss, vram]
```
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fleettop.supervisor.config.units import parse_duration


def _duration(v: object) -> float:
    if isinstance(v, int | float):
        return float(v)
    return parse_duration(str(v))


class SpinSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cpu_percent: float = Field(95.0, gt=0, le=10000)
    """Share of one core (a tree can exceed 100)."""
    duration: float = 60.0
    """Seconds at or above cpu_percent, without blocking, before tripping."""
    max_blocking_per_s: float = Field(5.0, ge=0)
    policy: Literal["off", "warn", "freeze"] = "freeze"

    _dur = field_validator("duration", mode="before")(_duration)


class ProbesSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: Literal["auto", "ebpf", "procfs"] = "auto"
    interval: float = 1.0
    syscalls: bool = False
    """Opt-in: raw_syscalls:sys_enter slows every syscall on the machine (~200 ns)."""
    gpu_interval: float = 2.0
    spin: SpinSection = Field(default_factory=SpinSection)

    _dur = field_validator("interval", "gpu_interval", mode="before")(_duration)


class LeakSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: Literal["off", "warn", "freeze"] = "warn"
    horizon: float = 20 * 60.0
    """Freeze (with policy freeze) when the projected time to the limit is shorter."""
    metrics: list[Literal["rss", "vram"]] = Field(
        default_factory=lambda: list[Literal["rss", "vram"]](["rss", "vram"]))
    eval_interval: float = 5.0
    persistence: int = Field(2, ge=1)

    _dur = field_validator("horizon", "eval_interval", mode="before")(_duration)
