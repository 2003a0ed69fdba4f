"""Typed messages between the poll/command workers and the widgets (STYLE.md §2).

Data first: tests assert on these through `run_test(message_hook=...)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from textual.message import Message


@dataclass
class SnapshotArrived(Message):
    """A new fleet snapshot was fetched; a newer one replaces an unhandled older one."""

    snapshot: dict[str, Any]

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, SnapshotArrived)


@dataclass
class SnapshotFailed(Message):
    """The client could not produce a snapshot (socket gone, supervisor busy...)."""

    error: str


@dataclass
class CommandIssued(Message):
    """A command dict is about to be sent to the supervisor."""

    request: dict[str, Any]


@dataclass
class CommandReplied(Message):
    """The supervisor answered a command."""

    request: dict[str, Any]
    reply: dict[str, Any]


@dataclass
class FleetEventArrived(Message):
    """One `Event.to_json()` dict from the client's live event stream."""

    event: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.event.get("kind", ""))


@dataclass
class AgentFrozen(Message):
    """An agent (or watched PID) was frozen; posted from the event stream."""

    agent: str | None
    reason: str


@dataclass
class LoopTripped(Message):
    """The breaker tripped on an agent; posted from the event stream."""

    agent: str | None
    reason: str
