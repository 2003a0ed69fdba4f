"""Events: every transition and action is data first (STYLE.md §2), rendering second."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Event:
    kind: str
    """Dotted kind: `agent.state`, `agent.frozen`, `breaker.trip`, `lock.acquired`, ..."""
    agent: str | None = None
    reason: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    ts: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        return {"ts": self.ts, "kind": self.kind, "agent": self.agent, "reason": self.reason,
                "data": self.data}

    def to_text(self) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(self.ts))
        who = f" {self.agent}" if self.agent else ""
        extra = ""
        if self.kind == "agent.state":
            extra = f" {self.data.get('from')} → {self.data.get('to')}"
        reason = f": {self.reason}" if self.reason else ""
        return f"{stamp} {self.kind}{who}{extra}{reason}"
