"""The fleet file's top-level sections, one model per capability, gathered for the schema."""

from __future__ import annotations

from fleettop.supervisor.sections_gpu import (
    GovernorSection,
    GpuMode,
    GpuSection,
    ModelsSection,
    RoutesSection,
    check_routes,
)
from fleettop.supervisor.sections_probes import LeakSection, ProbesSection
from fleettop.supervisor.sections_proxy import AgentBreakerSection, BreakerSection, ProxySection
from fleettop.supervisor.sections_serve import ServeSection
from fleettop.supervisor.sections_ui import UiSection

__all__ = [
    "AgentBreakerSection", "BreakerSection", "GovernorSection", "GpuMode", "GpuSection",
    "LeakSection", "ModelsSection", "ProbesSection", "ProxySection", "RoutesSection",
    "ServeSection", "UiSection", "check_routes",
]
