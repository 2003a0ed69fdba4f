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


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pip install .` (not editable) into a folder of its own; returns that folder."""
    tmp = tmp_path_factory.mktemp("install")
    # From a copy of the source: setuptools reuses an in-tree build/ that can hold modules
    # since moved or deleted, and would install them too.
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        "build", "dist", ".venv*", ".git", "*.egg-info", "__pycache__", "test-artifacts"))
    target = tmp / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                          "--target", str(target), str(src)], capture_output=True, text=True)
    assert pip.returncode == 0, pip.stderr[-2000:]
    return target


def test_regular_install_layout(installed: Path) -> None:
    """Only `fleettop/` lands in site-packages — nothing named `supervisor` to clobber
    supervisord — and every subpackage of the three roots is installed with its data."""
    top = sorted(p.name for p in installed.iterdir() if not p.name.endswith(".dist-info"))
    assert top == ["bin", "fleettop"], top
    assert sorted(p.name for p in (installed / "fleettop").iterdir()) == ["probes", "supervisor",
                                                                           "tui"]
    for root in ("supervisor", "probes", "tui"):
        for init in (ROOT / root).rglob("__init__.py"):
            rel = init.relative_to(ROOT)
            assert (installed / "fleettop" / rel).exists(), f"{rel.parent} is not installed"
    assert (installed / "fleettop/tui/fleettop.tcss").exists()
    assert (installed / "fleettop/probes/sensors/ebpf.c").exists()
    assert (installed / "fleettop/supervisor/web/page.html").exists()


def test_import_contracts_hold(installed: Path, tmp_path: Path) -> None:
    """The layers and the UI/core separation of pyproject's [tool.importlinter]. Checked on a
    regular install: import-linter cannot see the folders an editable install maps."""
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if lint is None:
        pytest.skip("import-linter is not installed (pip install -e .[test])")
    run = subprocess.run([lint, "--no-cache", str(ROOT / "pyproject.toml")], cwd=tmp_path,
                         capture_output=True, text=True, env={**os.environ,
                                                              "PYTHONPATH": str(installed)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "BROKEN" not in run.stdout and "KEPT" in run.stdout, run.stdout[-3000:]


CYCLES = """
import sys, grimp
graph = grimp.build_graph("fleettop", cache_dir=None, exclude_type_checking_imports=True)
index, low, stack, on, out, n = {}, {}, [], set(), [], [0]
sys.setrecursionlimit(10000)
def visit(v):
    index[v] = low[v] = n[0]; n[0] += 1; stack.append(v); on.add(v)
    for w in graph.find_modules_directly_imported_by(v):
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop(); on.discard(w); comp.append(w)
            if w == v:
                break
        if len(comp) > 1:
            out.append(sorted(comp))
for m in sorted(graph.modules):
    if m not in index:
        visit(m)
print(len(graph.modules), out)
"""


def test_no_import_cycles(installed: Path) -> None:
    """No module imports itself through others, lazy imports included (grimp's graph of every
    import statement that runs; strongly connected components of more than one module).
    Imports under `if TYPE_CHECKING:` are left out: core/spawn.py and its siblings name the
    Supervisor in annotations only."""
    pytest.importorskip("grimp", reason="grimp comes with import-linter (pip install -e .[test])")
    run = subprocess.run([sys.executable, "-c", CYCLES], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(installed)})
    assert run.returncode == 0, run.stderr[-2000:]
    count, cycles = run.stdout.split(" ", 1)
    assert int(count) > 90, run.stdout  # the whole tree was read
    assert cycles.strip() == "[]", cycles
