"""Files that readers in other processes must see whole or not at all."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any


def atomic_write(path: str | os.PathLike[str], data: bytes | str,
                 mode: int | None = None) -> Path:
    """Write `data` to a temporary file beside `path`, then rename it over `path`.

    A reader sees the old content or the new, never a part. `mode` (e.g. 0o600) is set
    when the temporary file is created, so a secret is never readable by others, not even
    for a moment. The temporary name is unique per process and call: two writers in two
    processes never share one.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    raw = data.encode() if isinstance(data, str) else data
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644 if mode is None else mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def atomic_write_json(path: str | os.PathLike[str], obj: Any, mode: int | None = None,
                      indent: int | None = None) -> Path:
    return atomic_write(path, json.dumps(obj, indent=indent, default=str), mode)

