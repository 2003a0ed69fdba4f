"""The lock folder's ticket queue: numbered tickets, their wake pipes, and proof of death.

See gpu/lock.py for the layout and the protocol. A file in the queue that does not parse is
ignored with a warning (once per file) and never blocks anyone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("fleettop.supervisor.gpu.lock")

_NAME = re.compile(r"^(\d{12})\.(ticket|held|wake)$")
HOST = socket.gethostname()
_WARNED: set[str] = set()
"""Files already warned about in this process."""


@dataclass(frozen=True, slots=True)
class Ticket:
    seq: int
    pid: int
    start_time: int | None
    host: str
    name: str | None
    model: str | None
    queued_at: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any, seq: int) -> Ticket:
        if not isinstance(data, dict) or not isinstance(data.get("pid"), int):
            raise ValueError("not a ticket")
        start = data.get("start_time")
        return cls(seq=seq, pid=data["pid"], start_time=start if isinstance(start, int) else None,
                   host=str(data.get("host") or ""), name=data.get("name"),
                   model=data.get("model"), queued_at=float(data.get("queued_at") or 0.0))


def proc_start_time(pid: int, proc: str = "/proc") -> int | None:
    """Field 22 of /proc/PID/stat (clock ticks after boot); None if the pid is gone or a zombie."""
    try:
        raw = Path(f"{proc}/{pid}/stat").read_bytes()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = raw[raw.rfind(b")") + 2:].split()
    if not fields or fields[0] == b"Z" or len(fields) < 20:
        return None
    return int(fields[19])


def owner_alive(ticket: Ticket) -> bool:
    """False only on proof the ticket's process is dead (gone, zombie, or pid reused)."""
    if ticket.host != HOST:
        return True
    try:
        os.kill(ticket.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    started = proc_start_time(ticket.pid)
    if started is None:
        return False
    return ticket.start_time is None or started == ticket.start_time


_own: tuple[int, int | None] | None = None


def own_start_time() -> int | None:
    global _own
    pid = os.getpid()
    if _own is None or _own[0] != pid:  # a forked child has a pid of its own
        _own = (pid, proc_start_time(pid))
    return _own[1]


def unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def write_new(path: str, data: dict[str, Any]) -> None:
    """Create `path` with JSON in one write(): readers see an empty file or all of it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, json.dumps(data).encode())
    finally:
        os.close(fd)


@dataclass(slots=True)
class Entry:
    ticket: Ticket
    held: dict[str, Any] | None


class TicketQueue:
    """The queue folder: tickets by number, parsed once; warns once per garbage file."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.qdir = folder / "queue"
        self._q = str(self.qdir)
        self._tickets: dict[int, Ticket] = {}
        self.garbage: set[int] = set()

    def path(self, seq: int, kind: str) -> str:
        return f"{self._q}/{seq:012d}.{kind}"

    def _warn(self, name: str, why: str) -> None:
        # Once per file and process, whichever queue object meets it: status() makes a new
        # one per call (every snapshot), and the warning repeated on every one of them.
        key = f"{self.qdir}/{name}"
        if key not in _WARNED:
            _WARNED.add(key)
            log.warning("gpu lock: ignoring %s in %s: %s", name, self.qdir, why)

    def listing(self) -> tuple[dict[int, set[str]], list[str]]:
        """{ticket number: kinds of file present} and the names of files that aren't ours."""
        try:
            names = os.listdir(self._q)
        except FileNotFoundError:
            return {}, []
        found: dict[int, set[str]] = {}
        ignored: list[str] = []
        for name in names:
            if name.startswith("."):
                continue
            m = _NAME.match(name)
            if m is None:
                self._warn(name, "not a ticket name")
                ignored.append(name)
                continue
            found.setdefault(int(m.group(1)), set()).add(m.group(2))
        return found, ignored

    def ticket(self, seq: int) -> Ticket | None:
        """The ticket while its file is there; None once it is gone, or if it is garbage."""
        path = self.path(seq, "ticket")
        known = self._tickets.get(seq)
        if known is not None:
            return known if os.path.exists(path) else None
        try:
            with open(path, "rb") as f:
                raw = f.read()
            if not raw:
                return None  # created under queue.lock, its one write() not done yet
            ticket = Ticket.from_json(json.loads(raw), seq)
        except FileNotFoundError:
            return None
        except (ValueError, TypeError, OSError) as exc:
            self._warn(f"{seq:012d}.ticket", f"unreadable ticket ({exc})")
            self.garbage.add(seq)
            return None
        self._tickets[seq] = ticket
        return ticket

    def held(self, seq: int) -> dict[str, Any] | None:
        try:
            with open(self.path(seq, "held"), "rb") as f:
                marker = json.loads(f.read())
        except FileNotFoundError:
            return None
        except (ValueError, OSError):
            return {}  # being written, or damaged: held all the same
        return marker if isinstance(marker, dict) else {}

    def scan(self) -> tuple[list[Entry], list[str]]:
        """Tickets in order (with their held marker) and the names of ignored files."""
        found, ignored = self.listing()
        entries: list[Entry] = []
        for seq in sorted(found):
            if "ticket" not in found[seq]:
                continue
            ticket = self.ticket(seq)
            if ticket is None:
                if seq in self.garbage:
                    ignored.append(f"{seq:012d}.ticket")
                continue
            entries.append(Entry(ticket, self.held(seq) if "held" in found[seq] else None))
        return entries, ignored

    def remove(self, seq: int) -> None:
        for kind in ("held", "ticket", "wake"):
            unlink(self.path(seq, kind))

    def enqueue(self, fields: dict[str, Any]) -> tuple[int, list[int], int | None]:
        """Number and publish a ticket → (its number, the tickets ahead, our pipe's fd).

        Both happen under queue.lock: a number taken but not yet visible would let a later
        ticket jump the queue, and a waiter only ever looks at tickets (and pipes) complete
        before its own. The pipe's fd is None where the file system has no named pipes."""
        self.qdir.mkdir(parents=True, exist_ok=True)
        self._tickets.clear()
        lock = os.open(f"{self.folder}/queue.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            found, _ = self.listing()
            seq = self._next_seq(max(found, default=0))
            for old, kinds in found.items():
                if "ticket" not in kinds:  # left by a crash, or a release halfway done
                    self.remove(old)
            pipe = self._make_pipe(seq)
            try:
                write_new(self.path(seq, "ticket"), fields)
            except BaseException:
                self.remove(seq)
                if pipe is not None:
                    os.close(pipe)
                raise
        finally:
            os.close(lock)
        return seq, sorted(s for s, kinds in found.items() if "ticket" in kinds), pipe

    def _next_seq(self, highest: int) -> int:
        # In place (we hold queue.lock): renaming over the old counter costs a flush on ext4.
        fd = os.open(f"{self.folder}/seq", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            raw = os.pread(fd, 64, 0)
            try:
                last = int(raw.strip())
            except ValueError:
                last = 0  # missing or garbled: continue after the highest ticket present
            seq = max(last, highest) + 1
            data = b"%d\n" % seq
            os.pwrite(fd, data, 0)
            if len(raw) > len(data):
                os.ftruncate(fd, len(data))
            return seq
        finally:
            os.close(fd)

    def _make_pipe(self, seq: int) -> int | None:
        path = self.path(seq, "wake")
        try:
            os.mkfifo(path, 0o600)
            # Read-write, so opening never blocks and the pipe never reports a hangup to us.
            return os.open(path, os.O_RDWR | os.O_NONBLOCK)
        except OSError as exc:
            log.debug("gpu lock: no pipe in %s (%s); successors will poll", self.qdir, exc)
            unlink(path)
            return None
