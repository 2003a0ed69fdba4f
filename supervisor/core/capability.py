"""What a running supervisor offers the parts that plug into it, declared once.

A capability (the token proxy, telemetry, the GPU start gate, the web view, ...) is an
object with these methods; each has a do-nothing default, so a capability writes only the
ones it needs. The supervisor calls them at fixed points of an agent's life and knows none
of them by name. Errors in one never stop the others, except `before_start`'s `SkipStart`,
which is how a capability says "not this run".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from fleettop.supervisor.config.fleet import AgentSpec, Fleet
    from fleettop.supervisor.core.agent import AgentRuntime


class SkipStart(Exception):
    """Raised by `before_start` to skip this run (a scheduled agent tries at its next slot)."""


class Capability(Protocol):
    name: str
    """Its row in the snapshot's `components` list, when `component()` gives one."""

    def agent_env(self, spec: AgentSpec, env: dict[str, str]) -> None:
        """Add to an agent's environment, just before each start."""
        return None

    async def before_start(self, rt: AgentRuntime) -> None:
        """Before each start; may wait (for the GPU lock) or raise SkipStart."""
        return None

    def after_exit(self, rt: AgentRuntime) -> None:
        """After each run ends, or after a start that failed."""
        return None

    async def before_resume(self, name: str) -> None:
        """Just before a frozen agent is thawed (e.g. lift the proxy's block first)."""
        return None

    def relax_breaker(self, name: str, policy: str, until: float) -> bool:
        """Until `until` (epoch s) this agent's trips take `policy`; True if it applies."""
        return False

    async def after_reload(self, fleet: Fleet) -> None:
        """After the fleet file was re-read, before changed agents restart."""
        return None

    def agent_fields(self, name: str) -> dict[str, Any]:
        """Extra fields of one agent's row in the snapshot."""
        return {}

    def snapshot_part(self) -> dict[str, Any]:
        """Extra top-level parts of the snapshot (the lock, the GPUs)."""
        return {}

    def component(self) -> dict[str, Any] | None:
        """This part's own row (state, pid, detail) in the snapshot's `components`."""
        return None

    async def stop(self) -> None:
        """After every agent has stopped; capabilities stop in reverse order of adding."""
        return None
