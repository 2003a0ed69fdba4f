"""The agents table: a Line-API widget that repaints only the rows whose text changed.

Textual's DataTable drops every render cache on any `update_cell` (one counter keys them all),
so a poll that changes a number in each row re-renders every cell of every row through Rich:
about 2 ms a row, 11% of a core for 50 agents at 1 Hz. Here a row is a cached `Strip` of
pre-padded segments, rebuilt only when one of its cell texts changes, and only its line is
marked dirty. It keeps what the app used from DataTable: a fixed header, a row cursor
(keys, click, click again or enter to select), header clicks to sort, scrolling.
"""

from __future__ import annotations

from typing import Any, ClassVar

from rich.cells import cell_len, set_cell_size
from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding, BindingType
from textual.geometry import Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

from . import format as fmt
from .columns import Agent, Column, columns_for, matches, ordered, row_cells

STATE_STYLES = {
    "running": "green", "frozen": "bold cyan", "tripped": "bold red", "waiting": "yellow",
    "failed": "bold red", "backoff": "magenta", "external": "blue",
}
"""State colours; the text already says the state, colour only helps."""

PAD = 1
"""Blank cells either side of every column, as DataTable draws them."""


def fit(text: str, width: int) -> str:
    """Pad or crop to exactly `width` terminal cells (wide characters count double)."""
    if cell_len(text) > width:
        return set_cell_size(text, max(0, width - 1)) + "…"
    return set_cell_size(text, width)


class AgentsTable(ScrollView, can_focus=True):
    """One row per agent, keyed by name; `show()` takes the cell texts of every row."""

    DEFAULT_CSS = """
    AgentsTable {
        background: $surface;
        color: $foreground;
        &:focus {
            background-tint: $foreground 5%;
            & > .agents-table--cursor {
                background: $block-cursor-background;
                color: $block-cursor-foreground;
                text-style: $block-cursor-text-style;
            }
        }
        & > .agents-table--header {
            text-style: bold;
            background: $panel;
            color: $foreground;
        }
        &:ansi > .agents-table--header {
            background: ansi_bright_blue;
            color: ansi_default;
        }
        & > .agents-table--cursor {
            background: $block-cursor-blurred-background;
            color: $block-cursor-blurred-foreground;
            text-style: $block-cursor-blurred-text-style;
        }
    }
    """
    COMPONENT_CLASSES: ClassVar[set[str]] = {"agents-table--header", "agents-table--cursor"}
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "select_cursor", "Select", show=False),
        Binding("up", "cursor_up", "Cursor up", show=False),
        Binding("down", "cursor_down", "Cursor down", show=False),
        Binding("pageup", "page_up", "Page up", show=False),
        Binding("pagedown", "page_down", "Page down", show=False),
        Binding("home", "cursor_home", "First row", show=False),
        Binding("end", "cursor_end", "Last row", show=False),
    ]

    cursor_row: reactive[int] = reactive(0, always_update=False, repaint=False)
    """Index of the highlighted row in the displayed order."""

    class RowSelected(Message):
        """Enter (or a second click) on a row."""

        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

    class HeaderSelected(Message):
        """A click on a column header."""

        def __init__(self, column_key: str) -> None:
            super().__init__()
            self.column_key = column_key

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.columns: list[Column] = []
        self.row_names: list[str] = []
        """Row keys (agent names) in display order."""
        self._cells: dict[str, list[str]] = {}
        self._states: dict[str, str] = {}
        self._strips: dict[str, Strip] = {}
        """Row name → its rendered line without cursor or base style (rebuilt on change)."""
        self._header: Strip | None = None
        self._compact: bool | None = None
        self.cell_updates = 0
        """Cells written since mount (the bench and the tests read it)."""

    # -- data -------------------------------------------------------------------------------

    @property
    def row_count(self) -> int:
        return len(self.row_names)

    @property
    def selected_name(self) -> str | None:
        """Name (row key) under the cursor, or None when the table is empty."""
        if 0 <= self.cursor_row < len(self.row_names):
            return self.row_names[self.cursor_row]
        return None

    def get_row(self, name: str) -> list[str]:
        """The cell texts of a row."""
        return list(self._cells[name])

    def get_row_index(self, name: str) -> int:
        """Index of a row in the displayed order, -1 when it is not shown."""
        try:
            return self.row_names.index(name)
        except ValueError:
            return -1

    def show(self, agents: list[Agent], *, compact: bool, sort_key: str, reverse: bool,
             needle: str) -> None:
        """Render agents sorted and filtered; only rows whose text changed are repainted."""
        if compact != self._compact:
            self._compact = compact
            self.set_columns(columns_for(compact))
        rows = [a for a in ordered(agents, sort_key, reverse) if matches(a, needle)]
        self.show_rows([(str(a.get("name")), row_cells(a, self.columns), fmt.display_state(a))
                        for a in rows])

    def set_columns(self, columns: list[Column]) -> None:
        """Replace the columns; every row is rebuilt on the next `show_rows`."""
        self.columns = list(columns)
        self._header = None
        self._cells.clear()
        self._strips.clear()
        self.row_names = []
        self.refresh()

    def show_rows(self, rows: list[tuple[str, list[str], str]]) -> None:
        """Show `(name, cell texts, display state)` rows in order.

        Only rows whose texts changed are re-rendered and only their lines repainted; a new
        order or row set repaints the table once. The cursor stays on the same agent.
        """
        names = [name for name, _, _ in rows]
        reordered = names != self.row_names
        keep = self.selected_name
        dirty: list[int] = []
        cells_before = self._cells
        self._cells, self._states = {}, {}
        for i, (name, cells, state) in enumerate(rows):
            old = cells_before.get(name)
            self._cells[name], self._states[name] = cells, state
            if old == cells:
                continue
            self.cell_updates += len(cells) if old is None or reordered else sum(
                a != b for a, b in zip(old, cells, strict=False))
            self._strips.pop(name, None)
            dirty.append(i)
        for gone in set(self._strips) - set(self._cells):
            del self._strips[gone]
        if reordered:
            self.row_names = names
            self.virtual_size = Size(self._row_width(), len(names) + 1)
            index = names.index(keep) if keep in names else min(self.cursor_row,
                                                                 max(0, len(names) - 1))
            self.set_reactive(AgentsTable.cursor_row, index)
            self.refresh()
            self._scroll_cursor_into_view()
            return
        for i in dirty:
            self.refresh_lines(i + 1)

    # -- rendering --------------------------------------------------------------------------

    def _row_width(self) -> int:
        return sum(c.width + 2 * PAD for c in self.columns)

    def _row_strip(self, name: str) -> Strip:
        strip = self._strips.get(name)
        if strip is None:
            state_style = Style.parse(STATE_STYLES.get(self._states.get(name, ""), "") or "none")
            segments = []
            for i, (col, text) in enumerate(zip(self.columns, self._cells[name], strict=False)):
                cell = " " * PAD + fit(text, col.width) + " " * PAD
                segments.append(Segment(cell, state_style if i == 1 else None))
            strip = self._strips[name] = Strip(segments, self._row_width())
        return strip

    def _header_strip(self) -> Strip:
        if self._header is None:
            text = "".join(" " * PAD + fit(c.label, c.width) + " " * PAD for c in self.columns)
            self._header = Strip([Segment(text)], self._row_width())
        return self._header

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        scroll_x, scroll_y = self.scroll_offset
        base = self.rich_style
        if y == 0:
            strip = self._header_strip()
            style = base + self.get_component_rich_style("agents-table--header")
        else:
            index = y - 1 + scroll_y
            if index >= len(self.row_names):
                return Strip.blank(width, base)
            strip = self._row_strip(self.row_names[index])
            style = base
            if index == self.cursor_row:
                style = base + self.get_component_rich_style("agents-table--cursor")
        # the cursor/header style goes under the state colour, as DataTable layers them
        line = strip.crop(scroll_x, scroll_x + width).apply_style(style)
        return line.extend_cell_length(width, style)

    def on_focus(self) -> None:
        self.refresh()

    def on_blur(self) -> None:
        self.refresh()

    # -- cursor -----------------------------------------------------------------------------

    def watch_cursor_row(self, old: int, new: int) -> None:
        self.refresh_lines(old + 1)
        self.refresh_lines(new + 1)
        self._scroll_cursor_into_view()

    def validate_cursor_row(self, row: int) -> int:
        return max(0, min(row, len(self.row_names) - 1))

    def move_cursor(self, *, row: int, animate: bool = False) -> None:
        """Put the cursor on a row (clamped to the table)."""
        self.cursor_row = row

    def _scroll_cursor_into_view(self) -> None:
        visible = max(1, self.scrollable_content_region.height - 1)
        top = round(self.scroll_y)
        if self.cursor_row < top:
            self.scroll_to(y=self.cursor_row, animate=False, force=True)
        elif self.cursor_row >= top + visible:
            self.scroll_to(y=self.cursor_row - visible + 1, animate=False, force=True)

    def _page(self) -> int:
        return max(1, self.scrollable_content_region.height - 2)

    def action_cursor_up(self) -> None:
        self.cursor_row -= 1

    def action_cursor_down(self) -> None:
        self.cursor_row += 1

    def action_page_up(self) -> None:
        self.cursor_row -= self._page()

    def action_page_down(self) -> None:
        self.cursor_row += self._page()

    def action_cursor_home(self) -> None:
        self.cursor_row = 0

    def action_cursor_end(self) -> None:
        self.cursor_row = len(self.row_names) - 1

    def action_select_cursor(self) -> None:
        if (name := self.selected_name) is not None:
            self.post_message(self.RowSelected(name))

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None:
            return
        x = offset.x + round(self.scroll_x)
        if offset.y == 0:
            edge = 0
            for col in self.columns:
                edge += col.width + 2 * PAD
                if x < edge:
                    self.post_message(self.HeaderSelected(col.key))
                    break
            return
        index = offset.y - 1 + round(self.scroll_y)
        if index >= len(self.row_names):
            return
        if index == self.cursor_row:
            self.action_select_cursor()
        else:
            self.cursor_row = index
        event.stop()
