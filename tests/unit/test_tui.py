"""Pilot tests of the terminal UI against the deterministic fake client.

Each binding is pressed and the test asserts on the command the fake supervisor received and on
what the screen then shows. Text snapshots at 80×24 and 120×40 live in tests/unit/data/tui/;
regenerate them with FLEETTOP_UPDATE_SNAPSHOTS=1 after an intended layout change.
"""

from __future__ import annotations

import asyncio
import difflib
import io
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from rich.text import Text
from textual.message import Message
from textual.pilot import Pilot
from textual.widgets import Button, Input, Static

from fleettop.tui import format as fmt
from fleettop.tui.app import FleettopApp
from fleettop.tui.bindings import APP_BINDINGS, MUTATING_ACTIONS, unknown_ids
from fleettop.tui.messages import CommandIssued, SnapshotArrived
from fleettop.tui.screens import (
    ConfirmKillScreen,
    HelpScreen,
    InspectorScreen,
    LogScreen,
    QuitScreen,
    highlighted_tokens,
)
from fleettop.tui.widgets import AgentsTable, EventsPanel, LeakPanel, LockPanel, VramPanel
from tests.support.fake_fleet import LOOP, FakeFleet, tripped_text

DATA = Path(__file__).parent / "data" / "tui"
WIDE = (120, 40)
SMALL = (80, 24)


@pytest.fixture(autouse=True)
def _utc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()


def screen_text(app: FleettopApp) -> str:
    """The screen as plain text, one line per terminal row."""
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=True,
                      color_system=None, record=True, legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(
        full=True, screen_stack=app._background_screens))
    return "\n".join(line.rstrip() for line in console.export_text().splitlines())


async def until(pilot: Pilot[Any], cond: Callable[[], bool], within: float = 15.0) -> None:
    """Let the app run until `cond()` holds (fails the test after `within` s)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not met in time")
        await pilot.pause(0.02)


class Harness:
    """An app on a fake fleet plus the messages it posted."""

    def __init__(self, fleet: FakeFleet | None = None, **kwargs: Any) -> None:
        self.fleet = fleet or FakeFleet()
        kwargs.setdefault("refresh_s", 30.0)  # tests poll explicitly (commands, events)
        self.app = FleettopApp(self.fleet, **kwargs)
        self.messages: list[Message] = []

    def run(self, size: tuple[int, int] = WIDE) -> Any:
        return self.app.run_test(size=size, message_hook=self.messages.append)

    @property
    def issued(self) -> list[dict[str, Any]]:
        return [m.request for m in self.messages if isinstance(m, CommandIssued)]

    def row_text(self, name: str) -> list[str]:
        table = self.app.screen_stack[0].query_one(AgentsTable)
        return [str(c) for c in table.get_row(name)]

    async def ready(self, pilot: Pilot[Any]) -> None:
        await until(pilot, lambda: self.app.renders > 0 and bool(self.app.snapshot))

    async def select(self, pilot: Pilot[Any], name: str) -> None:
        table = self.app.query_one(AgentsTable)
        table.move_cursor(row=table.get_row_index(name))
        await pilot.pause()
        assert table.selected_name == name


async def command_sent(pilot: Pilot[Any], h: Harness, req: dict[str, Any]) -> None:
    await until(pilot, lambda: req in h.fleet.commands)
    assert req in h.issued


# -- table and panels --------------------------------------------------------------------------

async def test_table_shows_every_state_with_a_word() -> None:
    h = Harness()
    async with h.run() as pilot:
        await h.ready(pilot)
        shown = {name: h.row_text(name)[1] for name, _, _ in
                 [(a["name"], 0, 0) for a in h.fleet.agents]}
        assert shown["summarizer"] == "● run"
        assert shown["coder"] == "⚡ TRIPPED"
        assert shown["indexer"] == "❚❚ FROZEN"
        assert shown["embedder"] == "⧗ wait-gpu"
        assert shown["nightly-report"].startswith("◷ sched ")
        assert shown["crawler"] == "↻ backoff"
        assert shown["translator"] == "✓ exit 0"
        assert shown["scraper"] == "✗ exit 3"
        assert shown["mailer"] == "✗ FAILED"
        row = h.row_text("summarizer")
        assert row[:5] == ["summarizer", "● run", "4100", "12", "180M"]
        assert "+2.5" in row  # leak slope MiB/min
        assert h.row_text("ocr")[4] == "n/a"


async def test_panels_lock_vram_leaks_events() -> None:
    h = Harness()
    async with h.run() as pilot:
        await h.ready(pilot)
        lock = h.app.query_one(LockPanel).text
        assert "held vision qwen2.5:7b for 42s" in lock
        assert lock.index("1. embedder bge-m3 waits 30s") < lock.index("2. planner")
        vram = h.app.query_one(VramPanel).text
        assert "GPU0 RTX 3060" in vram and "4.5G/6.0G 63%" in vram and "4177 vision 4.0G" in vram
        leaks = h.app.query_one(LeakPanel).text
        assert "summarizer" in leaks and "+2.5MiB/m" in leaks and "R²0.98" in leaks
        assert "lim 7m" in leaks and "fit" in leaks
        events = h.app.query_one(EventsPanel).text.splitlines()
        assert "governor.level" in events[0] and "agent.state summarizer" in events[-1]


async def test_absent_capabilities_say_not_available_with_reason() -> None:
    h = Harness(FakeFleet(gpu=False, lock=False, leaks=False))
    async with h.run() as pilot:
        await h.ready(pilot)
        assert h.app.query_one(VramPanel).text == "no GPU: NVML library not found"
        assert h.app.query_one(LockPanel).text == (
            "not available: gpu lock disabled in fleet.yaml")
        assert h.app.query_one(LeakPanel).text.startswith("not available")


async def test_only_changed_cells_are_written() -> None:
    h = Harness()
    async with h.run() as pilot:
        await h.ready(pilot)
        table = h.app.query_one(AgentsTable)
        before, renders = table.cell_updates, h.app.renders
        h.app.request_poll()  # nothing changed
        await until(pilot, lambda: h.app.renders > renders)
        assert table.cell_updates == before
        h.fleet.agents[0]["cpu_percent"] = 77.0
        renders = h.app.renders
        h.app.request_poll()
        await until(pilot, lambda: h.app.renders > renders)
        assert table.cell_updates == before + 1
        assert h.row_text("summarizer")[3] == "77"


async def test_a_poll_draws_one_frame_and_an_idle_poll_none() -> None:
    h = Harness(FakeFleet(40, gpu=False))  # a VRAM history would grow by a sample per poll
    frames: list[Any] = []
    async with h.run() as pilot:
        await h.ready(pilot)
        display = h.app._display  # every frame the compositor hands to the terminal

        def counted(screen: Any, update: Any) -> None:
            if update is not None:
                frames.append(update)
            display(screen, update)

        h.app._display = counted  # type: ignore[method-assign]
        for _ in range(40):  # start-up settles (footer, scrollbars), then nothing is drawn
            frames.clear()
            await pilot.pause(0.3)
            if not frames:
                break
        assert frames == [], "the screen repaints between polls"
        renders = h.app.renders
        h.app.request_poll()  # nothing changed: nothing is drawn
        await until(pilot, lambda: h.app.renders > renders)
        await pilot.pause(0.3)
        assert frames == [], [f.spans for f in frames]
        for a in h.fleet.agents:
            if a["state"] == "running":
                a["cpu_percent"] = 77.0
        renders = h.app.renders
        h.app.request_poll()  # every running row changes: still one frame
        await until(pilot, lambda: h.app.renders > renders)
        await pilot.pause(0.3)
        assert len(frames) == 1


async def test_polls_never_overlap_and_events_trigger_a_poll() -> None:
    fleet = FakeFleet()
    inflight = peak = 0
    real = fleet.snapshot

    async def slow_snapshot() -> dict[str, Any]:
        nonlocal inflight, peak
        inflight += 1
        peak = max(peak, inflight)
        await asyncio.sleep(0.05)
        try:
            return await real()
        finally:
            inflight -= 1

    fleet.snapshot = slow_snapshot  # type: ignore[method-assign]
    h = Harness(fleet)
    async with h.run() as pilot:
        await h.ready(pilot)
        for _ in range(5):
            h.app.request_poll()
        fleet.set_state("vision", "frozen", reason="breaker")  # emits agent.state
        await until(pilot, lambda: h.row_text("vision")[1] == "❚❚ FROZEN")
        assert peak == 1
        assert any(isinstance(m, SnapshotArrived) for m in h.messages)


async def test_a_snapshot_before_or_after_the_widgets_is_kept_not_a_crash() -> None:
    """The start-up race: a snapshot that arrives while the main widgets are not mounted
    (before the app runs, or once it has exited) is kept and shown at the next render."""
    fleet = FakeFleet()
    app = FleettopApp(fleet, refresh_s=30.0)
    snap = await fleet.snapshot()
    app.on_snapshot_arrived(SnapshotArrived(snap))  # not running: no screen yet
    assert app.snapshot is snap and app.renders == 0
    h = Harness(fleet)
    async with h.run() as pilot:
        await h.ready(pilot)
        renders = h.app.renders
    h.app.on_snapshot_arrived(SnapshotArrived(snap))  # exited: widgets gone
    assert h.app.renders == renders


async def test_snapshots_render_into_the_table_under_the_inspector() -> None:
    h = Harness()
    async with h.run() as pilot:
        await h.ready(pilot)
        await h.select(pilot, "coder")
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(h.app.screen, InspectorScreen))
        renders = h.app.renders
        h.fleet.set_state("summarizer", "frozen", reason="test")
        await until(pilot, lambda: h.app.renders > renders
                    and h.row_text("summarizer")[1] == "❚❚ FROZEN")
        assert isinstance(h.app.screen, InspectorScreen)


async def test_periodic_refresh_shows_a_change_within_one_refresh() -> None:
    fleet = FakeFleet()
    h = Harness(fleet, refresh_s=0.2)
    async with h.run() as pilot:
        await h.ready(pilot)
        fleet.agents[0]["state"] = "stopped"  # no event: only the timer can show it
        await until(pilot, lambda: h.row_text("summarizer")[1] == "■ stopped", within=2)


# -- keys --------------------------------------------------------------------------------------

async def test_f_freezes_and_r_resumes_the_selected_agent() -> None:
    h = Harness()
    async with h.run() as pilot:
        await h.ready(pilot)
        await h.select(pilot, "summarizer")
        await pilot.press("f")
        await command_sent(pilot, h, {"cmd": "freeze", "name": "summarizer"})
        await until(pilot, lambda: h.row_text("summarizer")[1] == "❚❚ FROZEN")
        await pilot.press("r")
        await command_sent(pilot, h, {"cmd": "resume", "name": "summarizer"})
        await until(pilot, lambda: h.row_text("summarizer")[1] == "● run")


async def test_space_toggles() -> None:
    h = Harness()
    async with h.run() as pilot:
        await h.ready(pilot)
        await h.select(pilot, "coder")  # tripped → resume
        await pilot.press("space")
        await command_sent(pilot, h, {"cmd": "resume", "name": "coder"})
        await h.select(pilot, "vision")  # running → freeze
        await pilot.press("space")
        await command_sent(pilot, h, {"cmd": "freeze", "name": "vision"})


async def test_ctrl_k_kills_only_after_confirmation_and_j_k_move() -> None:
    h = Harness()
    async with h.run() as pilot:
        await h.ready(pilot)
        table = h.app.table
        table.move_cursor(row=0)
        await pilot.pause()
        await pilot.press("j")  # vim/k9s navigation: j/k move, they never kill
        await until(pilot, lambda: table.cursor_row == 1)
        await pilot.press("k")
        await until(pilot, lambda: table.cursor_row == 0)
        assert not isinstance(h.app.screen, ConfirmKillScreen)
        await h.select(pilot, "vision")
        await pilot.press("ctrl+k")
        await until(pilot, lambda: isinstance(h.app.screen, ConfirmKillScreen))
        assert "SIGKILL agent vision" in screen_text(h.app)
        await pilot.press("n")
        await until(pilot, lambda: not isinstance(h.app.screen, ConfirmKillScreen))
        assert not any(c["cmd"] == "stop" for c in h.fleet.commands)
        await pilot.press("ctrl+k")
        await until(pilot, lambda: isinstance(h.app.screen, ConfirmKillScreen))
        await pilot.press("y")
        await command_sent(pilot, h, {"cmd": "stop", "name": "vision", "signal": "KILL"})


async def test_s_stops_a_live_agent_and_starts_a_stopped_one() -> None:
    h = Harness()
    async with h.run() as pilot:
        await h.ready(pilot)
        await h.select(pilot, "vision")
        await pilot.press("s")
        await command_sent(pilot, h, {"cmd": "stop", "name": "vision"})
        await h.select(pilot, "ocr")
        await pilot.press("s")
        await command_sent(pilot, h, {"cmd": "start", "name": "ocr"})


async def test_shift_r_restarts() -> None:
    h = Harness()
    async with h.run() as pilot:
        await h.ready(pilot)
        await h.select(pilot, "crawler")
        await pilot.press("R")
        await command_sent(pilot, h, {"cmd": "restart", "name": "crawler"})


async def test_enter_opens_inspector_with_loop_highlighted_and_logs() -> None:
    h = Harness()
    async with h.run() as pilot:
        await h.ready(pilot)
        await h.select(pilot, "coder")
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(h.app.screen, InspectorScreen))
        await command_sent(pilot, h, {"cmd": "logs", "name": "coder", "n": 100})
        screen = h.app.screen
        assert isinstance(screen, InspectorScreen)
        await until(pilot, lambda: screen.log_lines is not None)
        tokens = screen.query_one("#inspector-tokens", Static).content
        assert isinstance(tokens, Text) and len(tokens.plain) >= 8 * 1024
        _, start, end = tripped_text()
        assert any("reverse" in str(s.style) and (s.start, s.end) == (start, end)
                   for s in tokens.spans)
        await pilot.pause(0.1)
        text = screen_text(h.app)
        assert "token_loop: token loop: 40 repeats of 48 chars" in text
        assert "span_start:" in text and "repeats: 40" in text
        assert LOOP.strip() in text  # the end of the last tokens is scrolled into view
        assert "source: ebpf" in text and "ctx switches/s: 121" in text
        requests = screen.query_one("#inspector-requests", Static).content
        assert "authorization=[redacted]" in str(requests)
        assert "coder log line 99" in str(screen.query_one("#inspector-logs", Static).content)
        # f in the inspector acts on the inspected agent; escape closes
        await pilot.press("f")
        await command_sent(pilot, h, {"cmd": "freeze", "name": "coder"})
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(h.app.screen, InspectorScreen))


async def test_inspector_buttons_resume() -> None:
    h = Harness()
    async with h.run() as pilot:
        await h.ready(pilot)
        await h.select(pilot, "indexer")
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(h.app.screen, InspectorScreen))
        await pilot.click("#inspector-resume")
        await command_sent(pilot, h, {"cmd": "resume", "name": "indexer"})
        await until(pilot, lambda: "● run" in str(
            h.app.screen.query_one("#inspector-title").content))


def test_highlight_clamps_offsets() -> None:
    text = highlighted_tokens("abcdef", {"evidence": {"span_start": 2, "span_end": 99}})
    assert [(s.start, s.end) for s in text.spans] == [(2, 6)]
    assert highlighted_tokens("abc", None).spans == []


async def test_l_shows_logs() -> None:
    h = Harness()
    async with h.run() as pilot:
        await h.ready(pilot)
        await h.select(pilot, "vision")
        await pilot.press("l")
        await command_sent(pilot, h, {"cmd": "logs", "name": "vision", "n": 200})
        await until(pilot, lambda: "vision log line 199" in screen_text(h.app))
        assert isinstance(h.app.screen, LogScreen)
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(h.app.screen, LogScreen))


async def test_slash_filters_and_escape_clears() -> None:
    h = Harness()
    async with h.run() as pilot:
        await h.ready(pilot)
        table = h.app.query_one(AgentsTable)
        await pilot.press("slash")
        assert h.app.query_one("#filter", Input).has_focus
        await pilot.press(*"froz")
        await until(pilot, lambda: table.row_count == 1)
        assert table.selected_name == "indexer"
        await pilot.press("enter")  # keep the filter, back to the table
        assert table.has_focus and table.row_count == 1
        await pilot.press("slash", "escape")
        await until(pilot, lambda: table.row_count == len(h.fleet.agents))


async def test_p_freezes_any_pid_and_shows_a_watched_row() -> None:
    h = Harness()
    async with h.run() as pilot:
        await h.ready(pilot)
        await pilot.press("p")
        await pilot.press(*"9999", "enter")
        await command_sent(pilot, h, {"cmd": "freeze", "pid": 9999})
        await until(pilot, lambda: h.app.query_one(AgentsTable).get_row_index("pid:9999") >= 0)
        assert h.row_text("pid:9999")[1] == "◇ ext frozen"
        await h.select(pilot, "pid:9999")
        await pilot.press("r")
        await command_sent(pilot, h, {"cmd": "resume", "pid": 9999})
        await until(pilot, lambda: h.row_text("pid:9999")[1] == "◇ ext running")


async def test_q_asks_about_frozen_agents_resume_then_stop() -> None:
    h = Harness()
    async with h.run() as pilot:
        await h.ready(pilot)
        await pilot.press("q")
        await until(pilot, lambda: isinstance(h.app.screen, QuitScreen))
        assert "2 frozen: coder, indexer" in screen_text(h.app)
        await pilot.press("escape")  # cancel
        await until(pilot, lambda: not isinstance(h.app.screen, QuitScreen))
        await pilot.press("q")
        await until(pilot, lambda: isinstance(h.app.screen, QuitScreen))
        await pilot.press("r")
        await until(pilot, lambda: h.app.return_value == "resume")
    assert h.fleet.commands[-1] == {"cmd": "shutdown", "frozen": "resume"}


async def test_q_in_a_viewer_just_leaves() -> None:
    """A viewer's `q` asked "Quit and stop the fleet" and then left it running: a viewer
    never stops the fleet, so it asks nothing and sends no shutdown."""
    h = Harness(FakeFleet(viewer=True))
    async with h.run() as pilot:
        await h.ready(pilot)
        assert h.app.frozen_agents()
        await pilot.press("q")
        await until(pilot, lambda: not h.app.is_running)
    assert not any(c.get("cmd") == "shutdown" for c in h.fleet.commands)


async def test_q_stop_choice_by_click() -> None:
    h = Harness()
    async with h.run() as pilot:
        await h.ready(pilot)
        await pilot.press("q")
        await until(pilot, lambda: isinstance(h.app.screen, QuitScreen))
        await pilot.click("#quit-stop")
        await until(pilot, lambda: h.app.return_value == "stop")
    assert h.fleet.commands[-1] == {"cmd": "shutdown", "frozen": "stop"}


async def test_q_without_frozen_agents_just_quits() -> None:
    fleet = FakeFleet()
    for a in fleet.agents:
        if a["state"] == "frozen":
            a["state"] = "running"
    h = Harness(fleet)
    async with h.run() as pilot:
        await h.ready(pilot)
        await pilot.press("q")
        await until(pilot, lambda: not h.app.is_running)
    assert h.app.return_value is None and fleet.commands == []


async def test_help_lists_every_binding_id() -> None:
    h = Harness()
    async with h.run() as pilot:
        await h.ready(pilot)
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(h.app.screen, HelpScreen))
        text = screen_text(h.app)
        for b in APP_BINDINGS:
            assert f"[{b.id}]" in text
        # Keys as the footer writes them, not Textual's names for them.
        assert "slash" not in text and "question_mark" not in text
        assert "/  Filter" in text and "?  Help" in text
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(h.app.screen, HelpScreen))


async def test_sort_keys_and_header_click() -> None:
    h = Harness()
    async with h.run() as pilot:
        await h.ready(pilot)
        table = h.app.query_one(AgentsTable)
        first = table.row_names[0]
        assert first == "coder"
        await pilot.press("O")  # reverse
        await until(pilot, lambda: table.row_names[0] == "vision")
        await pilot.press("o")  # name → state
        assert h.app.sort_key == "state"
        await pilot.click("#agents", offset=(33, 0))  # the "PID" header
        await until(pilot, lambda: h.app.sort_key == "pid")
        await pilot.press("O")
        await until(pilot, lambda: table.row_names[0] == "vision")


async def test_clickable_freeze_resume_buttons() -> None:
    h = Harness()
    async with h.run() as pilot:
        await h.ready(pilot)
        await h.select(pilot, "vision")
        await pilot.click("#btn-freeze")
        await command_sent(pilot, h, {"cmd": "freeze", "name": "vision"})
        await pilot.click("#btn-resume")
        await command_sent(pilot, h, {"cmd": "resume", "name": "vision"})


async def test_command_failure_is_notified() -> None:
    h = Harness()
    async with h.run() as pilot:
        await h.ready(pilot)
        h.fleet.fail_next = "cgroup.freeze: permission denied"
        await h.select(pilot, "vision")
        await pilot.press("f")
        await until(pilot, lambda: any("permission denied" in str(n.message)
                                       for n in h.app._notifications))


# -- read-only and keymap ----------------------------------------------------------------------

async def test_readonly_greys_out_every_mutating_action() -> None:
    h = Harness(readonly=True)
    async with h.run() as pilot:
        await h.ready(pilot)
        await h.select(pilot, "vision")
        for key in ("f", "r", "space", "s", "R", "ctrl+k", "p"):
            await pilot.press(key)
        await pilot.pause(0.1)
        assert h.fleet.commands == []
        assert not isinstance(h.app.screen, ConfirmKillScreen)
        for action in MUTATING_ACTIONS:
            assert h.app.check_action(action, ()) is None
        assert h.app.query_one("#btn-freeze", Button).disabled
        assert "READ-ONLY" in screen_text(h.app)
        await pilot.press("enter")  # reading is allowed
        await command_sent(pilot, h, {"cmd": "logs", "name": "vision", "n": 100})
        assert h.app.screen.query_one("#inspector-freeze", Button).disabled


async def test_client_readonly_makes_the_app_readonly() -> None:
    h = Harness(FakeFleet(readonly=True))
    assert h.app.readonly


async def test_keymap_remaps_by_binding_id() -> None:
    h = Harness(keymap={"freeze": "x", "bogus": "z"})
    assert unknown_ids({"freeze": "x", "bogus": "z"}) == ["bogus"]
    async with h.run() as pilot:
        await h.ready(pilot)
        await h.select(pilot, "vision")
        await pilot.press("f")
        await pilot.pause(0.1)
        assert h.fleet.commands == []
        await pilot.press("x")
        await command_sent(pilot, h, {"cmd": "freeze", "name": "vision"})


# -- layout ------------------------------------------------------------------------------------

async def test_compact_layout_and_panel_cycling() -> None:
    h = Harness()
    async with h.run(SMALL) as pilot:
        await h.ready(pilot)
        assert h.app.compact
        assert len(h.row_text("summarizer")) == 8  # compact columns
        assert h.app.query_one(LockPanel).display and not h.app.query_one(VramPanel).display
        await pilot.press("v")
        assert h.app.query_one(VramPanel).display and not h.app.query_one(LockPanel).display


async def test_too_small_says_what_it_needs() -> None:
    h = Harness()
    async with h.run((50, 12)) as pilot:
        await pilot.pause(0.1)
        assert "too small, need 60×16 (now 50×12)" in screen_text(h.app)
        await pilot.resize_terminal(*SMALL)
        await until(pilot, lambda: "summarizer" in screen_text(h.app))


@pytest.mark.parametrize("size", [SMALL, WIDE], ids=["80x24", "120x40"])
async def test_snapshot(size: tuple[int, int]) -> None:
    h = Harness()
    async with h.run(size) as pilot:
        await h.ready(pilot)
        await until(pilot, lambda: "Freeze" in screen_text(h.app).splitlines()[-1])
        main = screen_text(h.app)
        await h.select(pilot, "coder")
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(h.app.screen, InspectorScreen)
                    and h.app.screen.log_lines is not None)
        await until(pilot, lambda: "Close" in screen_text(h.app).splitlines()[-1])
        await pilot.pause(0.2)
        inspector = screen_text(h.app)
    got = f"{main}\n{'=' * size[0]}\n{inspector}\n"
    path = DATA / f"screen_{size[0]}x{size[1]}.txt"
    if os.environ.get("FLEETTOP_UPDATE_SNAPSHOTS"):
        path.write_text(got)
    want = path.read_text()
    diff = "\n".join(difflib.unified_diff(want.splitlines(), got.splitlines(), lineterm=""))
    assert got == want, diff


def test_format_helpers() -> None:
    assert fmt.size(None) == "n/a" and fmt.size(3 * fmt.GIB / 2) == "1.5G"
    assert fmt.duration(45) == "45s" and fmt.duration(3900) == "1h05"
    assert fmt.sparkline([0, 1, 2, 3], 4) == "▁▃▆█"
    assert fmt.bar(1, 4, 8) == "██░░░░░░"
    assert fmt.fit_line([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert fmt.state_text({"state": "exited", "exit_code": 2}) == "✗ exit 2"


def test_ui_section_ids_match_the_bindings() -> None:
    from fleettop.supervisor.config.ui import BINDING_IDS, UiSection

    assert {b.id for b in APP_BINDINGS} == set(BINDING_IDS)
    ui = UiSection.model_validate({"refresh": "2s", "keys": {"kill": "ctrl+x"}})
    assert ui.refresh == 2.0 and ui.keys == {"kill": "ctrl+x"}
    with pytest.raises(ValueError):
        UiSection.model_validate({"keys": {"suspend_process": "z"}})


def test_core_section_does_not_import_textual() -> None:
    import subprocess
    import sys

    code = ("import sys, fleettop.supervisor.config.ui; "
            "assert 'textual' not in sys.modules and 'fleettop.tui' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


def test_lock_panel_shows_requests_queued_at_the_proxy() -> None:
    snap = {"lock": {"holder": {"agent": "proxy:alice", "model": "demo-chat", "held_s": 3},
                     "queue": [{"agent": "nightly", "waited_s": 2}]},
            "components": [{"name": "proxy", "state": "running", "gpu": {"gate": {
                "loaded": "demo-chat", "in_flight": 1, "holding": True,
                "queue": [{"agent": "bob", "model": "qwen2.5:7b", "waited_s": 4.0}]}}}]}
    text = LockPanel("GPU lock").build(snap, 0.0).plain
    assert text.splitlines() == ["held proxy:alice demo-chat for 3s", "1. nightly waits 2s",
                                 "proxy: demo-chat, 1 in flight", "  bob qwen2.5:7b waits 4s"]
    snap["components"][0]["gpu"]["gate"] = {"loaded": None, "in_flight": 0, "queue": []}
    assert "proxy" not in LockPanel("GPU lock").build(snap, 0.0).plain.replace("proxy:alice", "")


def test_money_shows_small_spends() -> None:
    from fleettop.tui import format as fmt

    assert [fmt.money(v) for v in (None, 0, 0.000116, 0.00000004, 0.0123, 12.5, 4321.7)] == [
        "n/a", "0.00", "0.0001", "<.0001", "0.01", "12.50", "4322"]


def test_trip_evidence_reads_as_rows_not_a_repr() -> None:
    from fleettop.tui.screens import _evidence_value

    hits = [{"request": 4, "distance": 0, "fingerprint": "0000000000000000"},
            {"request": 5, "distance": 2, "fingerprint": "00000000000000a1"}]
    text = _evidence_value(hits)
    assert "{" not in text and "'" not in text
    assert "request 4  distance 0" in text and "0000000000000000" not in text
    assert "fingerprint 00000000000000a1" in text
    assert _evidence_value({"tier": "exact_period", "copies": 3}) == "tier exact_period  copies 3"
    assert _evidence_value("x" * 500).endswith("…") and len(_evidence_value("x" * 500)) == 118


async def test_w_resumes_with_the_breaker_on_warn_for_ten_minutes() -> None:
    h = Harness()
    async with h.run() as pilot:
        await h.ready(pilot)
        await h.select(pilot, "indexer")  # frozen
        await pilot.press("w")
        await command_sent(pilot, h, {"cmd": "resume", "name": "indexer", "breaker": "warn",
                                      "for": "10m"})
    assert fmt.state_text({"state": "running", "breaker_relaxed": {
        "policy": "warn", "until": 0}}).startswith("● run (warn ")
