"""Token, request, cost and rate budgets per agent over a sliding window (pure, no I/O).

The proxy calls `on_request` when a request arrives and `on_usage` as tokens stream; either
returns a `Trip` (kind `budget` or `rate`) the first time a limit is crossed in the window.
"""

from __future__ import annotations

import fnmatch
from collections import deque
from dataclasses import dataclass
from typing import Any

from fleettop.supervisor.detect.trip import Trip

_BUCKET_S = 1.0


@dataclass(frozen=True)
class BudgetParams:
    window: float = 3600.0
    max_tokens: int | None = None
    max_requests: int | None = None
    max_cost: float | None = None
    max_rate_per_min: float | None = None


@dataclass(frozen=True)
class Price:
    """USD per million tokens."""

    input: float = 0.0
    output: float = 0.0


def price_for(model: str | None, prices: dict[str, Price]) -> Price | None:
    """Exact model name first, then the longest matching glob (`gpt-4o*`, `*`)."""
    if not model:
        return prices.get("*")
    if model in prices:
        return prices[model]
    matches = [p for p in prices if fnmatch.fnmatchcase(model, p)]
    return prices[max(matches, key=len)] if matches else None


def cost_of(model: str | None, tokens_in: int, tokens_out: int,
            prices: dict[str, Price]) -> float:
    price = price_for(model, prices)
    if price is None:
        return 0.0
    return (tokens_in * price.input + tokens_out * price.output) / 1_000_000


class BudgetTracker:
    """Sliding-window totals for one agent."""

    def __init__(self, params: BudgetParams | None = None) -> None:
        self.p = params or BudgetParams()
        self._requests: deque[float] = deque()
        self._usage: deque[tuple[float, int, float]] = deque()  # (ts, tokens, cost)
        self.total_tokens_in = 0
        self.total_tokens_out = 0
        self.total_cost = 0.0
        self.total_requests = 0
        self._win_tokens = 0
        self._win_cost = 0.0

    def _expire(self, now: float) -> None:
        horizon = now - max(self.p.window, 60.0)
        while self._requests and self._requests[0] < horizon:
            self._requests.popleft()
        while self._usage and self._usage[0][0] < now - self.p.window:
            _, tokens, cost = self._usage.popleft()
            self._win_tokens -= tokens
            self._win_cost -= cost

    def on_request(self, now: float) -> Trip | None:
        self._expire(now)
        self._requests.append(now)
        self.total_requests += 1
        if self.p.max_rate_per_min is not None:
            rate = self.rate_per_min(now)
            if rate > self.p.max_rate_per_min:
                return Trip("rate", f"{rate:.0f} requests/min > {self.p.max_rate_per_min:g}",
                            {"rate_per_min": rate, "limit": self.p.max_rate_per_min})
        if self.p.max_requests is not None:
            n = self.window_requests(now)
            if n > self.p.max_requests:
                return Trip("budget", f"{n} requests in {self.p.window:g}s > {self.p.max_requests}",
                            {"budget": "requests", "used": n, "limit": self.p.max_requests,
                             "window_s": self.p.window})
        return None

    def on_usage(self, now: float, tokens_in: int, tokens_out: int, cost: float) -> Trip | None:
        """Record newly seen tokens (deltas, not totals) and their cost."""
        self._expire(now)
        self.total_tokens_in += tokens_in
        self.total_tokens_out += tokens_out
        self.total_cost += cost
        if self._usage and now - self._usage[-1][0] < _BUCKET_S:
            # One entry per second, not per chunk: the window stays small at any stream rate.
            ts, tokens, spent = self._usage[-1]
            self._usage[-1] = (ts, tokens + tokens_in + tokens_out, spent + cost)
        else:
            self._usage.append((now, tokens_in + tokens_out, cost))
        self._win_tokens += tokens_in + tokens_out
        self._win_cost += cost
        tokens, spent = self.window_usage(now)
        if self.p.max_tokens is not None and tokens > self.p.max_tokens:
            return Trip("budget", f"{tokens} tokens in {self.p.window:g}s > {self.p.max_tokens}",
                        {"budget": "tokens", "used": tokens, "limit": self.p.max_tokens,
                         "window_s": self.p.window})
        if self.p.max_cost is not None and spent > self.p.max_cost:
            return Trip("budget", f"${spent:.4f} in {self.p.window:g}s > ${self.p.max_cost:g}",
                        {"budget": "cost", "used": round(spent, 6), "limit": self.p.max_cost,
                         "window_s": self.p.window})
        return None

    def window_requests(self, now: float) -> int:
        return sum(1 for t in self._requests if t >= now - self.p.window)

    def window_usage(self, now: float) -> tuple[int, float]:
        """Running sums (kept on append/expire: this runs on every streamed chunk)."""
        self._expire(now)
        return self._win_tokens, max(0.0, self._win_cost)

    def rate_per_min(self, now: float) -> float:
        return float(sum(1 for t in self._requests if t >= now - 60.0))

    def snapshot(self, now: float) -> dict[str, Any]:
        self._expire(now)
        tokens, spent = self.window_usage(now)
        return {"tokens_in": self.total_tokens_in, "tokens_out": self.total_tokens_out,
                "cost": round(self.total_cost, 6), "requests": self.total_requests,
                "req_per_min": self.rate_per_min(now), "window_tokens": tokens,
                "window_cost": round(spent, 6), "window_requests": self.window_requests(now)}
