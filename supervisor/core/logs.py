"""Per-agent logs: a size-rotated file plus an in-memory tail for the UI and `ctl logs`.

A log file that cannot be written (a full disk, a removed folder) never stops the agent or
floods anyone: the tail in memory goes on, `on_trouble(why)` is called once when writing
starts to fail and `on_trouble(None)` once when it works again; in between the file is
retried every `RETRY_S`, and what could not be written is counted and noted on recovery.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

RETRY_S = 5.0
"""How often a failing log file is tried again."""


class AgentLog:
    def __init__(self, path: Path, max_bytes: int, backups: int, tail_lines: int = 500,
                 on_trouble: Callable[[str | None], None] | None = None) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self.tail: deque[str] = deque(maxlen=tail_lines)
        self._partial: dict[str, str] = {"out": "", "err": ""}
        self.on_trouble = on_trouble or (lambda why: None)
        self.failing: str | None = None
        """Why the file is not being written now (None: it is)."""
        self.lost_bytes = 0
        self._retry_at = 0.0
        self._fh: BinaryIO | None = None
        self._size = 0
        try:
            self._open()
        except OSError as exc:
            self._fail(exc)

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "ab", buffering=0)  # noqa: SIM115 - lives with the agent
        self._size = self._fh.tell()

    def _fail(self, exc: OSError) -> None:
        self._retry_at = time.monotonic() + RETRY_S
        if self.failing is None:
            self.failing = f"cannot write {self.path}: {exc.strerror or exc}"
            self.on_trouble(self.failing)

    def write(self, data: bytes, stream: str = "out") -> None:
        self._to_file(data)
        text = self._partial[stream] + data.decode("utf-8", "replace")
        *lines, self._partial[stream] = text.split("\n")
        prefix = "! " if stream == "err" else ""
        self.tail.extend(prefix + line for line in lines)
        if len(self._partial[stream]) > 4096:  # a program that never prints a newline
            self.tail.append(prefix + self._partial[stream])
            self._partial[stream] = ""

    def _to_file(self, data: bytes) -> None:
        if self.failing is not None:
            if time.monotonic() < self._retry_at:
                self.lost_bytes += len(data)
                return
            if not self._recover():
                self.lost_bytes += len(data)
                return
        try:
            self._write_rotating(data)
        except OSError as exc:
            self.lost_bytes += len(data)
            self._fail(exc)

    def _recover(self) -> bool:
        lost = self.lost_bytes
        try:
            if self._fh is None or self._fh.closed:
                self._open()
            self._write_rotating(f"[fleettop {time.strftime('%H:%M:%S')}] log file writable "
                                 f"again; {lost} bytes of output were not written to it\n"
                                 .encode())
        except OSError as exc:
            self._fail(exc)
            return False
        self.failing, self.lost_bytes = None, 0
        self.on_trouble(None)
        return True

    def _write_rotating(self, data: bytes) -> None:
        if self._fh is None:
            raise OSError(f"{self.path} is not open")
        rest = data
        while rest:
            room = self.max_bytes - self._size
            if room <= 0 or (len(rest) > room and self._size > 0 and b"\n" not in rest[:room]):
                self.rotate()
                room = self.max_bytes
            piece = rest[:room]
            if len(rest) > room and b"\n" in piece:
                piece = piece[: piece.rindex(b"\n") + 1]  # rotate on a line boundary
            assert self._fh is not None
            self._fh.write(piece)
            self._size += len(piece)
            rest = rest[len(piece):]

    def note(self, message: str) -> None:
        """A line from fleettop itself (start, exit), marked so it can't pass for agent output."""
        line = f"[fleettop {time.strftime('%H:%M:%S')}] {message}\n"
        self.write(line.encode())

    def rotate(self) -> None:
        if self._fh is not None:
            self._fh.close()
        if self.backups > 0:
            for i in range(self.backups - 1, 0, -1):
                src = self.path.with_name(f"{self.path.name}.{i}")
                if src.exists():
                    os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        else:
            self.path.unlink(missing_ok=True)
        self._fh = open(self.path, "ab", buffering=0)  # noqa: SIM115
        self._size = 0

    def lines(self, n: int) -> list[str]:
        out = list(self.tail)[-n:] if n > 0 else []
        pending = [p for p in self._partial.values() if p]
        return (out + pending)[-n:] if n > 0 else []

    def close(self) -> None:
        if self._fh is not None:
            with contextlib.suppress(OSError):  # nothing more can be saved of it
                self._fh.close()
