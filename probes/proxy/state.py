"""What the breaker addon keeps per agent (its ring of last text, budget, retry detector,
block) and per streamed response (its parser, loop detector and unbooked text)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from fleettop.probes.proxy import wire
from fleettop.supervisor.config.proxy import BreakerSection
from fleettop.supervisor.detect.budget import BudgetTracker
from fleettop.supervisor.detect.retry_loop import RetryDetector
from fleettop.supervisor.detect.token_loop import LoopDetector
from fleettop.supervisor.detect.trip import Trip


@dataclass
class AgentState:
    name: str
    breaker: BreakerSection
    ring_bytes: int
    keep_requests: int
    text: deque[str] = field(default_factory=deque)
    text_len: int = 0
    text_total: int = 0
    requests: deque[dict[str, Any]] = field(default_factory=deque)
    blocked: Trip | None = None
    last_model: str | None = None
    active_streams: int = 0
    trips: int = 0
    passthrough: int = 0
    errors: int = 0
    reported_total: int = -1
    loop_score: float = 0.0
    relaxed: tuple[str, float] | None = None
    """(policy, until): after a resume with a lower breaker, trips take this policy."""

    def __post_init__(self) -> None:
        self.budget = BudgetTracker(self.breaker.budget_params())
        self.retry = RetryDetector(self.breaker.loop_params())
        self.requests = deque(maxlen=max(1, self.keep_requests))

    def add_text(self, delta: str) -> None:
        self.text.append(delta)
        self.text_len += len(delta)
        self.text_total += len(delta)
        while self.text_len - len(self.text[0]) >= self.ring_bytes:
            self.text_len -= len(self.text.popleft())

    def ring(self) -> str:
        return "".join(self.text)


class FlowState:
    __slots__ = ("agent", "api", "parser", "detector", "body", "booked_in", "booked_out",
                 "est_in", "chars_out", "aborted", "started", "pending", "pending_chars", "raw",
                 "raw_bytes")

    def __init__(self, agent: AgentState, api: str | None, body: dict[str, Any] | None) -> None:
        self.agent = agent
        self.api = api
        self.body = body
        self.parser: wire.ResponseParser | None = None
        self.detector = LoopDetector(agent.breaker.loop_params())
        self.booked_in = 0
        self.booked_out = 0
        self.est_in = wire.estimate_tokens(wire.request_text_chars(body)) if body else 0
        self.chars_out = 0
        self.aborted = False
        self.started = time.monotonic()
        self.pending: list[str] = []  # deltas not yet in the ring and the detector
        self.pending_chars = 0
        self.raw: list[bytes] = []  # chunks relayed but not parsed yet
        self.raw_bytes = 0
