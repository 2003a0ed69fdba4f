"""Pure formatting of snapshot values into cell text: no Textual, no I/O, easy to test.

Every state gets a word and a symbol so colour never carries meaning alone.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

NA = "n/a"
MIB = 1024 * 1024
GIB = 1024 * MIB
SPARK = "▁▂▃▄▅▆▇█"

STATE_LABELS: dict[str, tuple[str, str]] = {
    # state: (symbol, word)
    "running": ("●", "run"),
    "starting": ("▲", "start"),
    "frozen": ("❚❚", "FROZEN"),
    "tripped": ("⚡", "TRIPPED"),
    "waiting": ("⧗", "wait-gpu"),
    "scheduled": ("◷", "sched"),
    "backoff": ("↻", "backoff"),
    "stopping": ("▼", "stopping"),
    "stopped": ("■", "stopped"),
    "exited": ("✓", "exit"),
    "failed": ("✗", "FAILED"),
    "external": ("◇", "ext"),
}
"""Symbol and word shown for each state; unknown states show as `? <state>`."""


def display_state(agent: dict[str, Any]) -> str:
    """The state a row shows: a frozen agent with a trip is shown as tripped."""
    state = str(agent.get("state") or "unknown")
    if state == "frozen" and agent.get("trip"):
        return "tripped"
    return state


def state_text(agent: dict[str, Any], now: float | None = None) -> str:
    """State cell: symbol + word, plus the detail that matters (next run, exit code)."""
    state = display_state(agent)
    symbol, word = STATE_LABELS.get(state, ("?", state))
    if state == "scheduled" and agent.get("next_run"):
        word = f"{word} {clock(agent['next_run'])}"
    elif state == "exited" and agent.get("exit_code") not in (None, 0):
        symbol, word = "✗", f"exit {agent['exit_code']}"
    elif state == "exited":
        word = "exit 0"
    elif state == "external":
        word = f"ext {agent.get('ext_state', '')}".strip()
    relaxed = agent.get("breaker_relaxed")
    if isinstance(relaxed, dict) and state == "running":
        word = f"{word} ({relaxed.get('policy')} {clock(relaxed.get('until') or 0)})"
    return f"{symbol} {word}"


def clock(ts: float) -> str:
    """HH:MM local time."""
    return time.strftime("%H:%M", time.localtime(float(ts)))


def clock_s(ts: float) -> str:
    """HH:MM:SS local time."""
    return time.strftime("%H:%M:%S", time.localtime(float(ts)))


def size(value: Any) -> str:
    """Bytes as a short human size (`812M`, `1.4G`), `n/a` when absent."""
    if value is None:
        return NA
    b = float(value)
    if b >= GIB:
        return f"{b / GIB:.1f}G"
    if b >= MIB:
        return f"{b / MIB:.0f}M"
    if b >= 1024:
        return f"{b / 1024:.0f}K"
    return f"{b:.0f}B"


def number(value: Any, fmt: str = "{:.0f}") -> str:
    """Format a number, `n/a` when absent."""
    if value is None:
        return NA
    try:
        return fmt.format(float(value))
    except (TypeError, ValueError):
        return NA


def money(value: Any) -> str:
    """USD in 6 columns: cents once there are any, else the first digits of a fraction of one
    (local and cheap models spend $0.0003 a turn: 0.00 would say nothing was spent)."""
    if value is None:
        return NA
    try:
        v = float(value)
    except (TypeError, ValueError):
        return NA
    if v == 0 or v >= 0.01:
        return f"{v:.2f}" if v < 1000 else f"{v:.0f}"
    return f"{v:.4f}" if v >= 0.0001 else "<.0001"


def slope_mib_min(bytes_per_s: Any) -> str:
    """Leak slope in MiB/min with a sign."""
    if bytes_per_s is None:
        return NA
    return f"{float(bytes_per_s) * 60 / MIB:+.1f}"


def duration(seconds: Any) -> str:
    """Seconds as `45s`, `12m`, `3h05`, `n/a` when absent."""
    if seconds is None:
        return NA
    s = max(0.0, float(seconds))
    if s < 90:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{s / 60:.0f}m"
    h, rest = divmod(int(s), 3600)
    return f"{h}h{rest // 60:02d}"


def sparkline(values: Sequence[float], width: int, lo: float | None = None,
              hi: float | None = None) -> str:
    """Block sparkline of the last `width` values, scaled to [lo, hi] (defaults: data range)."""
    data = list(values)[-width:]
    if not data:
        return ""
    lo = min(data) if lo is None else lo
    hi = max(data) if hi is None else hi
    span = hi - lo
    if span <= 0:
        return SPARK[0] * len(data)
    top = len(SPARK) - 1
    return "".join(SPARK[max(0, min(top, round((v - lo) / span * top)))] for v in data)


def bar(used: float, total: float, width: int) -> str:
    """A filled/empty bar `█████░░░░` of `width` cells."""
    if total <= 0 or width <= 0:
        return "░" * max(0, width)
    filled = max(0, min(width, round(used / total * width)))
    return "█" * filled + "░" * (width - filled)


def fit_line(samples: Sequence[float]) -> list[float]:
    """Least-squares line through evenly spaced samples, evaluated at each sample.

    Used only for drawing when the snapshot carries samples but not the fit itself.
    """
    n = len(samples)
    if n < 2:
        return list(samples)
    mean_x = (n - 1) / 2
    mean_y = sum(samples) / n
    sxx = sum((i - mean_x) ** 2 for i in range(n))
    sxy = sum((i - mean_x) * (y - mean_y) for i, y in enumerate(samples))
    slope = sxy / sxx
    return [mean_y + slope * (i - mean_x) for i in range(n)]


def event_line(event: dict[str, Any]) -> str:
    """One events-panel line: time, kind, agent, reason."""
    who = f" {event['agent']}" if event.get("agent") else ""
    data = event.get("data") or {}
    extra = ""
    if event.get("kind") == "agent.state" and "to" in data:
        extra = f" {data.get('from', '?')}→{data['to']}"
    reason = f": {event['reason']}" if event.get("reason") else ""
    return f"{clock_s(event.get('ts', 0))} {event.get('kind', '?')}{who}{extra}{reason}"


def newest_first(events: Iterable[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """The `limit` newest events, newest first (stable for equal timestamps)."""
    ordered = sorted(enumerate(events), key=lambda p: (p[1].get("ts", 0), p[0]), reverse=True)
    return [e for _, e in ordered[:limit]]
