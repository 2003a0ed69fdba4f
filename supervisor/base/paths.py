"""Where fleettop keeps its state (logs, incidents, CA, lock queue) and its runtime files.

State: `$XDG_STATE_HOME/fleettop/<fleet-id>` (default `~/.local/state/...`; `/var/lib/fleettop`
for root without a home override). Runtime: `$XDG_RUNTIME_DIR/fleettop`, else
`/run/fleettop` for root, else `/tmp/fleettop-<uid>`; always 0700. The fleet id is the fleet
file's name plus a hash of its absolute path, so two fleets never share a socket.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def fleet_id(fleet_file: str | os.PathLike[str]) -> str:
    path = Path(fleet_file).resolve()
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:10]
    stem = "".join(c if c.isalnum() or c in "-_" else "_" for c in path.stem)[:32]
    return f"{stem}-{digest}"


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.stat().st_uid == os.getuid():
        os.chmod(path, 0o700)
    return path


def state_root() -> Path:
    override = os.environ.get("FLEETTOP_STATE_DIR")
    if override:
        return Path(override)
    xdg = os.environ.get("XDG_STATE_HOME")
    if xdg:
        return Path(xdg) / "fleettop"
    if os.geteuid() == 0 and not os.environ.get("HOME", "").startswith("/home"):
        return Path("/var/lib/fleettop")
    return Path.home() / ".local" / "state" / "fleettop"


def state_dir(fleet_file: str | os.PathLike[str], override: str | None = None) -> Path:
    base = Path(override) if override else state_root() / fleet_id(fleet_file)
    return _private_dir(base)


def runtime_dir() -> Path:
    override = os.environ.get("FLEETTOP_RUNTIME_DIR")
    if override:
        return _private_dir(Path(override))
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return _private_dir(Path(xdg) / "fleettop")
    if os.geteuid() == 0:
        return _private_dir(Path("/run/fleettop"))
    return _private_dir(Path(f"/tmp/fleettop-{os.getuid()}"))


def socket_path(fleet_file: str | os.PathLike[str]) -> Path:
    return runtime_dir() / f"{fleet_id(fleet_file)}.sock"


def pid_lock_path(fleet_file: str | os.PathLike[str]) -> Path:
    return runtime_dir() / f"{fleet_id(fleet_file)}.lock"
