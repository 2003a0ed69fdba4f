"""A tiny sidecar that kills every agent if the supervisor dies without cleaning up.

PR_SET_PDEATHSIG only reaches an agent's first process; a grandchild that forked or called
setsid survives a SIGKILLed supervisor (supervisord#1101, overmind#17). The reaper is a
separate `python -S` process holding the read end of a pipe: when the supervisor dies for any
reason the pipe closes, and the reaper kills the fleet's cgroup (cgroup.kill is recursive and
atomic) and every process group it was told about, then exits. ~8 MiB, no imports beyond os.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

_REAPER = r"""
import os, signal, sys, time
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGTSTP):
    signal.signal(s, signal.SIG_IGN)  # Ctrl-C in the pane must not take the reaper first
cg = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] else None
v1 = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] else None
groups = set()
for line in sys.stdin.buffer:
    line = line.strip()
    if line == b"exit":
        sys.exit(0)
    if line[:1] in (b"+", b"-") and line[1:].isdigit():
        (groups.add if line[:1] == b"+" else groups.discard)(int(line[1:]))
# EOF: the supervisor is gone without saying goodbye.
if cg:
    try:
        with open(os.path.join(cg, "cgroup.kill"), "w") as fh:
            fh.write("1")
    except OSError:
        for d, _, _ in os.walk(cg):
            try:
                for pid in open(os.path.join(d, "cgroup.procs")).read().split():
                    os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
for g in groups:
    try:
        os.killpg(g, signal.SIGKILL)
    except OSError:
        pass
for root in (cg, v1):  # the v2 tree, and the v1 memory cgroups beside it (hybrid hosts)
    if not root:
        continue
    for _ in range(200):
        try:
            for d, _, _ in sorted(os.walk(root), key=lambda t: -len(t[0])):
                os.rmdir(d)
            break
        except OSError:
            time.sleep(0.01)
"""


class Reaper:
    def __init__(self, cgroup_dir: Path | None, v1_memory_dir: Path | None = None) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-S", "-I", "-c", _REAPER, str(cgroup_dir or ""),
             str(v1_memory_dir or "")],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            close_fds=True,
        )
        self.pid = self._proc.pid

    def _send(self, line: str) -> None:
        assert self._proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, ValueError):
            self._proc.stdin.write(line.encode() + b"\n")
            self._proc.stdin.flush()

    def track(self, pgid: int) -> None:
        self._send(f"+{pgid}")

    def untrack(self, pgid: int) -> None:
        self._send(f"-{pgid}")

    def close(self) -> None:
        """Clean exit: everything was stopped by the supervisor itself."""
        self._send("exit")
        with contextlib.suppress(Exception):
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            self._proc.wait(timeout=2)
