"""Screens over the main view: inspector, logs, help, and the three small dialogs."""

from __future__ import annotations

import json
from typing import Any

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, Footer, Input, Label, Static

from . import format as fmt
from .bindings import APP_BINDINGS, MUTATING_ACTIONS

PROBE_FIELDS = [
    ("tokens_in", "tokens in", "{:.0f}"), ("tokens_out", "tokens out", "{:.0f}"),
    ("tokens_per_s", "tokens/s", "{:.1f}"), ("requests", "requests", "{:.0f}"),
    ("cost_usd", "spend $", "{:.2f}"), ("loop_score", "loop score", "{:.2f}"),
    ("ctx_switches_per_s", "ctx switches/s", "{:.0f}"), ("faults_per_s", "faults/s", "{:.0f}"),
    ("net_tx_bytes", "net tx B", "{:.0f}"), ("net_rx_bytes", "net rx B", "{:.0f}"),
    ("nprocs", "processes", "{:.0f}"),
]


def highlighted_tokens(last_text: str, trip: dict[str, Any] | None) -> Text:
    """The last generated text with the looping span (evidence span_start/span_end) reversed.

    Offsets are character offsets into `last_text`; out-of-range offsets are clamped.
    """
    text = Text(last_text)
    ev = (trip or {}).get("evidence") or {}
    start, end = ev.get("span_start"), ev.get("span_end")
    if isinstance(start, int) and isinstance(end, int) and end > start:
        start, end = max(0, start), min(len(last_text), end)
        text.stylize("reverse bold red", start, end)
    return text


_ZERO_PRINT = "0" * 16


def _evidence_value(value: Any) -> str:
    """Evidence as a person reads it: rows of `key value`, not a Python repr; all-zero
    fingerprints (an exact match) left out."""
    def pairs(d: dict[str, Any]) -> str:
        return "  ".join(f"{k} {v}" for k, v in d.items()
                         if not (k == "fingerprint" and str(v) == _ZERO_PRINT))

    if isinstance(value, dict):
        return pairs(value)
    if isinstance(value, list) and value and all(isinstance(x, dict) for x in value):
        return "\n".join(["", *(f"    {pairs(x)}" for x in value[-8:])])
    text = ", ".join(map(str, value)) if isinstance(value, list) else str(value)
    return text if len(text) <= 120 else text[:117] + "…"


class InspectorScreen(Screen[None]):
    """One agent up close: last tokens with the loop highlighted, trip, requests, logs, probes."""

    BINDINGS = [Binding("escape", "close", "Close", id="close-inspector")]

    def __init__(self, agent: dict[str, Any], *, readonly: bool) -> None:
        super().__init__()
        self.agent = agent
        """The latest snapshot dict of the inspected agent."""
        self.readonly = readonly
        self.log_lines: list[str] | None = None
        """Log tail fetched with the `logs` command (None until it arrives)."""
        self._probes: Text | None = None

    @property
    def agent_name(self) -> str:
        return str(self.agent.get("name"))

    def compose(self) -> ComposeResult:
        with Horizontal(id="inspector-head"):
            yield Label("", id="inspector-title")
            yield Button("Freeze", id="inspector-freeze", compact=True, variant="primary",
                         disabled=self.readonly)
            yield Button("Resume", id="inspector-resume", compact=True, variant="success",
                         disabled=self.readonly)
            yield Button("Close", id="inspector-close", compact=True)
        with VerticalScroll(id="inspector-body"):
            # The last tokens first: they are why one freezes instead of kills, and at 80×24
            # a section below them would push them off the screen.
            with VerticalScroll(id="inspector-tokens-box", classes="section"):
                yield Static("", id="inspector-tokens")
            yield Static("", id="inspector-trip", classes="section")
            yield Static("", id="inspector-probes", classes="section")
            yield Static("", id="inspector-requests", classes="section")
            yield Static("", id="inspector-logs", classes="section")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one("#inspector-trip").border_title = "trip"
        self.query_one("#inspector-tokens-box").border_title = "last tokens"
        self.query_one("#inspector-requests").border_title = "last requests (redacted)"
        self.query_one("#inspector-logs").border_title = "log tail"
        self.query_one("#inspector-probes").border_title = "probe counters"
        self._render_all(None)

    def update_agent(self, agent: dict[str, Any]) -> None:
        """New data for the inspected agent; re-renders only sections whose data changed."""
        old, self.agent = self.agent, agent
        if old != agent:
            self._render_all(old)

    def set_logs(self, lines: list[str]) -> None:
        self.log_lines = lines
        self._render_logs()

    def _render_all(self, old: dict[str, Any] | None) -> None:
        a = self.agent

        def changed(*keys: str) -> bool:
            return old is None or any(old.get(k) != a.get(k) for k in keys)

        if changed("state", "reason", "pid", "pids", "trip", "source", "restarts"):
            title = (f"{a.get('name')}  {fmt.state_text(a)}  pid {a.get('pid') or '-'}"
                     f"  probe {a.get('source') or fmt.NA}")
            if a.get("reason"):
                title += f"  ({a['reason']})"
            self.query_one("#inspector-title", Label).update(title)
        if changed("trip"):
            self.query_one("#inspector-trip", Static).update(self._trip_text())
        if changed("last_text", "trip"):
            box = self.query_one("#inspector-tokens-box", VerticalScroll)
            last = a.get("last_text")
            self.query_one("#inspector-tokens", Static).update(
                highlighted_tokens(last, a.get("trip")) if last
                else Text("not available: no token capture for this agent (proxy off?)",
                          style="dim"))
            box.border_subtitle = f"{len(last or '')} chars"
            self.call_after_refresh(box.scroll_end, animate=False)
        if changed("last_requests"):
            self.query_one("#inspector-requests", Static).update(self._requests_text())
        if changed("log_tail") and self.log_lines is None:
            self._render_logs()
        probes = self._probes_text()
        if probes != self._probes:  # counters move every poll; unchanged text is not redrawn
            self._probes = probes
            self.query_one("#inspector-probes", Static).update(probes)

    def _trip_text(self) -> Text:
        trip = self.agent.get("trip")
        if not trip:
            return Text("not tripped", style="dim")
        out = Text()
        out.append(f"{trip.get('kind', '?')}: ", style="bold red")
        out.append(f"{trip.get('reason', '')}\n")
        for k, v in (trip.get("evidence") or {}).items():
            if k in ("text_tail", "repeating_span") or v in (None, "", [], {}):
                continue  # the tokens above show them, highlighted
            out.append(f"  {k}: ", style="dim")
            out.append(_evidence_value(v) + "\n")
        out.rstrip()
        return out

    def _requests_text(self) -> Text:
        reqs = self.agent.get("last_requests")
        if reqs is None:
            return Text("not available: no proxy data for this agent", style="dim")
        if not reqs:
            return Text("no requests yet", style="dim")
        lines = []
        for r in reqs[-10:]:
            if isinstance(r, dict):
                lines.append(" ".join(f"{k}={v}" for k, v in r.items()))
            else:
                lines.append(json.dumps(r))
        return Text("\n".join(lines), no_wrap=True, overflow="ellipsis")

    def _render_logs(self) -> None:
        lines = self.log_lines if self.log_lines is not None else self.agent.get("log_tail")
        widget = self.query_one("#inspector-logs", Static)
        if lines is None:
            widget.update(Text("fetching logs…", style="dim"))
        else:
            widget.update(Text("\n".join(lines[-20:]) or "empty log", no_wrap=True,
                               overflow="ellipsis"))

    def _probes_text(self) -> Text:
        a = self.agent
        parts = [f"source: {a.get('source') or fmt.NA}"]
        parts += [f"{label}: {fmt.number(a.get(key), f)}" for key, label, f in PROBE_FIELDS]
        parts.append(f"rss: {fmt.size(a.get('rss_bytes'))}")
        parts.append(f"vram: {fmt.size(a.get('vram_bytes'))}")
        parts.append(f"model: {a.get('last_model') or fmt.NA}")
        cell = max(len(p) for p in parts) + 2
        per_row = max(1, (self.size.width - 4) // cell)
        rows = ["".join(p.ljust(cell) for p in parts[i:i + per_row]).rstrip()
                for i in range(0, len(parts), per_row)]
        return Text("\n".join(rows), no_wrap=True, overflow="ellipsis")

    @on(Button.Pressed, "#inspector-freeze")
    async def _freeze(self) -> None:
        await self.app.run_action("freeze_agent")

    @on(Button.Pressed, "#inspector-resume")
    async def _resume(self) -> None:
        await self.app.run_action("resume_agent")

    @on(Button.Pressed, "#inspector-close")
    def action_close(self) -> None:
        self.dismiss(None)


class LogScreen(ModalScreen[None]):
    """An agent's log tail, fetched with the `logs` command."""

    BINDINGS = [Binding("escape,q,l", "close", "Close", id="close-logs")]

    def __init__(self, name: str) -> None:
        super().__init__()
        self.agent_name = name

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="logs-box", classes="dialog"):
            yield Static(Text("fetching logs…", style="dim"), id="logs-text")

    def on_mount(self) -> None:
        self.query_one("#logs-box").border_title = f"logs: {self.agent_name}"

    def set_logs(self, lines: list[str]) -> None:
        self.query_one("#logs-text", Static).update(Text("\n".join(lines) or "empty log"))
        self.query_one("#logs-box", VerticalScroll).scroll_end(animate=False)

    def action_close(self) -> None:
        self.dismiss(None)


class HelpScreen(ModalScreen[None]):
    """Every binding with its current key; read-only greys out the mutating ones."""

    BINDINGS = [Binding("escape,question_mark,q", "close", "Close", id="close-help")]

    def __init__(self, keys: dict[str, str], *, readonly: bool) -> None:
        super().__init__()
        self.keys = keys
        self.readonly = readonly

    def compose(self) -> ComposeResult:
        out = Text()
        for b in APP_BINDINGS:
            # What the footer shows (`/`, `?`, `^k`), not Textual's key names (`slash`).
            key = self.app.get_key_display(Binding(self.keys.get(b.id or "", b.key), b.action))
            dim = self.readonly and b.action in MUTATING_ACTIONS
            style = "dim strike" if dim else ""
            out.append(f"{key:>12}  ", style="bold" if not dim else style)
            out.append(f"{b.description:<11} {b.tooltip}", style=style)
            out.append(f"  [{b.id}]\n", style="dim")
        out.append("\nmouse: click a column header to sort; Freeze/Resume buttons act on the"
                   " selected row.\nRemap keys in the fleet file: ui: keys: {id: key}", style="dim")
        if self.readonly:
            out.append("\nREAD-ONLY: struck-out actions are disabled.", style="bold yellow")
        with VerticalScroll(id="help-box", classes="dialog"):
            yield Static(out, id="help-text")

    def on_mount(self) -> None:
        self.query_one("#help-box").border_title = "fleettop keys"

    def action_close(self) -> None:
        self.dismiss(None)


class ConfirmKillScreen(ModalScreen[bool]):
    """Kill asks first: SIGKILL loses whatever the agent held."""

    BINDINGS = [Binding("y", "answer(True)", "Yes", id="kill-yes"),
                Binding("n,escape", "answer(False)", "No", id="kill-no")]

    def __init__(self, name: str) -> None:
        super().__init__()
        self.agent_name = name

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-box", classes="dialog"):
            yield Label(f"SIGKILL agent {self.agent_name} and its whole tree?")
            with Horizontal(classes="buttons"):
                yield Button("Kill (y)", id="kill-yes", variant="error", compact=True)
                yield Button("Cancel (n)", id="kill-no", compact=True)

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "kill-yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class QuitScreen(ModalScreen[str | None]):
    """What to do with frozen agents on quit: resume then stop, or stop; None cancels."""

    BINDINGS = [Binding("r", "answer('resume')", "Resume+stop", id="quit-resume"),
                Binding("s", "answer('stop')", "Stop", id="quit-stop"),
                Binding("escape,c", "answer(None)", "Cancel", id="quit-cancel")]

    def __init__(self, frozen: list[str]) -> None:
        super().__init__()
        self.frozen = frozen

    def compose(self) -> ComposeResult:
        names = ", ".join(self.frozen[:6]) + (" …" if len(self.frozen) > 6 else "")
        with Vertical(id="quit-box", classes="dialog"):
            yield Label(f"{len(self.frozen)} frozen: {names}")
            yield Label("Quitting stops the fleet. What happens to the frozen agents?")
            with Horizontal(classes="buttons"):
                yield Button("Resume, then stop (r)", id="quit-resume", compact=True,
                             variant="success")
                yield Button("Stop (s)", id="quit-stop", compact=True, variant="error")
                yield Button("Cancel (esc)", id="quit-cancel", compact=True)

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        choice = {"quit-resume": "resume", "quit-stop": "stop"}.get(event.button.id or "")
        self.dismiss(choice)

    def action_answer(self, choice: str | None) -> None:
        self.dismiss(choice)


class PidScreen(ModalScreen[tuple[str, int] | None]):
    """Freeze or resume any PID: it then shows as a watched external row."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="pid-cancel")]

    def compose(self) -> ComposeResult:
        with Vertical(id="pid-box", classes="dialog"):
            yield Label("PID to freeze/resume (enter freezes):")
            yield Input(placeholder="PID", id="pid-input", restrict=r"[0-9]*")
            with Horizontal(classes="buttons"):
                yield Button("Freeze", id="pid-freeze", compact=True, variant="primary")
                yield Button("Resume", id="pid-resume", compact=True, variant="success")
                yield Button("Cancel", id="pid-cancel", compact=True)

    def _answer(self, cmd: str) -> None:
        value = self.query_one("#pid-input", Input).value.strip()
        if value.isdigit() and int(value) > 0:
            self.dismiss((cmd, int(value)))
        else:
            self.notify("type a PID (digits)", severity="warning")

    @on(Input.Submitted)
    def _submitted(self) -> None:
        self._answer("freeze")

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "pid-cancel":
            self.dismiss(None)
        else:
            self._answer("freeze" if event.button.id == "pid-freeze" else "resume")

    def action_cancel(self) -> None:
        self.dismiss(None)
