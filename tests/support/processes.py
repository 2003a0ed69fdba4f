"""Helpers for tests that run real processes: the CLI, the proxy, cgroup skips."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleettop.supervisor.core import cgroups


def cgroup_v2_writable() -> str:
    """"" when this machine lets us make cgroups, else why not (for skip messages)."""
    mount = cgroups.find_v2_mount()
    if mount is None:
        return "no cgroup v2 mount"
    if os.geteuid() != 0 and not os.access(mount, os.W_OK):
        return f"cgroup v2 at {mount} not writable by uid {os.geteuid()} (run as root)"
    return ""


needs_cgroups = pytest.mark.skipif(bool(cgroup_v2_writable()),
                                   reason=f"needs a writable cgroup v2: {cgroup_v2_writable()}")
FLEETTOP = [sys.executable, "-m", "fleettop.supervisor.cli.main"]


def write_fleet(tmp: Path, text: str, name: str = "fleet.yaml") -> Path:
    path = tmp / name
    path.write_text(text)
    return path


def spawn_proxy(state: Path, tokens: dict, cfg: dict, stderr=subprocess.PIPE,
                env: dict | None = None) -> subprocess.Popen:
    """The real proxy process (proxy_main) in `state`, with its token and config files
    written there; JSON reports on its stdout, commands on its stdin (text mode)."""
    (state / "tokens.json").write_text(json.dumps(tokens))
    (state / "cfg.json").write_text(json.dumps(cfg))
    return subprocess.Popen(
        [sys.executable, "-m", "fleettop.probes.proxy.main", "--state-dir", str(state),
         "--config", str(state / "cfg.json"), "--tokens", str(state / "tokens.json")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)


def end_by_eof(proc: subprocess.Popen, timeout: float = 10) -> None:
    """Stop a process that exits when its stdin closes (the proxy); kill it if it doesn't."""
    proc.stdin.close()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
