"""`fleettop route TASK`: which model a task gets on this machine now, and why."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from fleettop.supervisor.config.gpu import ModelsSection, RoutesSection
from fleettop.supervisor.gpu.router import NoRoute, detect_hardware, gib, route


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("route", help="which model a task gets on this machine now, and why")
    p.add_argument("task", help="task name from routes: (or a model name)")
    p.add_argument("-f", "--file", default="fleet.yaml", help="fleet file (default fleet.yaml)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=run)
    return p


def sections_of(fleet: Any) -> tuple[ModelsSection, RoutesSection]:
    """The fleet's models:/routes:, whether config.py holds them typed or as raw mappings."""

    def raw(section: Any) -> Any:
        if isinstance(section, ModelsSection | RoutesSection):
            return section.root
        return getattr(section, "model_extra", None) or getattr(section, "root", None) or {}

    models = fleet.models if isinstance(fleet.models, ModelsSection) else \
        ModelsSection.model_validate(raw(fleet.models))
    routes = fleet.routes if isinstance(fleet.routes, RoutesSection) else \
        RoutesSection.model_validate(raw(fleet.routes))
    return models, routes


def run(args: argparse.Namespace) -> int:
    from fleettop.supervisor.config.load import FleetError, load_fleet

    try:
        models, routes = sections_of(load_fleet(args.file))
    except (FleetError, OSError, ValueError) as exc:
        print(f"fleettop route: {exc}", file=sys.stderr)
        return 2
    from fleettop.probes.sensors.nvml import open_nvml

    hw = detect_hardware(open_nvml())
    try:
        choice = route(args.task, hw, models, routes)
    except NoRoute as exc:
        if args.json:
            print(json.dumps({"task": args.task, "error": str(exc), "verdicts": [
                {"candidate": c, "verdict": v} for c, v in exc.verdicts]}))
        else:
            print(f"fleettop route: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(choice.to_json() | {"hardware": {
            "gpu": hw.gpu, "vram_total": hw.vram_total, "vram_free": hw.vram_free,
            "cpus": hw.cpus, "ram_total": hw.ram_total}}))
        return 0
    where = f"GPU {gib(hw.vram_free)} free of {gib(hw.vram_total)}" if hw.gpu else "no GPU"
    print(f"{args.task} → {choice.name} ({choice.model} at {choice.url}, {choice.entry.device})"
          f" on this machine ({where}, {hw.cpus} CPUs)")
    for cand, v in choice.verdicts:
        print(f"  {cand}: {'chosen' if v == 'ok' else v}")
    return 0
