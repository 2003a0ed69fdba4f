"""One JSON object per line: the framing of every pipe and socket between fleettop's processes.

The control socket (supervisor ⇄ ctl and viewers), the proxy's stdio (reports out, commands
in) and the eBPF loader's stdio all use it. A line that is not a JSON object is dropped by
`decode`, so a stray print on a pipe never crashes a reader.
"""

from __future__ import annotations

import json
import threading
from typing import Any, TextIO


def encode(obj: Any) -> bytes:
    """One line, newline included; anything JSON can't hold is written as its str()."""
    return json.dumps(obj, separators=(",", ":"), default=str).encode() + b"\n"


def decode(line: bytes | str) -> dict[str, Any] | None:
    """The object on this line, or None for a blank line, garbage or a non-object."""
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


class LineWriter:
    """Line-atomic writes to a text stream from any thread; a closed reader is ignored."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def __call__(self, obj: dict[str, Any]) -> None:
        line = encode(obj).decode()
        with self._lock:
            try:
                self._stream.write(line)
                self._stream.flush()
            except (BrokenPipeError, ValueError):
                pass
