"""Agents-table columns: label, width, cell text and sort key per column (pure, no Textual)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import format as fmt

Agent = dict[str, Any]


@dataclass(frozen=True)
class Column:
    key: str
    label: str
    width: int
    text: Callable[[Agent], str]
    sort: Callable[[Agent], Any]
    compact: bool = True
    """Shown in the compact (80-column) layout too."""


def _num(field: str) -> Callable[[Agent], float]:
    return lambda a: float(a[field]) if a.get(field) is not None else -1.0


def _pid(a: Agent) -> str:
    return str(a["pid"]) if a.get("pid") else "-"


def _source(a: Agent) -> str:
    return str(a.get("source") or fmt.NA)


COLUMNS: list[Column] = [
    Column("name", "Name", 14, lambda a: str(a.get("name", "?")), lambda a: a.get("name", "")),
    Column("state", "State", 13, fmt.state_text, fmt.display_state),
    Column("pid", "PID", 7, _pid, _num("pid")),
    Column("cpu", "CPU%", 5, lambda a: fmt.number(a.get("cpu_percent")), _num("cpu_percent")),
    Column("rss", "RSS", 6, lambda a: fmt.size(a.get("rss_bytes")), _num("rss_bytes")),
    Column("vram", "VRAM", 6, lambda a: fmt.size(a.get("vram_bytes")), _num("vram_bytes"),
           compact=False),
    Column("tps", "tok/s", 5, lambda a: fmt.number(a.get("tokens_per_s")),
           _num("tokens_per_s")),
    Column("req", "Req", 5, lambda a: fmt.number(a.get("requests")), _num("requests"),
           compact=False),
    Column("cost", "$", 6, lambda a: fmt.money(a.get("cost_usd")), _num("cost_usd")),
    Column("loop", "Loop", 4, lambda a: fmt.number(a.get("loop_score"), "{:.2f}"),
           _num("loop_score")),
    Column("leak", "MiB/m", 6, lambda a: fmt.slope_mib_min(a.get("leak_slope_bytes_per_s")),
           _num("leak_slope_bytes_per_s"), compact=False),
    Column("src", "Probe", 6, _source, _source, compact=False),
]
"""All columns in display order."""

COLUMN_KEYS = [c.key for c in COLUMNS]


def columns_for(compact: bool) -> list[Column]:
    """The columns a layout shows."""
    return [c for c in COLUMNS if c.compact or not compact]


def column(key: str) -> Column:
    return next(c for c in COLUMNS if c.key == key)


def row_cells(agent: Agent, cols: list[Column]) -> list[str]:
    """The cell texts of one row."""
    return [c.text(agent) for c in cols]


def ordered(agents: list[Agent], sort_key: str, reverse: bool) -> list[Agent]:
    """Agents sorted by a column; name breaks ties so the order is stable between polls."""
    col = column(sort_key)
    by_name = sorted(agents, key=lambda a: str(a.get("name", "")))
    return sorted(by_name, key=col.sort, reverse=reverse)


def matches(agent: Agent, needle: str) -> bool:
    """Filter: case-insensitive substring of name, shown state or model."""
    if not needle:
        return True
    hay = " ".join(str(x) for x in (agent.get("name"), fmt.state_text(agent),
                                     agent.get("last_model") or "")).lower()
    return needle.lower() in hay
