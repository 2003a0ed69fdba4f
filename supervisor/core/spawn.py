"""Starting one agent: its user, environment and argv, its cgroups, and the exec shim."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import functools
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from fleettop.supervisor.config.fleet import AgentSpec
from fleettop.supervisor.core import cgroups
from fleettop.supervisor.core.agent import AgentRuntime
from fleettop.supervisor.core.logs import AgentLog

if TYPE_CHECKING:
    from fleettop.supervisor.core.supervisor import Supervisor


PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
# Joining the cgroup, dropping privileges and PR_SET_PDEATHSIG must happen between fork and
# exec. A Python preexec_fn does that but forces fork() of the whole supervisor and runs
# Python in the child (~7 ms a spawn); `sh` + util-linux `setpriv` do it after a vfork
# (~1 ms), so 200 agents start in a fraction of the time. preexec_fn stays as the fallback.
_SETPRIV = shutil.which("setpriv")
# sh -c SCRIPT sh CGPROCS... -- CMD...: join each cgroup (writing 0 moves the writer), exec.
_JOIN_CGROUPS = ('for f; do [ "$f" = -- ] && break; echo 0 > "$f" || exit 126; shift; done; '
                 'shift; exec "$@"')


def resolve_user(sup: Supervisor, spec: AgentSpec) -> tuple[pwd.struct_passwd | None, str]:
    """Which user an agent runs as, and a warning when that is root by default."""
    if os.geteuid() != 0:
        if spec.user and spec.user != pwd.getpwuid(os.geteuid()).pw_name:
            raise PermissionError(f"user {spec.user!r} needs fleettop to run as root")
        return None, ""
    name = spec.user or os.environ.get("SUDO_USER")
    if not name and sup.fleet.path:
        with contextlib.suppress(OSError, KeyError):
            owner = pwd.getpwuid(Path(sup.fleet.path).stat().st_uid)
            if owner.pw_uid != 0:
                name = owner.pw_name
    if not name:
        return None, "runs as root: no `user:`, no sudo invoker, fleet file owned by root"
    entry = pwd.getpwnam(name)
    return (None, "") if entry.pw_uid == 0 else (entry, "")


def agent_env(sup: Supervisor, rt: AgentRuntime, user: pwd.struct_passwd | None) -> dict[str, str]:
    env = dict(os.environ)
    if user is not None:
        env.update(HOME=user.pw_dir, USER=user.pw_name, LOGNAME=user.pw_name)
    env.update(rt.spec.env)
    env["FLEETTOP_AGENT"] = rt.name
    env["FLEETTOP_FLEET"] = sup.fleet_id
    env.setdefault("PYTHONUNBUFFERED", "1")
    for cap in sup.capabilities:
        cap.agent_env(rt.spec, env)
    return env


def agent_argv(sup: Supervisor, spec: AgentSpec) -> list[str]:
    argv = spec.argv()
    # `fleettop` in a cmd means this fleettop, even when its venv isn't on PATH.
    if argv and argv[0] == "fleettop":
        own = Path(sys.executable).parent / "fleettop"
        if own.exists():
            argv[0] = str(own)
    return argv


def spawn(sup: Supervisor, rt: AgentRuntime) -> None:
    spec = rt.spec
    user, warning = resolve_user(sup, spec)
    if warning and rt.run_id == 0:
        sup.emit("agent.warning", rt.name, warning)
    if rt.log is None:
        name = rt.name

        def trouble(why: str | None) -> None:  # once when it starts failing, once when fixed
            if why is None:
                sup.emit("log.recovered", name, "the log file is written again")
            else:
                sup.emit("log.failing", name, f"{why}; the last lines are kept in memory")

        rt.log = AgentLog(sup.log_dir / f"{rt.name}.log", spec.log.max_bytes,
                          spec.log.backups, spec.log.tail_lines, on_trouble=trouble)
    joins: list[str] = []
    """cgroup.procs files the child writes itself into before exec."""
    tree = sup.cgroup_tree
    if tree is not None:
        rt.cgroup = tree.agent_dir(rt.name)
        if cgroups.read_events(rt.cgroup).get("frozen"):
            cgroups.thaw(rt.cgroup)
        joins.append(str(rt.cgroup / "cgroup.procs"))
        limit = spec.limits.memory
        if limit is not None:
            why = tree.set_memory_max(rt.cgroup, limit)
            via = "memory.max (cgroup v2)"
            if why:  # hybrid systems keep the memory controller in v1
                v1, why = tree.v1_memory_dir(rt.name, limit)
                if v1 is not None:
                    joins.append(str(v1 / "cgroup.procs"))
                    via = f"memory.limit_in_bytes (cgroup v1 {v1})"
            if rt.run_id == 0:
                if why:
                    sup.emit("agent.warning", rt.name, f"limits.memory not enforced: {why}")
                else:
                    sup.emit("agent.limits", rt.name, f"memory limit {limit} bytes via {via}",
                              memory_bytes=limit)
    elif spec.limits.memory is not None and rt.run_id == 0:
        sup.emit("agent.warning", rt.name,
                  f"limits.memory not enforced: {sup.cgroup_reason}")
    env = agent_env(sup, rt, user)
    cwd = spec.cwd or (str(Path(sup.fleet.path).resolve().parent) if sup.fleet.path
                       else None)
    uid = user.pw_uid if user else None
    gid = user.pw_gid if user else None
    groups = os.getgrouplist(user.pw_name, user.pw_gid) if user else None
    parent = os.getpid()

    def in_child() -> None:
        # Runs between fork and exec. Order matters: join the cgroup while still root,
        # then drop privileges, then PDEATHSIG (a credential change clears it).
        for procs_file in joins:
            fd = os.open(procs_file, os.O_WRONLY)
            os.write(fd, b"0")
            os.close(fd)
        if uid is not None and gid is not None:
            os.setgroups(groups or [])
            os.setgid(gid)
            os.setuid(uid)
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    argv = agent_argv(sup, spec)
    preexec: Callable[[], None] | None = in_child
    if setpriv_usable():
        check_executable(argv[0], env.get("PATH", os.defpath), cwd)
        shim = [str(_SETPRIV), "--pdeathsig", "KILL"]
        if uid is not None and gid is not None:
            shim += ["--reuid", str(uid), "--regid", str(gid), "--init-groups"]
        argv = [*shim, "--", *argv]
        if joins:
            argv = ["/bin/sh", "-c", _JOIN_CGROUPS, "sh", *joins, "--", *argv]
        preexec = None
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        popen = subprocess.Popen(
            argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
            stdout=out_w, stderr=err_w, start_new_session=True, preexec_fn=preexec,
            close_fds=True,
        )
    finally:
        os.close(out_w)
        os.close(err_w)
    rt.popen, rt.pid = popen, popen.pid
    rt.run_id += 1
    rt.exit_code = None
    rt.started_at = time.time()
    rt.frozen_via = None
    rt.trip = None
    if sup.reaper:
        sup.reaper.track(popen.pid)
    rt.log.note(f"started pid {popen.pid}: {' '.join(spec.argv())}")
    loop = asyncio.get_running_loop()
    for fd, stream in ((out_r, "out"), (err_r, "err")):
        os.set_blocking(fd, False)
        loop.add_reader(fd, on_output, sup, rt, fd, stream)
    sup._pipes[rt.name] = [out_r, err_r]
    pidfd = os.pidfd_open(popen.pid)
    sup._pidfds[rt.name] = pidfd
    sup._exit_waiters[rt.name] = asyncio.Event()
    loop.add_reader(pidfd, sup._on_exit, rt, popen.pid)


def check_executable(cmd: str, path: str, cwd: str | None) -> None:
    """Fail a start up front, as exec would, when the command can't be run."""
    if "/" in cmd:
        full = os.path.join(cwd or ".", cmd)
        if not os.access(full, os.X_OK) or os.path.isdir(full):
            raise FileNotFoundError(f"{cmd}: not an executable file")
    elif shutil.which(cmd, path=path) is None:
        raise FileNotFoundError(f"{cmd}: command not found on PATH")


@functools.cache
def setpriv_usable() -> bool:
    """Asked once, at the first spawn (not at import: `setpriv --help` is a process)."""
    if _SETPRIV is None or not os.path.exists("/bin/sh"):
        return False
    try:
        out = subprocess.run([_SETPRIV, "--help"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return False
    return "--pdeathsig" in out.stdout and "--init-groups" in out.stdout


def on_output(sup: Supervisor, rt: AgentRuntime, fd: int, stream: str) -> None:
    try:
        data = os.read(fd, 65536)
    except BlockingIOError:
        return
    except OSError:
        data = b""
    if not data:
        asyncio.get_running_loop().remove_reader(fd)
        os.close(fd)
        with contextlib.suppress(KeyError, ValueError):
            sup._pipes[rt.name].remove(fd)
        return
    if rt.log is not None:
        rt.log.write(data, stream)


def drain_pipes(sup: Supervisor, rt: AgentRuntime) -> None:
    for fd in list(sup._pipes.get(rt.name, [])):
        # Read what's buffered, but a grandchild may still hold the pipe open: don't wait.
        with contextlib.suppress(OSError):
            while True:
                data = os.read(fd, 65536)
                if not data:
                    break
                if rt.log is not None:
                    rt.log.write(data, "out")
