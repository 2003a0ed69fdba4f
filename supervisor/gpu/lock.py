"""One GPU, many processes: a FIFO ticket queue in a folder, over a kernel lock.

Layout of the lock folder (normally `<state dir>/gpu`):

    gpu.lock                  flock: the mutex. The kernel drops it when its holder dies.
    queue.lock                flock: serialises ticket numbering (held for microseconds).
    seq                       the last ticket number handed out.
    queue/<12 digits>.ticket  JSON, never rewritten: pid, start_time, host, name, model, queued_at
    queue/<12 digits>.wake    named pipe, open in the ticket's owner until it leaves the queue
    queue/<12 digits>.held    JSON, written by the holder once it has gpu.lock.

flock's wake-up order is not FIFO (a latecomer can barge in many times), so the tickets decide
who may try: only a ticket with no live ticket ahead of it takes gpu.lock. Each waiter watches
just the nearest live ticket ahead of it, as in a CLH queue: it opens that ticket's pipe for
reading and sleeps in poll(). The owner writes a byte when it lets go; if it dies, the kernel
closes its end and poll() reports a hangup. A handoff wakes exactly one process, nobody polls,
and a dead holder is noticed as soon as the kernel has torn it down. Nothing waits in a thread:
`acquire_async()` gives the pipe to the event loop, and a timeout or cancellation closes it.

A waiting ticket is dropped only on proof its owner is dead: the pid is gone, is a zombie, or
runs with another start time (/proc/PID/stat field 22, i.e. the pid was reused). Never by age;
a ticket from another host counts as alive (it cannot be proved dead) and, like a ticket with
no pipe, is watched by polling. Files in the queue that don't parse are ignored with a warning
and never block anyone.

Caveats: a waiter that is frozen (SIGSTOP) keeps its place; the queue waits for it. A child
forked while its parent is queued shares the parent's pipe: a release still wakes the next
waiter (the byte), but the parent's death is noticed only at the next look, within a second.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import select
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: it doubles the start-up of a sync-only `lock run`
    import asyncio

log = logging.getLogger(__name__)

ENV_LOCK_DIR = "FLEETTOP_GPU_LOCK_DIR"
"""Set by the supervisor for its agents, so `gpu_lock()` and `fleettop lock run` inside a
fleet share the fleet's queue."""

_NAME = re.compile(r"^(\d{12})\.(ticket|held|wake)$")
_LOOK_AGAIN = 1.0  # a watched ticket is looked at again this often even if no wake-up comes
_POLL_MIN = 0.001  # tickets without a pipe (another host, a hand-made file) are polled
_POLL_MAX = 0.05
_HOST = socket.gethostname()


class LockTimeout(TimeoutError):
    """The lock was not granted in time; the waiter's ticket is already gone."""

    def __init__(self, waited: float, position: int | None, holder: dict[str, Any] | None):
        who = f" (held by {holder.get('name') or holder.get('pid')})" if holder else ""
        super().__init__(f"GPU lock not granted within {waited:.1f}s{who}")
        self.waited = waited
        self.position = position
        self.holder = holder


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
    if ticket.host != _HOST:
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


def _own_start_time() -> int | None:
    global _own
    pid = os.getpid()
    if _own is None or _own[0] != pid:  # a forked child has a pid of its own
        _own = (pid, proc_start_time(pid))
    return _own[1]


def fleet_lock_folder(state_dir: str | os.PathLike[str], section: Any = None) -> Path:
    """A fleet's lock queue: its `gpu.lock_dir`, else `<state dir>/gpu`."""
    lock_dir = getattr(section, "lock_dir", None)
    return Path(lock_dir).expanduser() if lock_dir else Path(state_dir) / "gpu"


def default_folder() -> Path:
    """The fleet's queue when run by the supervisor, else one per user."""
    env = os.environ.get(ENV_LOCK_DIR)
    if env:
        return Path(env)
    from fleettop.supervisor.base import paths

    return paths.state_root() / "gpu"


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _write_new(path: str, data: dict[str, Any]) -> None:
    """Create `path` with JSON in one write(): readers see an empty file or all of it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, json.dumps(data).encode())
    finally:
        os.close(fd)


@dataclass(slots=True)
class _Entry:
    ticket: Ticket
    held: dict[str, Any] | None


class _Queue:
    """The queue folder: tickets by number, parsed once; warns once per garbage file."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.qdir = folder / "queue"
        self._q = str(self.qdir)
        self._tickets: dict[int, Ticket] = {}
        self.garbage: set[int] = set()
        self._warned: set[str] = set()

    def path(self, seq: int, kind: str) -> str:
        return f"{self._q}/{seq:012d}.{kind}"

    def _warn(self, name: str, why: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
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

    def scan(self) -> tuple[list[_Entry], list[str]]:
        """Tickets in order (with their held marker) and the names of ignored files."""
        found, ignored = self.listing()
        entries: list[_Entry] = []
        for seq in sorted(found):
            if "ticket" not in found[seq]:
                continue
            ticket = self.ticket(seq)
            if ticket is None:
                if seq in self.garbage:
                    ignored.append(f"{seq:012d}.ticket")
                continue
            entries.append(_Entry(ticket, self.held(seq) if "held" in found[seq] else None))
        return entries, ignored

    def remove(self, seq: int) -> None:
        for kind in ("held", "ticket", "wake"):
            _unlink(self.path(seq, kind))

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
                _write_new(self.path(seq, "ticket"), fields)
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
            _unlink(path)
            return None


def _settle(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)


async def _readable(fd: int, within: float) -> None:
    """Until `fd` is readable or hung up, or `within` seconds have passed."""
    import asyncio

    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    try:
        loop.add_reader(fd, _settle, ready)
    except NotImplementedError:  # an event loop that can't watch fds: poll instead
        await asyncio.sleep(min(within, _POLL_MAX))
        return
    try:
        await asyncio.wait({ready}, timeout=within)
    finally:
        loop.remove_reader(fd)
        ready.cancel()


async def _sleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)


def _readable_sync(fd: int, timeout: float) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    poller.poll(timeout * 1000)


class GpuLock:
    """The GPU lock for one acquisition. Use as `with` / `async with`, or acquire()/release().

    `timeout=None` waits forever, `0` tries once. Raises LockTimeout (a TimeoutError).
    """

    def __init__(self, folder: str | os.PathLike[str] | None = None, *, name: str | None = None,
                 model: str | None = None, timeout: float | None = None) -> None:
        self.folder = Path(folder) if folder is not None else default_folder()
        self.name = name
        self.model = model
        self.timeout = timeout
        self.ticket: Ticket | None = None
        self.acquired_at: float | None = None
        self.waited: float | None = None
        self._fd: int | None = None  # gpu.lock, while held
        self._queue = _Queue(self.folder)
        self._pipe: int | None = None  # our ticket's pipe, while queued or holding
        self._ahead: list[int] = []  # ticket numbers that were ahead of ours, nearest last
        self._watch: tuple[int, int | None] | None = None  # (ticket, read end of its pipe)
        self._polls = 0

    @property
    def held(self) -> bool:
        return self._fd is not None

    # --- steps shared by the sync and async loops -------------------------------------------

    def _enqueue(self) -> None:
        fields: dict[str, Any] = {"pid": os.getpid(), "start_time": _own_start_time(),
                                  "host": _HOST, "name": self.name, "model": self.model,
                                  "queued_at": time.time()}
        seq, self._ahead, self._pipe = self._queue.enqueue(fields)
        self.ticket = Ticket(seq=seq, **fields)
        self._polls = 0

    def _advance(self) -> tuple[int | None, float] | None:
        """None once no live ticket is ahead and gpu.lock is ours; else what to wait for:
        (a pipe to watch or None, for at most how long)."""
        while self._ahead:
            wait = self._look_at(self._ahead[-1])
            if wait is not None:
                return wait
            self._ahead.pop()
        self._unwatch()
        if self._try_flock():
            return None
        # First in line, yet gpu.lock is taken: a dead holder's process is still being torn
        # down, or a child it forked keeps the lock's file open.
        return None, self._backoff()

    def _look_at(self, seq: int) -> tuple[int | None, float] | None:
        """None if ticket `seq` is gone, garbage, or proved dead; else how to wait for it."""
        queue = self._queue
        if self._watch is None or self._watch[0] != seq:
            self._unwatch()
            fd = None
            with contextlib.suppress(OSError):  # no pipe: a hand-made or foreign ticket
                fd = os.open(queue.path(seq, "wake"), os.O_RDONLY | os.O_NONBLOCK)
            self._watch, self._polls = (seq, fd), 0
        ticket = queue.ticket(seq)
        if ticket is None:
            return None
        if not owner_alive(ticket):
            held = os.path.exists(queue.path(seq, "held"))
            log.warning("gpu lock: dropping ticket %d of dead pid %d (%s)%s", seq, ticket.pid,
                        ticket.name, ", which held the lock" if held else "")
            queue.remove(seq)
            return None
        fd = self._watch[1]
        if fd is None or ticket.host != _HOST:
            return None, self._backoff()
        try:
            os.read(fd, 64)
        except BlockingIOError:
            # Its owner has the pipe open (opened before the ticket was published, closed
            # after it is removed), so the hangup or the byte will come.
            return fd, _LOOK_AGAIN
        # A byte (it let go) or end of file (no writer left): look at the ticket again.
        if queue.ticket(seq) is None:
            return None
        return None, self._backoff()  # its owner is dying right now

    def _backoff(self) -> float:
        self._polls += 1
        return min(_POLL_MAX, _POLL_MIN * 1.5 ** (self._polls - 1))

    def _unwatch(self) -> None:
        if self._watch is not None:
            if self._watch[1] is not None:
                os.close(self._watch[1])
            self._watch = None

    def _try_flock(self) -> bool:
        fd = os.open(f"{self.folder}/gpu.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def _granted(self) -> None:
        assert self.ticket is not None
        self.acquired_at = time.time()
        self.waited = self.acquired_at - self.ticket.queued_at
        _write_new(self._queue.path(self.ticket.seq, "held"),
                   {"pid": os.getpid(), "acquired_at": self.acquired_at,
                    "waited_s": round(self.waited, 6)})

    def _leave(self) -> None:
        """Drop our ticket and wake whoever watches it: it moves on to the ticket ahead."""
        self._unwatch()
        self._ahead = []
        if self.ticket is not None:
            self._queue.remove(self.ticket.seq)
            self.ticket = None
        if self._pipe is not None:
            with contextlib.suppress(OSError):
                os.write(self._pipe, b"\n")
            os.close(self._pipe)
            self._pipe = None

    def _give_up(self, started: float) -> LockTimeout:
        position = None
        holder = None
        with contextlib.suppress(Exception):
            st = status(self.folder)
            holder = st["holder"]
            position = next((q["position"] for q in st["queue"]
                             if self.ticket and q["seq"] == self.ticket.seq), None)
        self._leave()
        return LockTimeout(time.monotonic() - started, position, holder)

    def _remaining(self, deadline: float | None) -> float | None:
        return None if deadline is None else deadline - time.monotonic()

    # --- sync -------------------------------------------------------------------------------

    def acquire(self) -> GpuLock:
        if self.held:
            raise RuntimeError("GpuLock is not reentrant")
        started = time.monotonic()
        deadline = None if self.timeout is None else started + self.timeout
        self._enqueue()
        try:
            while (wait := self._advance()) is not None:
                remaining = self._remaining(deadline)
                if remaining is not None and remaining <= 0:
                    raise self._give_up(started)
                fd, delay = wait
                delay = delay if remaining is None else min(delay, remaining)
                if fd is None:
                    time.sleep(delay)
                else:
                    _readable_sync(fd, delay)
            self._granted()
        except BaseException:
            self.release()
            raise
        return self

    def release(self) -> None:
        # gpu.lock first: whoever we wake next must find it free.
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
        self._leave()

    def __enter__(self) -> GpuLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    # --- asyncio ----------------------------------------------------------------------------

    async def acquire_async(self) -> GpuLock:
        if self.held:
            raise RuntimeError("GpuLock is not reentrant")
        started = time.monotonic()
        deadline = None if self.timeout is None else started + self.timeout
        self._enqueue()
        try:
            while (wait := self._advance()) is not None:
                remaining = self._remaining(deadline)
                if remaining is not None and remaining <= 0:
                    raise self._give_up(started)
                fd, delay = wait
                delay = delay if remaining is None else min(delay, remaining)
                if fd is None:
                    await _sleep(delay)
                else:
                    await _readable(fd, delay)
            self._granted()
        except BaseException:
            self.release()
            raise
        return self

    async def __aenter__(self) -> GpuLock:
        return await self.acquire_async()

    async def __aexit__(self, *exc: object) -> None:
        self.release()


def gpu_lock(folder: str | os.PathLike[str] | None = None, *, name: str | None = None,
             model: str | None = None, timeout: float | None = None) -> GpuLock:
    """`with gpu_lock(name="digest", model="qwen2.5:7b", timeout=600): ...` (also `async with`)."""
    return GpuLock(folder, name=name, model=model, timeout=timeout)


def status(folder: str | os.PathLike[str] | None = None, *, now: float | None = None,
           ) -> dict[str, Any]:
    """Holder, queue in order, waits; stale tickets and ignored files. JSON-able."""
    folder = Path(folder) if folder is not None else default_folder()
    now = time.time() if now is None else now
    queue = _Queue(folder)
    entries, ignored = queue.scan()
    holder: dict[str, Any] | None = None
    waiting: list[dict[str, Any]] = []
    stale: list[dict[str, Any]] = []
    for entry in entries:
        info = entry.ticket.to_json()
        info["waited_s"] = round(now - entry.ticket.queued_at, 3)
        alive = owner_alive(entry.ticket)
        if entry.held is not None:
            acquired = float(entry.held.get("acquired_at") or now)
            info.update(acquired_at=acquired, held_s=round(now - acquired, 3),
                        waited_s=entry.held.get("waited_s"))
            if holder is None and alive:
                holder = info
                continue
            info["why"] = "holder died; the kernel freed its lock" if not alive else "superseded"
            stale.append(info)
        elif not alive:
            info["why"] = "owner process is gone (or its pid was reused)"
            stale.append(info)
        else:
            info["position"] = len(waiting) + 1
            waiting.append(info)
    return {"folder": str(folder), "holder": holder, "queue": waiting, "stale": stale,
            "ignored": ignored}

