"""Shared fixtures: every test gets its own state and runtime dirs, so fleets never collide.

Tests outside tests/unit are marked `slow` here: `./test.sh -m "not slow"` runs the fast part."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _private_dirs(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    base = tmp_path_factory.mktemp("fleettop-dirs")
    monkeypatch.setenv("FLEETTOP_STATE_DIR", str(base / "state"))
    monkeypatch.setenv("FLEETTOP_RUNTIME_DIR", str(base / "run"))
    yield


_FAST = Path(__file__).parent / "unit"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _FAST not in Path(item.fspath).parents:
            item.add_marker(pytest.mark.slow)
