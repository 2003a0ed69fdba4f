"""Process trees without cgroups: /proc walking for the SIGSTOP fallback and for stats."""

from __future__ import annotations

import contextlib
import os
import signal


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            data = fh.read()
    except OSError:
        return None
    # comm may hold spaces and parentheses: split after the last ')'.
    return data[data.rindex(")") + 2:].split()


def start_time(pid: int) -> int | None:
    """Process start time in clock ticks since boot (/proc/PID/stat field 22)."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def children_map() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(int(entry))
        if fields:
            out.setdefault(int(fields[1]), []).append(int(entry))
    return out


def tree_pids(root: int) -> list[int]:
    """root and all its descendants (by parent links), plus its process group's members."""
    kids = children_map()
    seen, stack = set(), [root]
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        stack.extend(kids.get(pid, []))
    with contextlib.suppress(ProcessLookupError, PermissionError):
        pgid = os.getpgid(root)
        if pgid != root:
            # Not a group leader (e.g. a pid typed in by the user): its group is someone
            # else's — possibly ours — so only its descendants belong to it.
            return sorted(p for p in seen if os.path.exists(f"/proc/{p}"))
        for pid in list(kids.get(1, [])) + [p for ps in kids.values() for p in ps]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getpgid(pid) == pgid:
                    seen.add(pid)
    return sorted(p for p in seen if os.path.exists(f"/proc/{p}"))


def signal_tree(root: int, sig: int) -> int:
    """Send sig to every process of root's tree; returns how many got it."""
    n = 0
    order = tree_pids(root)
    if sig == signal.SIGCONT:
        order.reverse()
    for pid in order:
        try:
            os.kill(pid, sig)
            n += 1
        except (ProcessLookupError, PermissionError):
            continue
    return n


def wait_stopped(pids: list[int], stopped: bool = True, timeout: float = 0.5) -> bool:
    """Signals land asynchronously: wait until every pid shows `T` (or stops showing it)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        states = [proc_state(p) for p in pids]
        if all(s is None or s in "ZX" or (s in "Tt") == stopped for s in states):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)


def proc_state(pid: int) -> str | None:
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def rss_bytes(pids: list[int]) -> int:
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as fh:
                total += int(fh.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue
    return total


def cpu_ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields:
            total += int(fields[11]) + int(fields[12])
    return total
