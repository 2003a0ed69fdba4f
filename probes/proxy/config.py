"""The proxy's whole configuration, one model on both sides of the process boundary.

The supervisor builds a `ProxyConfig` from the fleet file (`ProxyConfig.from_fleet`) and
writes it once (`write`, 0600); the proxy process reads it once (`read`) at start and on
each `reload` command, and hands the parsed object to its addons. Nobody else parses it,
and the proxy never writes it back: the ports it picks for reverse listeners travel in its
`proxy.ready` report, and it keeps them in `reverse_ports` in memory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fleettop.supervisor.base.files import atomic_write
from fleettop.supervisor.config.gpu import ModelsSection, RoutesSection
from fleettop.supervisor.config.proxy import AgentBreakerSection, BreakerSection, ProxySection
from fleettop.supervisor.gpu.lock import fleet_lock_folder

if TYPE_CHECKING:
    from fleettop.supervisor.config.fleet import Fleet


class ReverseListener(BaseModel):
    """One agent's reverse listener: requests to it go to `upstream`."""

    model_config = ConfigDict(extra="forbid")
    upstream: str
    port: int = 0
    """0: the proxy picks a free one."""


class GpuConfig(BaseModel):
    """What the GPU addon (probes/proxy/gpu.py) needs from the fleet file."""

    model_config = ConfigDict(extra="forbid")
    lock_dir: Path | None = None
    lock_timeout: float = 600.0
    batch_max_wait: float = 30.0
    max_in_flight: int = 1
    backends: list[str] = Field(default_factory=list)
    agents: dict[str, str] = Field(default_factory=dict)
    """Each agent's `gpu:` mode (none | shared | exclusive)."""
    governor_state: Path | None = None
    activity: Path | None = None
    models: ModelsSection = Field(default_factory=ModelsSection)
    routes: RoutesSection = Field(default_factory=RoutesSection)
    hardware: dict[str, Any] | None = None
    """Fixed hardware instead of detecting it (tests, or a box whose NVML lies)."""
    stats_interval: float = 1.0

    @classmethod
    def from_fleet(cls, fleet: Fleet, state_dir: Path) -> GpuConfig:
        gpu = fleet.gpu
        return cls(
            lock_dir=fleet_lock_folder(state_dir, gpu), lock_timeout=gpu.lock_timeout,
            batch_max_wait=gpu.batch_max_wait, max_in_flight=gpu.max_in_flight,
            backends=[b.url for b in gpu.backends if b.url],
            agents={name: spec.gpu for name, spec in fleet.agents.items()},
            governor_state=Path(state_dir) / "governor.json" if fleet.governor.enabled
            else None,
            activity=Path(state_dir) / "gpu-activity.json",
            models=fleet.models, routes=fleet.routes)


class ProxyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    proxy: ProxySection = Field(default_factory=ProxySection)
    breaker: BreakerSection = Field(default_factory=BreakerSection)
    agents: dict[str, AgentBreakerSection] = Field(default_factory=dict)
    """Per-agent breaker overrides."""
    reverse: dict[str, ReverseListener] = Field(default_factory=dict)
    gpu: GpuConfig = Field(default_factory=GpuConfig)
    reverse_ports: dict[int, str] = Field(default_factory=dict)
    """Listening port → agent, filled in by the proxy process once it has bound them."""

    @field_validator("agents", mode="before")
    @classmethod
    def _no_empty_overrides(cls, value: Any) -> Any:
        return {k: v for k, v in value.items() if v} if isinstance(value, dict) else value

    @classmethod
    def from_fleet(cls, fleet: Fleet, state_dir: Path) -> ProxyConfig:
        proxy = fleet.proxy
        base = proxy.reverse_base_port
        return cls(
            proxy=proxy, breaker=fleet.breaker,
            agents={n: s.breaker for n, s in fleet.agents.items() if s.breaker is not None},
            reverse={a: ReverseListener(upstream=u, port=base + i if base else 0)
                     for i, (a, u) in enumerate(sorted(proxy.reverse.items()))},
            gpu=GpuConfig.from_fleet(fleet, state_dir))

    def write(self, path: str | os.PathLike[str]) -> Path:
        return atomic_write(path, self.model_dump_json(exclude={"reverse_ports"}), mode=0o600)

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> ProxyConfig:
        return cls.model_validate_json(Path(path).read_bytes())
