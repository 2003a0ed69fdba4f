"""The fleet file's `serve:` section: the HTTP/WebSocket metrics server."""

from __future__ import annotations

import ipaddress
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fleettop.supervisor.config.units import parse_duration

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and `localhost`; every other name or address counts as remote."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ServeSection(BaseModel):
    """`serve:` keys. Off unless `enabled: true` (or `--serve` on the command line)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    host: str = DEFAULT_HOST
    """Bind address. Anything but loopback also needs `allow_remote: true`."""
    port: int = Field(default=DEFAULT_PORT, ge=0, le=65535)
    """0 picks a free port (printed at start)."""
    readonly: bool = False
    """No mutating endpoints at all (freeze/resume are not even routed)."""
    allow_remote: bool = False
    """Permit a non-loopback `host`; fleettop then logs a warning at start."""
    refresh: float = 1.0
    """Seconds between WebSocket deltas (`500ms`, `2s`, or a number)."""

    @field_validator("refresh", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> float:
        seconds = parse_duration(value)
        if not 0.05 <= seconds <= 60:
            raise ValueError("refresh must be between 50ms and 60s")
        return seconds

    @field_validator("host")
    @classmethod
    def _host(cls, value: str) -> str:
        value = value.strip()
        if not value:
            raise ValueError("host must not be empty")
        return value

    @model_validator(mode="after")
    def _remote_needs_consent(self) -> ServeSection:
        if not is_loopback(self.host) and not self.allow_remote:
            raise ValueError(f"serve.host {self.host!r} is not a loopback address: set "
                             "serve.allow_remote: true to expose the fleet on the network")
        return self
