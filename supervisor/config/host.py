"""Whether a valid fleet file can start on this host: programs, folders, users, state dir.

The schema (load.py) says what a file means; this says what this machine makes of it. A
missing folder, user or state dir stops the start: errors. A program not found on PATH is a
warning: the host that runs the agent may have it (another node, a venv made later).
"""

from __future__ import annotations

import os
import pwd
import shutil
from pathlib import Path

from fleettop.supervisor.config.fleet import Fleet
from fleettop.supervisor.config.load import Marks, Problem


def host_problems(fleet: Fleet, file: str, marks: Marks) -> tuple[list[Problem], list[Problem]]:
    """(errors, warnings), each with the position of the field it is about."""
    errors: list[Problem] = []
    warnings: list[Problem] = []

    def at(path: tuple[str | int, ...], message: str) -> Problem:
        line, col = marks.get(path) or marks.get(path[:-1]) or (1, 1)
        dotted = ".".join(str(p) for p in path)
        return Problem(file, line, col, dotted, message)

    home = Path(file).resolve().parent
    for name, spec in fleet.agents.items():
        cwd = Path(spec.cwd).expanduser() if spec.cwd else home
        if spec.cwd and not cwd.is_dir():
            errors.append(at(("agents", name, "cwd"), f"no folder {spec.cwd!r} on this host"))
        if spec.user:
            try:
                pwd.getpwnam(spec.user)
            except KeyError:
                errors.append(at(("agents", name, "user"), f"no user {spec.user!r} on this "
                                 "host"))
        if not spec.shell:
            why = _program_missing(spec.argv()[0], spec.env.get("PATH") or os.environ.get(
                "PATH", os.defpath), cwd)
            if why:
                warnings.append(at(("agents", name, "cmd"), f"{why} (fine if the host that "
                                   "runs this agent has it; a start without it fails)"))
    if fleet.state_dir:
        why = _not_creatable(Path(fleet.state_dir).expanduser())
        if why:
            errors.append(at(("state_dir",), why))
    return errors, warnings


def _program_missing(program: str, path: str, cwd: Path) -> str:
    if program == "fleettop":
        return ""  # this fleettop: the supervisor finds its own
    if "/" in program:
        full = cwd / program
        if not full.is_file() or not os.access(full, os.X_OK):
            return f"{program!r} is not an executable file on this host"
        return ""
    return "" if shutil.which(program, path=path) else f"{program!r} is not on this host's PATH"


def _not_creatable(folder: Path) -> str:
    if folder.exists():
        if not folder.is_dir():
            return f"{str(folder)!r} is not a folder"
        return "" if os.access(folder, os.W_OK | os.X_OK) else f"{str(folder)!r} is not writable"
    parent = folder.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot make {str(folder)!r}: {str(parent)!r} is not a writable folder"
    return ""
