"""A separate venv for real agent SDKs: the official `openai` and `ollama` clients + `requests`.

They can't share fleettop's venv: mitmproxy 11.0.2 pins `h11<=0.14`, which the current httpx
stack these SDKs need does not accept. Real agents run in their own venvs too, so tests run
client scripts with this venv's python, pointed at the proxy by `proxy_env(...)`.

The venv is built once (pip from the package registry) and cached at `.venv-agents/` in the
repository root, or at `$FLEETTOP_AGENTS_VENV`. When it can't be built (no network, no venv
module) `agents_python()` skips the calling test with the reason.
"""

from __future__ import annotations

import fcntl
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("openai", "ollama", "requests")
CHECK = ("import openai, ollama, requests; from importlib.metadata import version as v; "
         "print(*(f'{p}=={v(p)}' for p in ('openai', 'ollama', 'requests', 'httpx')))")
_STAMP = ".fleettop-agents-ok"


def venv_dir() -> Path:
    return Path(os.environ.get("FLEETTOP_AGENTS_VENV") or ROOT / ".venv-agents")


def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _clean_env() -> dict[str, str]:
    # pip itself must not go through a proxy a test may have exported.
    return {k: v for k, v in os.environ.items()
            if k.lower() not in ("http_proxy", "https_proxy", "all_proxy", "no_proxy",
                                 "ssl_cert_file", "requests_ca_bundle", "pythonpath")}


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_clean_env(),
                          stdin=subprocess.DEVNULL)


def _build(venv: Path) -> str:
    """Create and fill the venv; "" on success, else why not."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    try:
        if not _python(venv).exists():
            made = _run([base, "-m", "venv", str(venv)], timeout=120)
            if made.returncode != 0:
                return f"python -m venv failed: {made.stderr.strip()[-400:]}"
        pip = _run([str(_python(venv)), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    *PACKAGES], timeout=600)
        if pip.returncode != 0:
            return f"pip install {' '.join(PACKAGES)} failed: {pip.stderr.strip()[-600:]}"
        check = _run([str(_python(venv)), "-c", CHECK], timeout=120)
        if check.returncode != 0:
            return f"agents venv broken: {check.stderr.strip()[-400:]}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot build the agents venv: {exc}"
    (venv / _STAMP).write_text(check.stdout)
    return ""


@functools.cache
def _ensure() -> tuple[str, str]:
    venv = venv_dir()
    if (venv / _STAMP).exists() and _python(venv).exists():
        return str(_python(venv)), ""
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test runs build it once
        if (venv / _STAMP).exists() and _python(venv).exists():
            return str(_python(venv)), ""
        why = _build(venv)
    return ("", why) if why else (str(_python(venv)), "")


def agents_python() -> str:
    """The agents venv's python (built on first use), or skip the test with the reason."""
    python, why = _ensure()
    if not python:
        pytest.skip(f"no agents venv (openai/ollama/requests): {why}")
    return python


def versions() -> str:
    """The SDK versions installed there, for messages."""
    venv = venv_dir()
    stamp = venv / _STAMP
    return stamp.read_text().strip() if stamp.exists() else "?"
