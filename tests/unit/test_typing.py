"""mypy over the three roots, with pyproject's [tool.mypy] (strict on the pure rooms): 0 errors."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_finds_no_errors(tmp_path: Path) -> None:
    mypy = shutil.which("mypy", path=str(Path(sys.executable).parent))
    if mypy is None:
        pytest.skip("mypy is not installed (pip install -e .[test])")
    # The roots install as fleettop.supervisor, fleettop.probes, fleettop.tui: give mypy a
    # tree of links with those names (an editable install's mapping is invisible to it).
    tree = tmp_path / "fleettop"
    tree.mkdir()
    for root in ("supervisor", "probes", "tui"):
        (tree / root).symlink_to(ROOT / root)
    run = subprocess.run(
        [mypy, "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir",
         str(ROOT / ".mypy_cache"), "-p", "fleettop.supervisor", "-p", "fleettop.probes",
         "-p", "fleettop.tui"], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "Success: no issues found" in run.stdout, run.stdout
