"""cgroup v2: one cgroup per agent under a fleettop parent, the freezer, and cleanup.

Layout: `<v2 root>/fleettop/<fleet-id>.<supervisor pid>/<agent>`. The supervisor itself
stays where it was started; only agents live under `fleettop/`, so the parent has no
processes of its own and controllers can be enabled for the children (cgroup v2's
"no internal processes" rule). v2 is found from /proc/self/mounts: `/sys/fs/cgroup` on
unified systems, `/sys/fs/cgroup/unified` on hybrid ones.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

BASE_NAME = "fleettop"


def find_v2_mount(mounts: str = "/proc/self/mounts") -> Path | None:
    try:
        with open(mounts) as fh:
            for line in fh:
                parts = line.split()
                if len(parts) >= 3 and parts[2] == "cgroup2":
                    return Path(parts[1])
    except OSError:
        return None
    return None


def find_v1_memory(mounts: str = "/proc/self/mounts",
                   own: str = "/proc/self/cgroup") -> Path | None:
    """Our own cgroup in a v1 `memory` hierarchy (hybrid systems keep memory in v1)."""
    mount = None
    try:
        with open(mounts) as fh:
            for line in fh:
                parts = line.split()
                if len(parts) >= 4 and parts[2] == "cgroup" and "memory" in parts[3].split(","):
                    mount = Path(parts[1])
                    break
        if mount is None:
            return None
        with open(own) as fh:
            for line in fh:
                _, ctrls, path = line.rstrip("\n").split(":", 2)
                if "memory" in ctrls.split(","):
                    return mount / path.lstrip("/")
    except (OSError, ValueError):
        return None
    return None


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read(path: Path) -> str:
    with open(path) as fh:
        return fh.read()


def read_events(cg: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in _read(cg / "cgroup.events").splitlines():
        key, _, value = line.partition(" ")
        out[key] = int(value or 0)
    return out


def procs(cg: Path) -> list[int]:
    """Every process in the cgroup and below (an agent's whole tree)."""
    pids: list[int] = []
    for dirpath, _dirs, _files in os.walk(cg):
        try:
            pids += [int(p) for p in _read(Path(dirpath) / "cgroup.procs").split()]
        except (OSError, ValueError):
            continue
    return pids


def is_frozen(cg: Path) -> bool:
    return read_events(cg).get("frozen") == 1


def freeze(cg: Path, timeout: float = 1.0) -> bool:
    """Freeze atomically; True once the kernel reports `frozen 1` (usually within 0.1 ms)."""
    _write(cg / "cgroup.freeze", "1")
    return _wait_events(cg, "frozen", 1, timeout)


def thaw(cg: Path, timeout: float = 1.0) -> bool:
    _write(cg / "cgroup.freeze", "0")
    return _wait_events(cg, "frozen", 0, timeout)


def _wait_events(cg: Path, key: str, want: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    delay = 0.00005
    while True:
        if read_events(cg).get(key) == want:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.005)


def kill_all(cg: Path, sig: int = signal.SIGKILL) -> None:
    """SIGKILL via cgroup.kill (atomic, catches forks in flight); other signals per pid."""
    if sig == signal.SIGKILL and (cg / "cgroup.kill").exists():
        with contextlib.suppress(OSError):
            _write(cg / "cgroup.kill", "1")
            return
    for pid in procs(cg):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def remove(cg: Path, timeout: float = 2.0) -> bool:
    """rmdir the cgroup and its children once empty (kills what is left first)."""
    if not cg.exists():
        return True
    if procs(cg):
        kill_all(cg)
    return _rmdir_tree(cg, timeout)


def _rmdir_tree(cg: Path, timeout: float) -> bool:
    """rmdir deepest first, retrying while the kernel still counts tasks (EBUSY); tasks
    that are left get SIGKILL (v1 has no cgroup.kill)."""
    deadline = time.monotonic() + timeout
    for dirpath, _dirs, _files in sorted(os.walk(cg), key=lambda t: -len(t[0])):
        while True:
            try:
                os.rmdir(dirpath)
                break
            except FileNotFoundError:
                break
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    return False
                with contextlib.suppress(OSError, ValueError):
                    for pid in _read(Path(dirpath) / "cgroup.procs").split():
                        os.kill(int(pid), signal.SIGKILL)
                time.sleep(0.01)
    return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class CgroupTree:
    """fleettop's own part of the cgroup v2 hierarchy for one running supervisor."""

    mount: Path
    base: Path
    fleet_dir: Path
    controllers: frozenset[str]
    v1_memory: Path | None = None
    """`<v1 memory>/fleettop/<fleet-id>.<pid>`, used for limits.memory when v2 has no
    memory controller (hybrid mounts); None where it isn't needed or can't be made."""

    @classmethod
    def create(cls, fleet_id: str) -> tuple[CgroupTree | None, str]:
        """(tree, "") when cgroup v2 is writable here, else (None, why not)."""
        mount = find_v2_mount()
        if mount is None:
            return None, "no cgroup v2 mount in /proc/self/mounts"
        base = mount / BASE_NAME
        try:
            base.mkdir(exist_ok=True)
            fleet_dir = base / f"{fleet_id}.{os.getpid()}"
            fleet_dir.mkdir(exist_ok=True)
        except OSError as exc:
            return None, f"cgroup v2 at {mount} is not writable ({exc.strerror})"
        available = set(_read(mount / "cgroup.controllers").split())
        enabled: set[str] = set()
        for ctl in ("memory", "pids", "cpu"):
            if ctl not in available:
                continue
            try:
                for parent in (mount, base, fleet_dir):
                    if ctl not in _read(parent / "cgroup.subtree_control").split():
                        _write(parent / "cgroup.subtree_control", f"+{ctl}")
                enabled.add(ctl)
            except OSError:
                continue
        v1 = None
        if "memory" not in enabled:
            own = find_v1_memory()
            if own is not None:
                try:
                    v1 = own / BASE_NAME / f"{fleet_id}.{os.getpid()}"
                    v1.mkdir(parents=True, exist_ok=True)
                except OSError:
                    v1 = None
        return cls(mount, base, fleet_dir, frozenset(enabled), v1), ""

    def agent_dir(self, name: str) -> Path:
        cg = self.fleet_dir / name
        cg.mkdir(exist_ok=True)
        return cg

    def set_memory_max(self, cg: Path, limit: int | None) -> str:
        """"" on success, else why the limit could not be applied."""
        if "memory" not in self.controllers:
            return "memory controller not available in cgroup v2 here"
        try:
            _write(cg / "memory.max", str(limit) if limit else "max")
        except OSError as exc:
            return f"cannot write memory.max: {exc.strerror}"
        return ""

    def v1_memory_dir(self, name: str, limit: int) -> tuple[Path | None, str]:
        """(the agent's v1 memory cgroup with the limit set, "") or (None, why not)."""
        if self.v1_memory is None:
            return None, "memory controller in neither cgroup v2 nor a v1 hierarchy we can use"
        cg = self.v1_memory / name
        try:
            cg.mkdir(exist_ok=True)
            _write(cg / "memory.limit_in_bytes", str(limit))
        except OSError as exc:
            return None, f"cannot set the v1 memory limit: {exc.strerror}"
        return cg, ""

    def destroy(self) -> None:
        remove(self.fleet_dir)
        if self.v1_memory is not None:
            remove_v1(self.v1_memory)


def remove_v1(cg: Path, timeout: float = 2.0) -> bool:
    """rmdir a v1 cgroup tree, killing its tasks (v1 has no cgroup.kill)."""
    return _rmdir_tree(cg, timeout)


def cleanup_stale() -> list[Path]:
    """Remove cgroups left by fleettop supervisors that are dead (killed with SIGKILL).

    A directory `<fleet-id>.<pid>` is stale only when that pid is gone — never by age.
    Their processes are killed first: an agent must not outlive its supervisor.
    """
    mount = find_v2_mount()
    if mount is None or not (mount / BASE_NAME).is_dir():
        return []
    removed = []
    own_v1 = find_v1_memory()
    if own_v1 is not None and (own_v1 / BASE_NAME).is_dir():
        for entry in (own_v1 / BASE_NAME).iterdir():
            _, _, pid_text = entry.name.rpartition(".")
            if (entry.is_dir() and pid_text.isdigit() and int(pid_text) != os.getpid()
                    and not _pid_alive(int(pid_text)) and remove_v1(entry)):
                removed.append(entry)
    for entry in (mount / BASE_NAME).iterdir():
        if not entry.is_dir():
            continue
        stem, _, pid_text = entry.name.rpartition(".")
        if not stem or not pid_text.isdigit():
            continue
        pid = int(pid_text)
        if pid == os.getpid() or _pid_alive(pid):
            continue
        kill_all(entry)
        if remove(entry):
            removed.append(entry)
    return removed
