"""Incident folders: one per breaker trip, replayable with `fleettop replay`.

`incidents/<time>-<agent>-<kind>[-n]/` holds `event.json` (written last: a folder with it is
complete), `response.txt` (the agent's ring, redacted) and `requests.jsonl`. The folder is
named at the trip and written right after the chunk callback returns, so the report that
freezes the agent is never delayed by the disk.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

from fleettop.supervisor.base.files import atomic_write_json
from fleettop.supervisor.detect.redact import redact_text

log = logging.getLogger(__name__)


class Incidents:
    def __init__(self) -> None:
        self.state_dir: Path | None = None
        self._stamp = ""
        self._names: dict[str, int] = {}
        self._pending: list[tuple[Path, dict[str, Any], str, list[dict[str, Any]]]] = []

    def folder_for(self, agent: str, event: dict[str, Any]) -> Path | None:
        """Name `incidents/<time>-<agent>-<kind>[-n]/`; it is created with its files, after
        the report (mkdir calls before it were most of the report's delay)."""
        if self.state_dir is None:
            return None
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(event["ts"]))
        name = f"{stamp}-{agent}-{event['kind']}"
        if self._stamp != stamp:  # names are only reused within one second
            self._stamp, self._names = stamp, {}
        n = self._names.get(name, 0) + 1
        root = self.state_dir / "incidents"
        folder = root / (name if n == 1 else f"{name}-{n}")
        while folder.exists():  # left by an earlier proxy process in this second
            n += 1
            folder = root / f"{name}-{n}"
        self._names[name] = n
        return folder

    def write_soon(self, folder: Path, event: dict[str, Any], ring: str,
                   requests: list[dict[str, Any]]) -> None:
        """Queue one incident; written on the loop's next turn (now where there is no loop)."""
        self._pending.append((folder, event, ring, requests))
        try:
            asyncio.get_running_loop().call_soon(self.write_pending)
        except RuntimeError:  # no loop (replay, tests): write now
            self.write_pending()

    def write_pending(self) -> None:
        while self._pending:
            write_incident(*self._pending.pop(0))


def write_incident(folder: Path, event: dict[str, Any], ring: str,
                    requests: list[dict[str, Any]]) -> None:
    try:
        folder.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        folder.mkdir(mode=0o700, exist_ok=True)
        (folder / "response.txt").write_text(redact_text(ring))
        with open(folder / "requests.jsonl", "w") as fh:
            for req in requests:
                fh.write(json.dumps(req) + "\n")
        # event.json last: a folder with it is complete.
        atomic_write_json(folder / "event.json", event, indent=2)
    except OSError:
        log.exception("fleettop addon: cannot write incident")
