"""Router decisions as a table: hardware × load × budget → choice; and `fleettop route`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fleettop.supervisor.config.gpu import ModelsSection, RoutesSection, check_routes
from fleettop.supervisor.gpu.router import (
    Choice,
    Hardware,
    Load,
    NoRoute,
    Spend,
    apply_choice,
    route,
    task_of,
)

GIB = 2**30
MODELS = ModelsSection.model_validate({
    "tiny": {"backend": "ollama", "url": "http://127.0.0.1:11434", "model": "qwen2.5:0.5b",
             "device": "cpu", "context": 8192},
    "writer": {"backend": "ollama", "url": "http://127.0.0.1:11434", "model": "qwen2.5:7b",
               "device": "gpu", "vram": "5GiB", "context": 32768},
    "big": {"backend": "vllm", "url": "http://127.0.0.1:8000/v1", "model": "qwen2.5-32b",
            "device": "gpu", "vram": "20GiB"},
    "cloud": {"backend": "openai", "url": "https://api.example.com/v1", "model": "free-70b",
              "device": "cloud", "budget": {"requests": 50, "period": "1d"}},
})
ROUTES = RoutesSection.model_validate({
    "classify": ["tiny"],
    "write": {"use": ["writer", "cloud", "tiny"], "max_queue": 3, "min_context": 4096},
    "think": ["big", "writer", "cloud"],
})

POTATO = Hardware(gpu=False, cpus=4, ram_total=8 * GIB)
LAPTOP = Hardware(gpu=True, vram_total=6 * GIB, vram_free=5 * GIB + GIB // 2, cpus=8)
LAPTOP_BUSY = Hardware(gpu=True, vram_total=6 * GIB, vram_free=GIB, cpus=8)
WORKSTATION = Hardware(gpu=True, vram_total=24 * GIB, vram_free=23 * GIB, cpus=32)


@pytest.mark.parametrize(("task", "hw", "load", "want", "fallback"), [
    ("classify", WORKSTATION, Load(), "tiny", 0),
    ("write", POTATO, Load(), "cloud", 1),
    ("write", LAPTOP, Load(), "writer", 0),
    ("write", LAPTOP_BUSY, Load(), "cloud", 1),  # 5 GiB needed, 1 GiB free
    ("write", LAPTOP_BUSY, Load(loaded={"writer"}), "writer", 0),  # already resident
    ("write", LAPTOP, Load(gpu_queue=4), "cloud", 1),  # queue longer than max_queue
    ("write", LAPTOP, Load(gpu_queue=3), "writer", 0),
    ("write", POTATO, Load(spent={"cloud": Spend(requests=50)}), "tiny", 2),  # over budget
    ("write", LAPTOP, Load(down={"writer"}), "cloud", 1),
    ("think", WORKSTATION, Load(), "big", 0),
    ("think", LAPTOP, Load(), "writer", 1),  # 20 GiB won't fit a 6 GiB card
    ("think", POTATO, Load(), "cloud", 2),
    ("writer", POTATO, Load(), None, None),  # a bare model name: GPU model, no GPU
    ("tiny", POTATO, Load(), "tiny", 0),
])
def test_route_table(task: str, hw: Hardware, load: Load, want: str | None,
                     fallback: int | None) -> None:
    if want is None:
        with pytest.raises(NoRoute):
            route(task, hw, MODELS, ROUTES, load)
        return
    choice = route(task, hw, MODELS, ROUTES, load)
    assert (choice.name, choice.fallback) == (want, fallback)


def test_verdicts_explain_each_skipped_candidate() -> None:
    choice = route("think", LAPTOP, MODELS, ROUTES)
    assert choice.verdicts[0] == ("big", "needs 20.0GiB of VRAM; the GPU has 6.0GiB")
    assert choice.verdicts[1] == ("writer", "ok")
    with pytest.raises(NoRoute) as err:
        route("think", POTATO, MODELS, ROUTES,
              Load(spent={"cloud": Spend(requests=99)}))
    assert "over budget" in str(err.value) and "needs a GPU" in str(err.value)
    with pytest.raises(NoRoute):
        route("nope", WORKSTATION, MODELS, ROUTES)


def test_proxy_helpers_rewrite_the_request() -> None:
    assert task_of("route:write") == "write"
    assert task_of("qwen2.5:7b") is None and task_of("route:") is None and task_of(None) is None
    body = {"model": "route:write", "messages": []}
    choice: Choice = route(task_of(body["model"]) or "", LAPTOP, MODELS, ROUTES)
    apply_choice(body, choice)
    assert body["model"] == "qwen2.5:7b" and choice.url == "http://127.0.0.1:11434"
    assert choice.to_json()["verdicts"] == [{"candidate": "writer", "verdict": "ok"}]


def test_check_routes_names_unknown_models() -> None:
    bad = RoutesSection.model_validate({"write": ["writer", "ghost"]})
    assert check_routes(MODELS, bad) == [
        "routes.write: unknown model 'ghost' (known: big, cloud, tiny, writer)"]
    assert check_routes(MODELS, ROUTES) == []


def test_route_cli_explains_on_this_machine(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "agents:\n  a: {cmd: 'true'}\n"
        "models:\n"
        "  tiny: {backend: ollama, url: 'http://127.0.0.1:11434', device: cpu}\n"
        "  writer: {backend: ollama, url: 'http://127.0.0.1:11434', vram: 5GiB}\n"
        "routes:\n  write: [writer, tiny]\n")
    code = ("import sys, argparse; from fleettop.supervisor.cli import route as router; "
            "p = argparse.ArgumentParser(); router.add_parser(p.add_subparsers()); "
            "a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))")
    env = {"FLEETTOP_STATE_DIR": str(tmp_path / "state"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code, "route", "-f", str(fleet), "write",
                          "--json"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    # This machine may or may not have a GPU: the answer must match what it found.
    want = "writer" if data["hardware"]["vram_free"] >= 5 * GIB else "tiny"
    assert data["name"] == want and data["verdicts"][-1]["verdict"] == "ok"
    text = subprocess.run([sys.executable, "-c", code, "route", "-f", str(fleet), "write"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert text.returncode == 0 and f"write → {want}" in text.stdout
    missing = subprocess.run([sys.executable, "-c", code, "route", "-f", str(fleet), "nope"],
                             capture_output=True, text=True, timeout=60, env=env)
    assert missing.returncode == 1 and "no model for task 'nope'" in missing.stderr
