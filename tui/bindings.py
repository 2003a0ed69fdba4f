"""Every key binding, defined once with an id so a fleet file's `ui: keys:` can remap it.

Action names avoid Textual's own `suspend_process` (which suspends the app itself).
"""

from __future__ import annotations

from textual.binding import Binding

APP_BINDINGS: list[Binding] = [
    # Help and Quit first: the footer is cut at 80 columns, and these two must show.
    Binding("question_mark", "help", "Help", id="help", tooltip="This help"),
    Binding("q", "quit_fleet", "Quit", id="quit", tooltip="Quit (asks about frozen agents)"),
    Binding("f", "freeze_agent", "Freeze", id="freeze", tooltip="Freeze the selected agent"),
    Binding("r", "resume_agent", "Resume", id="resume", tooltip="Resume the selected agent"),
    Binding("space", "toggle_freeze", "Toggle", id="toggle", tooltip="Freeze or resume"),
    Binding("w", "resume_warn", "Resume, warn", id="resume-warn", show=False,
            tooltip="Resume; for 10 minutes its loops warn instead of freezing it again"),
    # k9s's key: j/k move the cursor here, as in vim, less and k9s.
    Binding("ctrl+k", "kill_agent", "Kill", id="kill", tooltip="SIGKILL the agent (asks first)"),
    Binding("s", "start_stop", "Start/Stop", id="start-stop", tooltip="Start or stop the agent"),
    Binding("R", "restart_agent", "Restart", id="restart", tooltip="Restart the agent"),
    Binding("enter", "inspect", "Inspect", id="inspect", tooltip="Last tokens, trip, logs"),
    Binding("l", "logs", "Logs", id="logs", tooltip="The agent's log tail"),
    Binding("slash", "filter", "Filter", id="filter", tooltip="Filter rows by name or state"),
    Binding("p", "pid_prompt", "PID", id="pid", tooltip="Freeze/resume any PID"),
    Binding("o", "sort_next", "Sort", id="sort", tooltip="Sort by the next column"),
    Binding("O", "sort_reverse", "Rev", id="sort-reverse", show=False,
            tooltip="Reverse the sort order"),
    Binding("v", "next_panel", "Panel", id="panel", tooltip="Next side panel (compact layout)"),
    Binding("j", "cursor_down", "Down", id="down", show=False, tooltip="Next row"),
    Binding("k", "cursor_up", "Up", id="up", show=False, tooltip="Previous row"),
]
"""The main screen's bindings, in help-screen order."""

MUTATING_ACTIONS: frozenset[str] = frozenset({
    "freeze_agent", "resume_agent", "resume_warn", "toggle_freeze", "kill_agent", "start_stop",
    "restart_agent", "pid_prompt",
})
"""Actions that change the fleet: greyed out (disabled, still shown) under `--readonly`."""

BINDING_IDS: frozenset[str] = frozenset(b.id for b in APP_BINDINGS if b.id)
"""Ids accepted in `ui: keys:`."""


def unknown_ids(keymap: dict[str, str]) -> list[str]:
    """Keymap ids that name no binding (reported instead of silently ignored)."""
    return sorted(set(keymap) - BINDING_IDS)
