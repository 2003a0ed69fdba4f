"""The fleet file's models: `Fleet` and each agent's `AgentSpec` (the sections are in
config/<section>.py; the loader with positions is config/load.py)."""

from __future__ import annotations

import re
import shlex
from typing import Annotated, Any, Literal

from croniter import croniter
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictStr,
    field_validator,
    model_validator,
)

from fleettop.supervisor.config.gpu import (
    GovernorSection,
    GpuMode,
    GpuSection,
    ModelsSection,
    RoutesSection,
)
from fleettop.supervisor.config.probes import LeakSection, ProbesSection
from fleettop.supervisor.config.proxy import AgentBreakerSection, BreakerSection, ProxySection
from fleettop.supervisor.config.serve import ServeSection
from fleettop.supervisor.config.ui import UiSection
from fleettop.supervisor.config.units import parse_duration, parse_size

Duration = Annotated[float, BeforeValidator(parse_duration)]
Size = Annotated[int, BeforeValidator(parse_size)]
AGENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def _restart_value(value: object) -> object:
    # YAML 1.1 reads a bare `no` as False; the user meant the policy "no".
    return "no" if value is False else value


def _cron(value: object) -> object:
    if isinstance(value, str) and not croniter.is_valid(value):
        raise ValueError(f"bad cron expression {value!r}: use 5 fields, e.g. '*/15 * * * *'")
    return value


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Limits(Strict):
    memory: Size | None = None
    """memory.max of the agent's cgroup (bytes)."""


class Backoff(Strict):
    initial: Duration = 1.0
    max: Duration = 60.0
    factor: float = Field(2.0, ge=1.0)
    jitter: float = Field(0.2, ge=0.0, le=1.0)
    """± fraction of each delay, so a fleet restarting together doesn't stampede."""
    reset_after: Duration = 60.0
    """A run at least this long resets the backoff and the start-limit count."""


class StartLimit(Strict):
    burst: int = Field(5, ge=1)
    interval: Duration = 60.0


class LogSettings(Strict):
    max_bytes: Size = 10 * 1024 * 1024
    backups: int = Field(5, ge=0)
    tail_lines: int = Field(500, ge=10)


def _one_target(probe: Any, kinds: tuple[str, ...]) -> None:
    """A probe names exactly one target; tcp is host:port, http an http:// URL."""
    if sum(1 for k in kinds if getattr(probe, k)) != 1:
        raise ValueError(f"give exactly one of {', '.join(kinds)}")
    if probe.tcp:
        host, _, port = probe.tcp.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"tcp: expected host:port, got {probe.tcp!r}")
    if probe.http and not re.match(r"^http://[^/]+", probe.http):
        raise ValueError(f"http: expected an http:// URL, got {probe.http!r}")


class Ready(Strict):
    """When a started agent counts as ready, for the agents that depend on it."""

    tcp: str | None = None
    """host:port accepting connections, e.g. 127.0.0.1:11434."""
    http: str | None = None
    """A URL that answers HTTP (any status), e.g. http://127.0.0.1:11434/api/tags."""
    log: str | None = None
    """A regular expression matched against its output lines."""
    timeout: Duration = 30.0
    """Dependents start anyway after this long, with a warning."""

    @model_validator(mode="after")
    def _one_probe(self) -> Ready:
        _one_target(self, ("tcp", "http", "log"))
        if self.log:
            try:
                re.compile(self.log)
            except re.error as exc:
                raise ValueError(f"log: bad regular expression: {exc}") from None
        return self


class Health(Strict):
    """Liveness: checked every `interval` while the agent runs (after `ready:` passed, if it has
    one); after `failures` failed checks in a row the agent is restarted (`agent.unhealthy`).
    A frozen or stopping agent is not checked: it cannot answer."""

    tcp: str | None = None
    """host:port that must accept connections."""
    http: str | None = None
    """A URL that must answer HTTP (any status)."""
    interval: Duration = 10.0
    timeout: Duration = 2.0
    """One check that takes longer fails."""
    failures: int = Field(3, ge=1, le=100)
    start_after: Duration = 0.0
    """Grace after each start before the first check."""

    @model_validator(mode="after")
    def _one_probe(self) -> Health:
        _one_target(self, ("tcp", "http"))
        return self


class AgentSpec(Strict):
    name: str = ""
    cmd: list[StrictStr] | StrictStr
    shell: bool = False
    cwd: str | None = None
    env: dict[str, StrictStr] = Field(default_factory=dict)
    user: str | None = None
    restart: Annotated[Literal["no", "on-failure", "always"], BeforeValidator(_restart_value)] = (
        "on-failure"
    )
    schedule: Annotated[str, BeforeValidator(_cron)] | None = None
    depends_on: list[str] = Field(default_factory=list)
    ready: Ready | None = None
    """Readiness probe: agents that depend on this one start once it passes."""
    health: Health | None = None
    """Liveness probe: restart the agent when it stops answering."""
    stop_timeout: Duration = 10.0
    stop_signal: Literal["TERM", "INT", "HUP", "QUIT", "KILL", "USR1", "USR2"] = "TERM"
    priority: int = 0
    """Higher is more important; the governor freezes the lowest first."""
    limits: Limits = Field(default_factory=Limits)
    enabled: bool = True
    backoff: Backoff = Field(default_factory=Backoff)
    start_limit: StartLimit = Field(default_factory=StartLimit)
    log: LogSettings = Field(default_factory=LogSettings)
    proxy: bool = True
    """Route this agent's HTTP(S) through fleettop's token proxy."""
    base_url: str | None = None
    gpu: GpuMode = "none"
    """exclusive: hold the GPU lock for the whole run; shared: the proxy serialises requests."""
    breaker: AgentBreakerSection | None = None
    """Per-agent overrides of the fleet's `breaker:` thresholds."""

    @field_validator("cmd")
    @classmethod
    def _cmd_not_empty(cls, value: list[str] | str) -> list[str] | str:
        if (isinstance(value, str) and not value.strip()) or (
            isinstance(value, list) and not value
        ):
            raise ValueError("cmd is empty")
        return value

    def argv(self) -> list[str]:
        """The argv to exec: a list as is, a string through shlex, or through sh with shell."""
        if self.shell:
            script = self.cmd if isinstance(self.cmd, str) else shlex.join(self.cmd)
            return ["/bin/sh", "-c", script]
        return list(self.cmd) if isinstance(self.cmd, list) else shlex.split(self.cmd)


class Fleet(Strict):
    version: Literal[1] = 1
    name: str | None = None
    state_dir: str | None = None
    agents: dict[str, AgentSpec] = Field(default_factory=dict)
    proxy: ProxySection = Field(default_factory=ProxySection)
    breaker: BreakerSection = Field(default_factory=BreakerSection)
    leak: LeakSection = Field(default_factory=LeakSection)
    probes: ProbesSection = Field(default_factory=ProbesSection)
    gpu: GpuSection = Field(default_factory=GpuSection)
    governor: GovernorSection = Field(default_factory=GovernorSection)
    models: ModelsSection = Field(default_factory=ModelsSection)
    routes: RoutesSection = Field(default_factory=RoutesSection)
    serve: ServeSection = Field(default_factory=ServeSection)
    ui: UiSection = Field(default_factory=UiSection)

    path: str = ""
    """The fleet file this came from (set by load_fleet)."""

    def start_order(self) -> list[str]:
        """Agents in dependency order (dependencies first); stable by file order otherwise."""
        order: list[str] = []
        seen: set[str] = set()

        def visit(name: str) -> None:
            if name in seen:
                return
            seen.add(name)
            for dep in self.agents[name].depends_on:
                visit(dep)
            order.append(name)

        for name in self.agents:
            visit(name)
        return order


