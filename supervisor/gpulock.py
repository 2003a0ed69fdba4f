"""One GPU, many processes: a FIFO ticket queue in a folder, over a kernel lock.

Layout of the lock folder (normally `<state dir>/gpu`):

    gpu.lock                  flock: the mutex. The kernel drops it when its holder dies.
    queue.lock                flock: serialises ticket numbering (held for microseconds).
    seq                       the last ticket number handed out.
    queue/<12 digits>.ticket  JSON, never rewritten: pid, start_time, host, name, model, queued_at
    queue/<12 digits>.held    JSON, written by the holder once it has gpu.lock.

flock's wake-up order is not FIFO (a latecomer can barge in many times), so the tickets decide
who may try: only the first live ticket, or the one right behind a ticket marked held. For the
latter, getting the flock *is* the proof that the holder let go (released or died), so a dead
holder is recovered the moment the kernel frees its lock, with no guessing.

A waiting ticket is dropped only on proof its owner is dead: the pid is gone, is a zombie, or
runs with another start time (/proc/PID/stat field 22, i.e. the pid was reused). Never by age;
a ticket from another host counts as alive (it cannot be proved dead). Files in the queue that
don't parse are ignored with a warning and never block anyone.

Caveat: a waiter that is frozen (SIGSTOP) keeps its place; the queue waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ENV_LOCK_DIR = "FLEETTOP_GPU_LOCK_DIR"
"""Set by the supervisor for its agents, so `gpu_lock()` and `fleettop lock run` inside a
fleet share the fleet's queue."""

_TICKET = re.compile(r"^(\d{12})\.(ticket|held)$")
_POLL_MIN = 0.0005
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


def default_folder() -> Path:
    """The fleet's queue when run by the supervisor, else one per user."""
    env = os.environ.get(ENV_LOCK_DIR)
    if env:
        return Path(env)
    from fleettop.supervisor import paths

    return paths.state_root() / "gpu"


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.parent / f".tmp-{os.getpid()}-{threading.get_ident()}-{path.name}"
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


@dataclass(slots=True)
class _Entry:
    ticket: Ticket
    held: dict[str, Any] | None


class _Queue:
    """Reads the queue folder; warns once per garbage file."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.qdir = folder / "queue"
        self._cache: dict[str, Ticket] = {}
        self._warned: set[str] = set()

    def setup(self) -> None:
        self.qdir.mkdir(parents=True, exist_ok=True)

    def _warn(self, name: str, why: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
            log.warning("gpu lock: ignoring %s in %s: %s", name, self.qdir, why)

    def scan(self) -> tuple[list[_Entry], list[str]]:
        """Tickets in order (with their held marker) and the names of ignored files."""
        try:
            names = os.listdir(self.qdir)
        except FileNotFoundError:
            return [], []
        tickets: dict[int, str] = {}
        held: dict[int, str] = {}
        ignored: list[str] = []
        for name in names:
            if name.startswith("."):
                continue
            m = _TICKET.match(name)
            if not m:
                self._warn(name, "not a ticket name")
                ignored.append(name)
                continue
            (tickets if m.group(2) == "ticket" else held)[int(m.group(1))] = name
        entries: list[_Entry] = []
        for seq in sorted(tickets):
            name = tickets[seq]
            ticket = self._cache.get(name)
            if ticket is None:
                try:
                    ticket = Ticket.from_json(json.loads((self.qdir / name).read_text()), seq)
                except FileNotFoundError:
                    continue
                except (ValueError, OSError, TypeError) as exc:
                    self._warn(name, f"unreadable ticket ({exc})")
                    ignored.append(name)
                    continue
                self._cache[name] = ticket
            marker = None
            if seq in held:
                try:
                    marker = json.loads((self.qdir / held[seq]).read_text())
                except FileNotFoundError:
                    marker = None
                except (ValueError, OSError):
                    marker = {}
                if not isinstance(marker, dict) and marker is not None:
                    marker = {}
            entries.append(_Entry(ticket, marker))
        if len(self._cache) > 4 * len(tickets) + 64:
            self._cache = {n: t for n, t in self._cache.items() if n in set(tickets.values())}
        return entries, ignored

    def remove(self, seq: int) -> None:
        _unlink(self.qdir / f"{seq:012d}.held")
        _unlink(self.qdir / f"{seq:012d}.ticket")

    def next_seq(self, publish: Callable[[int], None] | None = None) -> int:
        """Take the next ticket number and, under the same lock, publish the ticket: a
        number taken but not yet visible would let a later ticket jump the queue."""
        fd = os.open(self.folder / "queue.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            seq_file = self.folder / "seq"
            try:
                last = int(seq_file.read_text().strip())
            except (OSError, ValueError):
                # Missing or garbled counter: continue after the highest ticket present.
                last = max((int(m.group(1)) for n in os.listdir(self.qdir)
                            if (m := _TICKET.match(n))), default=0)
            seq = last + 1
            tmp = self.folder / f".seq-{os.getpid()}-{threading.get_ident()}"
            tmp.write_text(str(seq))
            os.replace(tmp, seq_file)
            if publish is not None:
                publish(seq)
            return seq
        finally:
            os.close(fd)


class _BlockingWait:
    """A blocking flock in a daemon thread: wakes the instant the holder lets go.

    flock can't be interrupted from another thread, so on timeout the thread is abandoned and
    drops the lock right away if it gets it later.
    """

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.done = threading.Event()
        self._mu = threading.Lock()
        self._cancelled = False
        self._got = False
        self._callbacks: list[Any] = []
        threading.Thread(target=self._run, daemon=True, name="gpulock-wait").start()

    def _run(self) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except OSError:
            os.close(self.fd)
            self.done.set()
            return
        with self._mu:
            if self._cancelled:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
                os.close(self.fd)
            else:
                self._got = True
            callbacks = list(self._callbacks)
        self.done.set()
        for cb in callbacks:
            cb()

    def on_done(self, cb: Any) -> None:
        with self._mu:
            if not self.done.is_set():
                self._callbacks.append(cb)
                return
        cb()

    def settle(self) -> int | None:
        """The fd if the lock was got; otherwise cancel and return None."""
        with self._mu:
            if self._got:
                return self.fd
            self._cancelled = True
            self._callbacks.clear()
            return None


def _wake(loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
    with contextlib.suppress(RuntimeError):  # the loop may be gone by the time we wake
        loop.call_soon_threadsafe(event.set)


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
        self._fd: int | None = None
        self._queue = _Queue(self.folder)
        self._wait: _BlockingWait | None = None
        self._last_names: tuple[int, ...] = ()
        self._unchanged = 0

    @property
    def held(self) -> bool:
        return self._fd is not None

    # --- steps shared by the sync and async loops -------------------------------------------

    def _enqueue(self) -> None:
        self._queue.setup()
        pid = os.getpid()
        start = proc_start_time(pid)

        def publish(seq: int) -> None:
            self.ticket = Ticket(seq=seq, pid=pid, start_time=start, host=_HOST,
                                 name=self.name, model=self.model, queued_at=time.time())
            data = self.ticket.to_json()
            data.pop("seq")
            _write_atomic(self._queue.qdir / f"{seq:012d}.ticket", data)

        self._queue.next_seq(publish)

    def _step(self) -> tuple[str, float, int]:
        """One look at the queue → ("got"|"block"|"wait", delay, live tickets ahead)."""
        assert self.ticket is not None
        entries, _ = self._queue.scan()
        ahead: list[_Entry] = []
        for entry in entries:
            if entry.ticket.seq >= self.ticket.seq:
                break
            if entry.held is None and not owner_alive(entry.ticket):
                log.warning("gpu lock: dropping ticket %d of dead pid %d (%s)", entry.ticket.seq,
                            entry.ticket.pid, entry.ticket.name)
                self._queue.remove(entry.ticket.seq)
                continue
            ahead.append(entry)
        names = tuple(e.ticket.seq for e in entries)
        if names != self._last_names:
            self._last_names, self._unchanged = names, 0
        else:
            self._unchanged += 1
        if not ahead or (len(ahead) == 1 and ahead[0].held is not None):
            if self._try_flock():
                return "got", 0.0, 0
            if ahead:
                return "block", 0.0, 1
        position = len(ahead)
        delay = min(_POLL_MAX, _POLL_MIN * (2 ** min(position, 8)) * (1.15 ** self._unchanged))
        return "wait", delay, position

    def _try_flock(self) -> bool:
        fd = os.open(self.folder / "gpu.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def _granted(self) -> None:
        assert self.ticket is not None
        # Holding the flock proves every held ticket ahead of ours is finished: clear them.
        entries, _ = self._queue.scan()
        for entry in entries:
            if entry.ticket.seq < self.ticket.seq and entry.held is not None:
                self._queue.remove(entry.ticket.seq)
        self.acquired_at = time.time()
        self.waited = self.acquired_at - self.ticket.queued_at
        _write_atomic(self._queue.qdir / f"{self.ticket.seq:012d}.held",
                      {"pid": os.getpid(), "acquired_at": self.acquired_at,
                       "waited_s": round(self.waited, 6)})

    def _give_up(self, started: float) -> LockTimeout:
        position = None
        holder = None
        with contextlib.suppress(Exception):
            st = status(self.folder)
            holder = st["holder"]
            position = next((q["position"] for q in st["queue"]
                             if self.ticket and q["seq"] == self.ticket.seq), None)
        self._cancel_wait()
        if self.ticket is not None:
            self._queue.remove(self.ticket.seq)
            self.ticket = None
        return LockTimeout(time.monotonic() - started, position, holder)

    def _cancel_wait(self) -> None:
        if self._wait is not None:
            fd = self._wait.settle()
            self._wait = None
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)

    def _claim_wait(self) -> bool:
        assert self._wait is not None
        fd = self._wait.settle()
        self._wait = None
        if fd is None:
            return False
        self._fd = fd
        return True

    # --- sync -------------------------------------------------------------------------------

    def acquire(self) -> GpuLock:
        if self.held:
            raise RuntimeError("GpuLock is not reentrant")
        started = time.monotonic()
        deadline = None if self.timeout is None else started + self.timeout
        self._enqueue()
        try:
            while True:
                verdict, delay, _ = self._step()
                if verdict == "got":
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise self._give_up(started)
                if verdict == "block":
                    self._wait = _BlockingWait(self.folder / "gpu.lock")
                    self._wait.done.wait(remaining)
                    if self._claim_wait():
                        break
                    continue
                time.sleep(delay if remaining is None else min(delay, remaining))
            self._granted()
        except BaseException:
            if not self.held and self.ticket is not None:
                self._cancel_wait()
                self._queue.remove(self.ticket.seq)
                self.ticket = None
            raise
        return self

    def release(self) -> None:
        if self.ticket is not None:
            self._queue.remove(self.ticket.seq)
            self.ticket = None
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> GpuLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    # --- asyncio ----------------------------------------------------------------------------

    async def acquire_async(self) -> GpuLock:
        if self.held:
            raise RuntimeError("GpuLock is not reentrant")
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        deadline = None if self.timeout is None else started + self.timeout
        self._enqueue()
        try:
            while True:
                verdict, delay, _ = self._step()
                if verdict == "got":
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise self._give_up(started)
                if verdict == "block":
                    wait = self._wait = _BlockingWait(self.folder / "gpu.lock")
                    woke = asyncio.Event()
                    wait.on_done(lambda ev=woke: _wake(loop, ev))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(woke.wait(), remaining)
                    if self._claim_wait():
                        break
                    continue
                await asyncio.sleep(delay if remaining is None else min(delay, remaining))
            self._granted()
        except BaseException:
            if not self.held and self.ticket is not None:
                self._cancel_wait()
                self._queue.remove(self.ticket.seq)
                self.ticket = None
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

