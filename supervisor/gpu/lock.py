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
import logging
import os
import select
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleettop.supervisor.gpu.queue import (
    HOST,
    Ticket,
    TicketQueue,
    own_start_time,
    owner_alive,
    write_new,
)

if TYPE_CHECKING:  # imported where used: it doubles the start-up of a sync-only `lock run`
    import asyncio

log = logging.getLogger(__name__)


ENV_LOCK_DIR = "FLEETTOP_GPU_LOCK_DIR"
"""Set by the supervisor for its agents, so `gpu_lock()` and `fleettop lock run` inside a
fleet share the fleet's queue."""

_LOOK_AGAIN = 1.0  # a watched ticket is looked at again this often even if no wake-up comes
_POLL_MIN = 0.001  # tickets without a pipe (another host, a hand-made file) are polled
_POLL_MAX = 0.05


class LockTimeout(TimeoutError):
    """The lock was not granted in time; the waiter's ticket is already gone."""

    def __init__(self, waited: float, position: int | None, holder: dict[str, Any] | None):
        who = f" (held by {holder.get('name') or holder.get('pid')})" if holder else ""
        super().__init__(f"GPU lock not granted within {waited:.1f}s{who}")
        self.waited = waited
        self.position = position
        self.holder = holder


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
        self._queue = TicketQueue(self.folder)
        self._pipe: int | None = None  # our ticket's pipe, while queued or holding
        self._ahead: list[int] = []  # ticket numbers that were ahead of ours, nearest last
        self._watch: tuple[int, int | None] | None = None  # (ticket, read end of its pipe)
        self._polls = 0

    @property
    def held(self) -> bool:
        return self._fd is not None

    # --- steps shared by the sync and async loops -------------------------------------------

    def _enqueue(self) -> None:
        fields: dict[str, Any] = {"pid": os.getpid(), "start_time": own_start_time(),
                                  "host": HOST, "name": self.name, "model": self.model,
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
        if fd is None or ticket.host != HOST:
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
        write_new(self._queue.path(self.ticket.seq, "held"),
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

    def _waits(self) -> Iterator[tuple[int | None, float]]:
        """One acquisition as the waits it takes: (fd to watch or None, at most this long).

        `acquire` and `acquire_async` drive it, each waiting its own way; it raises
        LockTimeout at the deadline and returns once the lock is ours."""
        started = time.monotonic()
        deadline = None if self.timeout is None else started + self.timeout
        self._enqueue()
        while (wait := self._advance()) is not None:
            remaining = self._remaining(deadline)
            if remaining is not None and remaining <= 0:
                raise self._give_up(started)
            fd, delay = wait
            yield fd, delay if remaining is None else min(delay, remaining)
        self._granted()

    def acquire(self) -> GpuLock:
        if self.held:
            raise RuntimeError("GpuLock is not reentrant")
        try:
            for fd, delay in self._waits():
                if fd is None:
                    time.sleep(delay)
                else:
                    _readable_sync(fd, delay)
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
        try:
            for fd, delay in self._waits():
                if fd is None:
                    await _sleep(delay)
                else:
                    await _readable(fd, delay)
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
    queue = TicketQueue(folder)
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

