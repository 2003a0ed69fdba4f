"""fleettop's Textual app: renders snapshots from a `FleetClient` and sends it commands.

The app depends only on the client interface (snapshot / command / events / readonly). Polls
run in a worker and the next one is scheduled only after the previous one finished, so they
never overlap and the UI never waits on the supervisor.
"""

from __future__ import annotations

import time
from typing import Any

from textual import on, work
from textual.app import App, ComposeResult, ScreenStackError
from textual.containers import Container, Horizontal
from textual.geometry import Size
from textual.reactive import reactive
from textual.timer import Timer
from textual.widgets import Button, Footer, Input, Static

from fleettop.supervisor.control.api import FleetClient, mutates

from . import format as fmt
from .bindings import APP_BINDINGS, MUTATING_ACTIONS, unknown_ids
from .columns import COLUMN_KEYS, columns_for
from .messages import (
    AgentFrozen,
    CommandIssued,
    CommandReplied,
    FleetEventArrived,
    LoopTripped,
    SnapshotArrived,
    SnapshotFailed,
)
from .screens import (
    ConfirmKillScreen,
    HelpScreen,
    InspectorScreen,
    LogScreen,
    PidScreen,
    QuitScreen,
)
from .widgets import AgentsTable, EventsPanel, LeakPanel, LockPanel, Panel, StatusLine, VramPanel

MIN_SIZE = (60, 16)
"""Below this the app shows "too small, need W×H" instead of a broken layout."""
WIDE_SIZE = (110, 32)
"""From this size on every panel is shown; below it the compact layout shows one at a time."""
PANELS = ["lock", "vram", "leaks", "events"]
LIVE_STATES = {"running", "starting", "frozen", "waiting", "backoff", "stopping"}
"""States in which `s` stops rather than starts."""
REFRESH_KINDS = ("agent.", "breaker.", "lock.", "gpu.")
"""Event kinds that trigger an early poll, so a freeze shows before the next tick."""


class FleettopApp(App[str | None]):
    """The fleet view. Returns the quit choice for frozen agents ("resume", "stop") or None."""

    CSS_PATH = "fleettop.tcss"
    TITLE = "fleettop"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = APP_BINDINGS  # type: ignore[assignment]

    compact: reactive[bool] = reactive(False)
    """Compact layout (80×24): fewer columns, one side panel at a time."""
    too_small: reactive[bool] = reactive(False)
    """Terminal below MIN_SIZE: only the "too small" notice is shown."""

    def __init__(self, client: FleetClient, *, readonly: bool = False, refresh_s: float = 1.0,
                 keymap: dict[str, str] | None = None) -> None:
        super().__init__()
        self.client = client
        self.readonly = bool(readonly or client.readonly)
        """Every mutating action is greyed out and refused."""
        self.refresh_s = max(0.1, float(refresh_s))
        self.keymap = dict(keymap or {})
        """Binding id → key overrides from the fleet file's `ui: keys:`."""
        self.snapshot: dict[str, Any] = {}
        """The last snapshot received."""
        self.error: str | None = None
        """The last poll error, shown in the status line until a poll succeeds."""
        self.watched: dict[int, str] = {}
        """External PIDs frozen/resumed with `p`: pid → "frozen" | "running"."""
        self.sort_key = "name"
        self.sort_reverse = False
        self.needle = ""
        """The `/` filter."""
        self.panel = 0
        """Index in PANELS of the side panel shown in the compact layout."""
        self.polls = 0
        self.renders = 0
        self._polling = False
        self._poll_again = False
        self._timer: Timer | None = None

    # -- layout -----------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        with Container(id="main"):
            with Horizontal(id="top"):
                yield StatusLine("connecting…", id="status")
                yield Button("Freeze", id="btn-freeze", compact=True, variant="primary",
                             disabled=self.readonly)
                yield Button("Resume", id="btn-resume", compact=True, variant="success",
                             disabled=self.readonly)
            yield AgentsTable(id="agents")
            with Container(id="panels"):
                yield LockPanel("GPU lock", id="lock", classes="panel")
                yield VramPanel("VRAM", id="vram", classes="panel")
                yield LeakPanel("leak fits", id="leaks", classes="panel")
                yield EventsPanel("events", id="events", classes="panel")
            yield Input(placeholder="filter: name, state or model (esc clears)", id="filter")
        yield Static("", id="too-small")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        bad = unknown_ids(self.keymap)
        if bad:
            self.notify(f"ui.keys: unknown binding ids {', '.join(bad)}", severity="warning")
        self.set_keymap({k: v for k, v in self.keymap.items() if k not in bad})
        self.query_one("#filter", Input).display = False
        self._apply_size(self.size)
        self.table.focus()
        self.request_poll()
        self._follow_events()

    def on_resize(self, event: Any) -> None:
        self._apply_size(event.size)

    def _apply_size(self, size: Size) -> None:
        self.too_small = size.width < MIN_SIZE[0] or size.height < MIN_SIZE[1]
        self.compact = size.width < WIDE_SIZE[0] or size.height < WIDE_SIZE[1]
        if self.too_small:
            self.query_one("#too-small", Static).update(
                f"too small, need {MIN_SIZE[0]}×{MIN_SIZE[1]} (now {size.width}×{size.height})")

    def watch_too_small(self, value: bool) -> None:
        self.query_one("#main").display = not value
        self.query_one("#too-small").display = value
        if not value and self.snapshot:
            self._render()

    def watch_compact(self, value: bool) -> None:
        self.query_one("#main").set_class(value, "-compact")
        self._show_panel()
        self.refresh_bindings()
        if self.snapshot:
            self._render()

    def _show_panel(self) -> None:
        for i, pid in enumerate(PANELS):
            self.query_one(f"#{pid}").set_class(i == self.panel, "current")

    @property
    def table(self) -> AgentsTable:
        return self.screen_stack[0].query_one("#agents", AgentsTable)

    def _main_mounted(self) -> bool:
        """Whether the main screen's widgets are there to render into. A snapshot can arrive
        before they are mounted (start-up) or after they are gone (exit): it is kept, and the
        next render shows it. Rendering always targets the main screen, under any other."""
        if not self.is_running:
            return False
        try:
            return bool(self.screen_stack[0].query("#agents"))
        except (ScreenStackError, IndexError):
            return False

    # -- polling ----------------------------------------------------------------------------

    def request_poll(self) -> None:
        """Poll now, or right after the poll in flight: never two at once."""
        if self._polling:
            self._poll_again = True
            return
        if self._timer is not None:
            self._timer.stop()
            self._timer = None
        self._polling = True
        self._poll()

    @work(group="poll")
    async def _poll(self) -> None:
        try:
            snap = await self.client.snapshot()
        except Exception as exc:  # the viewer outlives a supervisor hiccup
            self.post_message(SnapshotFailed(f"{type(exc).__name__}: {exc}"))
        else:
            self.post_message(SnapshotArrived(snap))
        finally:
            self.polls += 1
            self._polling = False
            if self._poll_again:
                self._poll_again = False
                self.call_later(self.request_poll)
            else:
                self._timer = self.set_timer(self.refresh_s, self.request_poll)

    @work(group="events")
    async def _follow_events(self) -> None:
        try:
            async for event in self.client.events():
                self.post_message(FleetEventArrived(event))
        except Exception as exc:  # no stream: polling alone still works
            self.log.warning(f"event stream ended: {exc}")

    def on_fleet_event_arrived(self, message: FleetEventArrived) -> None:
        kind, ev = message.kind, message.event
        if kind == "agent.frozen":
            self.post_message(AgentFrozen(ev.get("agent"), str(ev.get("reason", ""))))
        elif kind == "breaker.trip":
            self.post_message(LoopTripped(ev.get("agent"), str(ev.get("reason", ""))))
        if kind.startswith(REFRESH_KINDS):
            self.request_poll()

    def on_loop_tripped(self, message: LoopTripped) -> None:
        self.notify(f"{message.agent} tripped: {message.reason}", severity="error", timeout=6)

    def on_snapshot_arrived(self, message: SnapshotArrived) -> None:
        self.snapshot = message.snapshot
        self.error = None
        self._render()

    def on_snapshot_failed(self, message: SnapshotFailed) -> None:
        self.error = message.error
        self._render()

    # -- rendering --------------------------------------------------------------------------

    def rows(self) -> list[dict[str, Any]]:
        """Agents from the snapshot plus watched external PIDs (not already an agent's)."""
        agents = list(self.snapshot.get("agents") or [])
        known = {a.get("pid") for a in agents} | {
            p for a in agents for p in (a.get("pids") or [])}
        for pid, state in sorted(self.watched.items()):
            if pid not in known:
                agents.append({"name": f"pid:{pid}", "state": "external", "ext_state": state,
                               "pid": pid, "source": "external"})
        return agents

    def _render(self) -> None:
        if not self._main_mounted() or self.too_small:
            return
        snap, now = self.snapshot, self._now()
        main = self.screen_stack[0]
        with self.batch_update():
            self.table.show(self.rows(), compact=self.compact, sort_key=self.sort_key,
                            reverse=self.sort_reverse, needle=self.needle)
            note = f"filter '{self.needle}'" if self.needle else ""
            main.query_one(StatusLine).show(snap, readonly=self.readonly, error=self.error,
                                            note=note)
            if snap:
                for panel in main.query(Panel):
                    panel.show(snap, now)
            screen = self.screen
            if isinstance(screen, InspectorScreen):
                agent = self.agent(screen.agent_name)
                if agent is not None:
                    screen.update_agent(agent)
        self.renders += 1

    def _now(self) -> float:
        return float(self.snapshot.get("now") or time.time())

    # -- targets ----------------------------------------------------------------------------

    def agent(self, name: str | None) -> dict[str, Any] | None:
        """The row dict (agent or watched PID) with this name."""
        return next((a for a in self.rows() if a.get("name") == name), None)

    def target(self) -> dict[str, Any] | None:
        """What an action applies to: the inspected agent, else the selected row."""
        screen = self.screen
        if isinstance(screen, InspectorScreen):
            return self.agent(screen.agent_name) or screen.agent
        return self.agent(self.table.selected_name)

    @staticmethod
    def _addressed(cmd: str, agent: dict[str, Any]) -> dict[str, Any]:
        if agent.get("state") == "external":
            return {"cmd": cmd, "pid": agent["pid"]}
        return {"cmd": cmd, "name": agent["name"]}

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if self.readonly and action in MUTATING_ACTIONS:
            return None  # shown greyed out, refused
        if action == "next_panel":
            return self.compact
        return True

    # -- commands ---------------------------------------------------------------------------

    def send(self, request: dict[str, Any]) -> None:
        """Send a command in a worker; the reply comes back as CommandReplied."""
        if self.readonly and mutates(request):
            self.notify("read-only viewer", severity="warning")
            return
        self.post_message(CommandIssued(request))
        self._command(request)

    @work(group="commands")
    async def _command(self, request: dict[str, Any]) -> None:
        try:
            reply = await self.client.command(request)
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        self.post_message(CommandReplied(request, reply))

    def on_command_replied(self, message: CommandReplied) -> None:
        req, reply = message.request, message.reply
        if not reply.get("ok", False):
            self.notify(f"{req.get('cmd')}: {reply.get('error', 'failed')}", severity="error")
            return
        if req.get("cmd") == "logs":
            lines = reply.get("lines", reply.get("logs", []))
            if isinstance(lines, str):
                lines = lines.splitlines()
            for screen in self.screen_stack:
                if isinstance(screen, InspectorScreen | LogScreen) and (
                        getattr(screen, "agent_name", None) == req.get("name")):
                    screen.set_logs([str(x) for x in lines])
            return
        if "pid" in req and req.get("cmd") in ("freeze", "resume"):
            self.watched[int(req["pid"])] = "frozen" if req["cmd"] == "freeze" else "running"
        if req.get("cmd") != "shutdown":
            self.request_poll()

    # -- actions ----------------------------------------------------------------------------

    def _need_target(self) -> dict[str, Any] | None:
        agent = self.target()
        if agent is None:
            self.notify("no agent selected", severity="warning")
        return agent

    def action_freeze_agent(self) -> None:
        if agent := self._need_target():
            self.send(self._addressed("freeze", agent))

    def action_resume_agent(self) -> None:
        if agent := self._need_target():
            self.send(self._addressed("resume", agent))

    def action_resume_warn(self) -> None:
        """Resume, and for 10 minutes let its loops warn instead of freezing it at once."""
        if agent := self._need_target():
            self.send({**self._addressed("resume", agent), "breaker": "warn", "for": "10m"})

    def action_toggle_freeze(self) -> None:
        if agent := self._need_target():
            frozen = fmt.display_state(agent) in ("frozen", "tripped") or (
                agent.get("ext_state") == "frozen")
            self.send(self._addressed("resume" if frozen else "freeze", agent))

    def action_kill_agent(self) -> None:
        agent = self._need_target()
        if agent is None:
            return
        req = self._addressed("stop", agent) | {"signal": "KILL"}

        def answered(yes: bool | None) -> None:
            if yes:
                self.send(req)

        self.push_screen(ConfirmKillScreen(str(agent["name"])), answered)

    def action_start_stop(self) -> None:
        if agent := self._need_target():
            live = agent.get("state") in LIVE_STATES or agent.get("state") == "external"
            self.send(self._addressed("stop" if live else "start", agent))

    def action_restart_agent(self) -> None:
        if agent := self._need_target():
            self.send(self._addressed("restart", agent))

    def action_inspect(self) -> None:
        agent = self._need_target()
        if agent is None or isinstance(self.screen, InspectorScreen):
            return
        self.push_screen(InspectorScreen(agent, readonly=self.readonly))
        if agent.get("state") != "external":
            self.send({"cmd": "logs", "name": agent["name"], "n": 100})

    def action_logs(self) -> None:
        agent = self._need_target()
        if agent is None or agent.get("state") == "external":
            return
        self.push_screen(LogScreen(str(agent["name"])))
        self.send({"cmd": "logs", "name": agent["name"], "n": 200})

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = True
        self.screen.set_focus(box)  # now, so keys typed right after `/` land in the box

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self.needle = event.value.strip()
        self._render()

    @on(Input.Submitted, "#filter")
    def _filter_done(self) -> None:
        self.query_one("#filter", Input).display = False
        self.table.focus()

    def on_key(self, event: Any) -> None:
        box = self.query_one("#filter", Input)
        if event.key == "escape" and box.has_focus:
            box.value = ""
            box.display = False
            self.table.focus()
            event.stop()

    def action_pid_prompt(self) -> None:
        def answered(choice: tuple[str, int] | None) -> None:
            if choice:
                cmd, pid = choice
                self.send({"cmd": cmd, "pid": pid})

        self.push_screen(PidScreen(), answered)

    def action_sort_next(self) -> None:
        i = COLUMN_KEYS.index(self.sort_key)
        visible = [c.key for c in columns_for(self.compact)]
        keys = [k for k in COLUMN_KEYS[i + 1:] + COLUMN_KEYS[: i + 1] if k in visible]
        self.sort_key = keys[0]
        self.notify(f"sort by {self.sort_key}", timeout=1.5)
        self._render()

    def action_sort_reverse(self) -> None:
        self.sort_reverse = not self.sort_reverse
        self._render()

    @on(AgentsTable.HeaderSelected)
    def _header_clicked(self, event: AgentsTable.HeaderSelected) -> None:
        key = event.column_key
        if key == self.sort_key:
            self.sort_reverse = not self.sort_reverse
        else:
            self.sort_key, self.sort_reverse = key, False
        self._render()

    @on(AgentsTable.RowSelected)
    def _row_selected(self) -> None:
        self.action_inspect()

    def action_cursor_down(self) -> None:
        self.table.action_cursor_down()

    def action_cursor_up(self) -> None:
        self.table.action_cursor_up()

    def action_next_panel(self) -> None:
        self.panel = (self.panel + 1) % len(PANELS)
        self._show_panel()

    def action_help(self) -> None:
        keys = {b.id: b.key for b in APP_BINDINGS if b.id} | self.keymap
        self.push_screen(HelpScreen(keys, readonly=self.readonly))

    @on(Button.Pressed, "#btn-freeze")
    async def _freeze_clicked(self) -> None:
        await self.run_action("freeze_agent")

    @on(Button.Pressed, "#btn-resume")
    async def _resume_clicked(self) -> None:
        await self.run_action("resume_agent")

    def frozen_agents(self) -> list[str]:
        return [str(a.get("name")) for a in self.snapshot.get("agents") or []
                if a.get("state") == "frozen"]

    def action_quit_fleet(self) -> None:
        frozen = self.frozen_agents()
        if self.readonly or self.client.viewer or not frozen:  # a viewer never stops the fleet
            self.exit(None)
            return

        def answered(choice: str | None) -> None:
            if choice is not None:
                self._send_shutdown(choice)

        self.push_screen(QuitScreen(frozen), answered)

    @work(group="commands")
    async def _send_shutdown(self, choice: str) -> None:
        request = {"cmd": "shutdown", "frozen": choice}
        self.post_message(CommandIssued(request))
        try:
            reply = await self.client.command(request)
        except Exception as exc:
            reply = {"ok": False, "error": str(exc)}
        self.post_message(CommandReplied(request, reply))
        self.exit(choice)


def run_app(client: FleetClient, *, readonly: bool = False, refresh_s: float = 1.0,
            keymap: dict[str, str] | None = None) -> int:
    """Run the UI until the user quits; 0 on a normal quit.

    The quit choice for frozen agents reaches the supervisor as the command
    `{"cmd": "shutdown", "frozen": "resume" | "stop"}` (sent only when agents are frozen).
    """
    app = FleettopApp(client, readonly=readonly, refresh_s=refresh_s, keymap=keymap)
    app.run()
    return int(app.return_code or 0)


async def run_app_async(client: FleetClient, *, readonly: bool = False, refresh_s: float = 1.0,
                        keymap: dict[str, str] | None = None) -> int:
    """`run_app` inside an already running event loop (the supervisor's, in-process)."""
    app = FleettopApp(client, readonly=readonly, refresh_s=refresh_s, keymap=keymap)
    await app.run_async()
    return int(app.return_code or 0)
