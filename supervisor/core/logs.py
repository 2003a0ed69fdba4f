"""Per-agent logs: a size-rotated file plus an in-memory tail for the UI and `ctl logs`."""

from __future__ import annotations

import os
import time
from collections import deque
from pathlib import Path


class AgentLog:
    def __init__(self, path: Path, max_bytes: int, backups: int, tail_lines: int = 500) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self.tail: deque[str] = deque(maxlen=tail_lines)
        self._partial: dict[str, str] = {"out": "", "err": ""}
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(path, "ab", buffering=0)  # noqa: SIM115 - lives as long as the agent
        self._size = self._fh.tell()

    def write(self, data: bytes, stream: str = "out") -> None:
        rest = data
        while rest:
            room = self.max_bytes - self._size
            if room <= 0 or (len(rest) > room and self._size > 0 and b"\n" not in rest[:room]):
                self.rotate()
                room = self.max_bytes
            piece = rest[:room]
            if len(rest) > room and b"\n" in piece:
                piece = piece[: piece.rindex(b"\n") + 1]  # rotate on a line boundary
            self._fh.write(piece)
            self._size += len(piece)
            rest = rest[len(piece):]
        text = self._partial[stream] + data.decode("utf-8", "replace")
        *lines, self._partial[stream] = text.split("\n")
        prefix = "! " if stream == "err" else ""
        self.tail.extend(prefix + line for line in lines)
        if len(self._partial[stream]) > 4096:  # a program that never prints a newline
            self.tail.append(prefix + self._partial[stream])
            self._partial[stream] = ""

    def note(self, message: str) -> None:
        """A line from fleettop itself (start, exit), marked so it can't pass for agent output."""
        line = f"[fleettop {time.strftime('%H:%M:%S')}] {message}\n"
        self.write(line.encode())

    def rotate(self) -> None:
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
        self._fh.close()
