"""The core and the probes run headless: importing them must never load Textual (STYLE §1)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ["fleettop.supervisor.cli.main", "fleettop.supervisor.core.supervisor",
        "fleettop.supervisor.cli.run", "fleettop.supervisor.cli.assemble",
        "fleettop.supervisor.web.server", "fleettop.probes.sensors.source",
        "fleettop.probes.proxy.breaker", "fleettop.probes.proxy.wire",
        "fleettop.supervisor.cli.doctor"]


@pytest.mark.parametrize("module", CORE)
def test_core_module_does_not_import_textual(module: str) -> None:
    code = (f"import sys, {module}; "
            "bad = [m for m in sys.modules if m == 'textual' or m.startswith('fleettop.tui')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, f"{module} pulled in {run.stdout.strip()} {run.stderr[-500:]}"


def test_headless_run_path_stays_light() -> None:
    """No numpy, aiohttp or mitmproxy in the supervisor unless a capability asks for it."""
    code = ("import sys, fleettop.supervisor.cli.main, fleettop.supervisor.cli.run, "
            "fleettop.supervisor.cli.assemble, fleettop.supervisor.config.fleet; "
            "print([m for m in ('numpy', 'aiohttp', 'mitmproxy', 'textual') if m in sys.modules])")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.stdout.strip() == "[]", run.stdout + run.stderr


def test_regular_install_layout_and_import_contract(tmp_path: Path) -> None:
    """`pip install .` (not editable): only `fleettop/` lands in site-packages — nothing named
    `supervisor` to clobber supervisord —, every subpackage of the three roots is installed,
    and the import-linter contracts hold on it."""
    # From a copy of the source: setuptools reuses an in-tree build/ that can hold modules
    # since moved or deleted, and would install them too.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        "build", "dist", ".venv*", ".git", "*.egg-info", "__pycache__", "test-artifacts"))
    target = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                          "--target", str(target), str(src)], capture_output=True, text=True)
    assert pip.returncode == 0, pip.stderr[-2000:]
    top = sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info"))
    assert top == ["bin", "fleettop"], top
    assert sorted(p.name for p in (target / "fleettop").iterdir()) == ["probes", "supervisor",
                                                                        "tui"]
    for root in ("supervisor", "probes", "tui"):
        for init in (ROOT / root).rglob("__init__.py"):
            rel = init.relative_to(ROOT)
            assert (target / "fleettop" / rel).exists(), f"{rel.parent} is not installed"
    assert (target / "fleettop/tui/fleettop.tcss").exists()
    assert (target / "fleettop/probes/sensors/ebpf.c").exists()
    assert (target / "fleettop/supervisor/web/page.html").exists()
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if lint is None:
        pytest.skip("import-linter is not installed (pip install -e .[test])")
    run = subprocess.run([lint, "--no-cache", str(ROOT / "pyproject.toml")], cwd=tmp_path,
                         capture_output=True, text=True, env={**os.environ,
                                                              "PYTHONPATH": str(target)})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
