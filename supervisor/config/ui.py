"""The fleet file's `ui:` section: refresh period, read-only default and key remapping.

Binding ids are listed here rather than imported from the UI, because the core never imports
`fleettop.tui` (a test checks that this list matches the UI's bindings).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .units import parse_duration

BINDING_IDS: frozenset[str] = frozenset({
    "freeze", "resume", "toggle", "kill", "start-stop", "restart", "inspect", "logs", "filter",
    "pid", "help", "quit", "sort", "sort-reverse", "panel", "down", "up", "resume-warn",
})
"""Ids accepted under `ui: keys:` (the same ids as fleettop.tui.bindings)."""


class UiSection(BaseModel):
    """`ui:` in fleet.yaml, e.g. `ui: {refresh: 1s, keys: {freeze: x, kill: ctrl+x}}`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    refresh: float = Field(default=1.0, ge=0.2, le=10.0)
    """Seconds between polls ("500ms", "2s" or a number); 1–2 Hz keeps redraw cost low."""
    readonly: bool = False
    """Start the UI read-only, as `--readonly` does."""
    keys: dict[str, str] = Field(default_factory=dict)
    """Binding id → Textual key name(s), comma-separated for several (`"f,F"`)."""

    @field_validator("refresh", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> float:
        return parse_duration(value)

    @field_validator("keys")
    @classmethod
    def _known_ids(cls, value: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(value) - BINDING_IDS)
        if unknown:
            raise ValueError(f"unknown binding id(s) {unknown}; known: {sorted(BINDING_IDS)}")
        for bid, key in value.items():
            if not isinstance(key, str) or not key.strip():
                raise ValueError(f"keys.{bid}: give a key name such as 'x' or 'ctrl+k'")
        return value
