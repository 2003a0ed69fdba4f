"""Durations, sizes and times of day as they are written in fleet files.

Pure functions; each raises ValueError with a message fit for `fleettop check`.
"""

from __future__ import annotations

import re
from datetime import time

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")
_TIME_OF_DAY = re.compile(r"^([01]?\d|2[0-3]):([0-5]\d)$")


def parse_duration(value: object) -> float:
    """`90s`, `15m`, `2h`, `1h30m`, `250ms` or a bare number of seconds → seconds."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like 90s, 15m or 2h, got {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"duration must not be negative, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a duration like 90s, 15m or 2h, got {type(value).__name__}")
    text = value.strip().lower()
    pos, total = 0, 0.0
    for match in _DURATION_PART.finditer(text):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        pos = match.end()
    if not text or pos != len(text):
        raise ValueError(f"bad duration {value!r}: use a number with s, m, h or d (90s, 15m, 2h)")
    return total


def parse_size(value: object, *, allow_percent: bool = False) -> int | float:
    """`512MiB`, `2GiB`, `1.5G` or bytes → int bytes; `85%` → float percent when allowed."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size like 512MiB or 2GiB, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected a size like 512MiB or 2GiB, got {type(value).__name__}")
    pct = _PERCENT.match(value)
    if pct:
        if not allow_percent:
            raise ValueError(f"a percentage is not allowed here ({value!r}): give a size")
        percent = float(pct.group(1))
        if not 0 < percent <= 100:
            raise ValueError(f"percentage must be in (0, 100], got {value!r}")
        return percent
    match = _SIZE.match(value)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _SIZE_UNITS:
        hint = " or 85%" if allow_percent else ""
        raise ValueError(f"bad size {value!r}: use a number with KiB, MiB, GiB, MB, GB{hint}")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_time_of_day(value: object) -> time:
    """`22:00` → datetime.time."""
    if isinstance(value, int) and not isinstance(value, bool):
        # YAML 1.1 reads an unquoted 22:00 as the sexagesimal integer 1320.
        hours, minutes = divmod(value, 60)
        if 0 <= hours < 24:
            return time(hours, minutes)
    if isinstance(value, str):
        match = _TIME_OF_DAY.match(value.strip())
        if match:
            return time(int(match.group(1)), int(match.group(2)))
    raise ValueError(f"bad time of day {value!r}: use HH:MM, e.g. 22:00")


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}TiB"
