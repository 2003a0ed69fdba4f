"""The verdict every detector gives: a `Trip` names its kind, says why and carries evidence."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Trip:
    """One breaker trip: what kind, a one-line reason and the evidence behind it."""

    kind: str  # token_loop | retry_loop | budget | rate
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)
    at_char: int | None = None
    at_request: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "reason": self.reason, "evidence": self.evidence}
        if self.at_char is not None:
            out["at_char"] = self.at_char
        if self.at_request is not None:
            out["at_request"] = self.at_request
        return out
