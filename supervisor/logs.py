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
        if self._size + len(data) > self.max_bytes and self._size > 0:
            self.rotate()
        self._fh.write(data)
        self._size += len(data)
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
