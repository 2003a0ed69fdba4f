"""The main screen's widgets: the agents table and the side panels.

Each widget takes the snapshot (or its slice) and touches the screen only when what it shows
changed: the table repaints single rows, panels re-render only on a different text.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from rich.text import Text
from textual.widgets import Static

from . import format as fmt
from .table import STATE_STYLES, AgentsTable

__all__ = ["STATE_STYLES", "AgentsTable", "EventsPanel", "LeakPanel", "LockPanel", "Panel",
           "StatusLine", "VramPanel"]

HISTORY = 120
"""Samples kept per series for sparklines (two minutes at 1 Hz)."""


def not_available(snapshot: dict[str, Any], component: str, default: str) -> str:
    """Why a capability's data is absent: its `<name>_reason` or its component's reason."""
    reason = snapshot.get(f"{component}_reason")
    for comp in snapshot.get("components") or []:
        if isinstance(comp, dict) and comp.get("name") == component and comp.get("reason"):
            reason = reason or comp["reason"]
    return f"not available: {reason or default}"


class Panel(Static):
    """A titled text panel that repaints only when its text changes."""

    def __init__(self, title: str, **kwargs: Any) -> None:
        super().__init__("", **kwargs)
        self.border_title = title
        self._last: Text | None = None
        self._snap: dict[str, Any] | None = None
        self._now = 0.0

    def show(self, snapshot: dict[str, Any], now: float) -> None:
        """Take in a new snapshot (history, if any) and repaint if the text changed."""
        self.ingest(snapshot)
        self._snap, self._now = snapshot, now
        self.show_text(self.build(snapshot, now))

    def ingest(self, snapshot: dict[str, Any]) -> None:
        """Record history from a snapshot; called once per snapshot."""

    def build(self, snapshot: dict[str, Any], now: float) -> Text:
        raise NotImplementedError

    def on_resize(self) -> None:
        if self._snap is not None:
            self.show_text(self.build(self._snap, self._now))

    def show_text(self, text: Text) -> None:
        if text != self._last:
            self._last = text
            self.update(text, layout=False)  # fixed-size boxes: no reflow of the screen

    @property
    def text(self) -> str:
        """The plain text shown (tests read it)."""
        return self._last.plain if self._last is not None else ""


class LockPanel(Panel):
    """GPU lock: holder (agent, model, held for) and waiters in FIFO order with their waits."""

    def build(self, snapshot: dict[str, Any], now: float) -> Text:
        lock = snapshot.get("lock")
        if not isinstance(lock, dict):
            return Text(not_available(snapshot, "lock", "no GPU lock in this fleet"), style="dim")
        out = Text()
        holder = lock.get("holder")
        if holder:
            h = holder if isinstance(holder, dict) else {"agent": holder}
            held = h.get("held_s", now - h["since"] if h.get("since") else None)
            out.append("held ", style="bold")
            out.append(f"{h.get('agent', '?')} {h.get('model') or ''}".rstrip(), style="green")
            out.append(f" for {fmt.duration(held)}\n")
        else:
            out.append("free\n", style="dim")
        queue = lock.get("queue") or []
        for i, w in enumerate(queue, 1):
            w = w if isinstance(w, dict) else {"agent": w}
            waited = w.get("waited_s", now - w["since"] if w.get("since") else None)
            model = f" {w['model']}" if w.get("model") else ""
            out.append(f"{i}. {w.get('agent', '?')}{model} waits {fmt.duration(waited)}\n")
        if not queue:
            out.append("no waiters", style="dim")
        gate = _proxy_gate(snapshot)
        if gate and (gate.get("queue") or gate.get("in_flight")):
            # Requests the proxy holds for shared agents: they queue there, not as tickets.
            out.rstrip()
            out.append(f"\nproxy: {gate.get('loaded') or '-'}, {gate.get('in_flight', 0)} in "
                       "flight", style="bold")
            for w in gate.get("queue") or []:
                out.append(f"\n  {w.get('agent', '?')} {w.get('model') or ''} waits "
                           f"{fmt.duration(w.get('waited_s'))}")
        out.rstrip()
        return out


def _proxy_gate(snapshot: dict[str, Any]) -> dict[str, Any] | None:
    for c in snapshot.get("components") or []:
        if isinstance(c, dict) and c.get("name") == "proxy":
            gate = (c.get("gpu") or {}).get("gate")
            return gate if isinstance(gate, dict) else None
    return None


class VramPanel(Panel):
    """Each GPU's used/total as a bar plus a history sparkline, and per-process usage."""

    def __init__(self, title: str, **kwargs: Any) -> None:
        super().__init__(title, **kwargs)
        self._history: dict[int, deque[float]] = {}

    def ingest(self, snapshot: dict[str, Any]) -> None:
        for g in snapshot.get("gpus") or []:
            hist = self._history.setdefault(int(g.get("index", 0)), deque(maxlen=HISTORY))
            hist.append(float(g.get("used_bytes") or 0))

    def build(self, snapshot: dict[str, Any], now: float) -> Text:
        gpus = snapshot.get("gpus")
        if not gpus:
            reason = snapshot.get("gpu_reason")
            msg = reason if reason else not_available(snapshot, "gpu", "no GPU data")
            return Text(msg, style="dim")
        width = max(8, (self.size.width or 40) - 4)
        out = Text()
        for g in gpus:
            used, total = float(g.get("used_bytes") or 0), float(g.get("total_bytes") or 0)
            hist = self._history.get(int(g.get("index", 0)), deque())
            out.append(f"GPU{g.get('index', 0)} {g.get('name', '')}"[:width] + "\n", style="bold")
            util = g.get("util_percent")
            tail = f" {fmt.size(used)}/{fmt.size(total)}" + (f" {util:.0f}%" if util is not None
                                                            else "")
            bw = max(4, width - len(tail))
            pct = used / total if total else 0
            out.append(fmt.bar(used, total, bw), style="red" if pct > 0.9 else "green")
            out.append(tail + "\n")
            out.append(fmt.sparkline(hist, width, lo=0, hi=total or None) + "\n", style="cyan")
            for p in g.get("processes") or []:
                who = p.get("agent") or "?"
                out.append(f"  {p.get('pid')} {who} {fmt.size(p.get('used_bytes'))}\n")
        out.rstrip()
        return out


class LeakPanel(Panel):
    """Per agent: memory sparkline with the fitted line under it, slope, R², time to limit."""

    def __init__(self, title: str, **kwargs: Any) -> None:
        super().__init__(title, **kwargs)
        self._rss: dict[str, deque[float]] = {}

    def ingest(self, snapshot: dict[str, Any]) -> None:
        for a in snapshot.get("agents") or []:
            if a.get("rss_bytes") is not None:
                self._rss.setdefault(str(a.get("name")), deque(maxlen=HISTORY)).append(
                    float(a["rss_bytes"]))

    def build(self, snapshot: dict[str, Any], now: float) -> Text:
        agents = snapshot.get("agents") or []
        leaks: dict[str, Any] = (snapshot["leaks"] if isinstance(snapshot.get("leaks"), dict)
                                 else {})
        fitted = [a for a in agents if a.get("leak_slope_bytes_per_s") is not None
                  or str(a.get("name")) in leaks]
        if not fitted:
            return Text(not_available(snapshot, "leak", "no leak fits yet"), style="dim")
        fitted.sort(key=lambda a: -float(a.get("leak_slope_bytes_per_s") or 0))
        width = max(8, (self.size.width or 40) - 4)
        spark_w = max(6, min(24, width - 28))
        out = Text()
        for a in fitted:
            name = str(a.get("name"))
            fit: dict[str, Any] = leaks.get(name) or {}
            samples = [float(x) for x in fit.get("samples") or self._rss.get(name) or []]
            slope = fit.get("slope_bytes_per_s", a.get("leak_slope_bytes_per_s"))
            r2 = fit.get("r2", a.get("leak_r2"))
            ttl = fit.get("time_to_limit_s", a.get("leak_time_to_limit_s"))
            line = fmt.fit_line(samples[-spark_w:])
            lo = min(samples[-spark_w:] + line) if samples else None
            hi = max(samples[-spark_w:] + line) if samples else None
            out.append(f"{name[:10]:<10} ")
            out.append(fmt.sparkline(samples, spark_w, lo, hi).ljust(spark_w), style="yellow")
            warn = ttl is not None and float(ttl) < 600
            out.append(f" {fmt.slope_mib_min(slope)}MiB/m R²{fmt.number(r2, '{:.2f}')}",)
            out.append(f" lim {fmt.duration(ttl)}\n", style="bold red" if warn else "")
            out.append(" " * 11)
            out.append(fmt.sparkline(line, spark_w, lo, hi) + " fit\n", style="dim")
        out.rstrip()
        return out


class EventsPanel(Panel):
    """Trips, freezes, resumes, restarts, evictions, governor levels: newest first."""

    KIND_STYLES = {"breaker.trip": "bold red", "agent.frozen": "cyan", "agent.resumed": "green",
                   "gpu.evicted": "magenta", "governor.level": "yellow"}

    def build(self, snapshot: dict[str, Any], now: float, limit: int = 60) -> Text:
        events = snapshot.get("events")
        if events is None:
            return Text(not_available(snapshot, "events", "no event feed"), style="dim")
        out = Text(no_wrap=True, overflow="ellipsis")
        for e in fmt.newest_first(events, limit):
            out.append(fmt.event_line(e) + "\n",
                       style=self.KIND_STYLES.get(str(e.get("kind")), ""))
        if not events:
            out.append("no events yet", style="dim")
        out.rstrip()
        return out


class StatusLine(Static):
    """One line: fleet name, counts by state, governor level, last error."""

    _last: Text | None = None

    def show(self, snapshot: dict[str, Any], *, readonly: bool, error: str | None,
             note: str = "") -> None:
        agents = snapshot.get("agents") or []
        counts: dict[str, int] = {}
        for a in agents:
            s = fmt.display_state(a)
            counts[s] = counts.get(s, 0) + 1
        fleet = (snapshot.get("fleet") or {}).get("name") or "fleet"
        parts = ["READ-ONLY"] if readonly else []
        if note:
            parts.append(note)
        parts.append(f"{fleet}: {len(agents)} agents")
        parts += [f"{n} {fmt.STATE_LABELS.get(s, ('', s))[1]}" for s, n in sorted(counts.items())]
        gov = snapshot.get("governor")
        if isinstance(gov, dict) and gov.get("level") is not None:
            parts.append(f"governor {gov['level']}")
        text = Text(" · ".join(parts))
        failing = [str(a.get("name")) for a in agents if a.get("log_error")]
        if failing:
            text.append(f"  ⚠ logs not written: {', '.join(failing[:3])}"
                        + (" …" if len(failing) > 3 else ""), style="bold yellow")
        if error:
            text.append(f"  ✗ {error}", style="bold red")
        if text != self._last:
            self._last = text
            self.update(text, layout=False)  # fixed-size boxes: no reflow of the screen
