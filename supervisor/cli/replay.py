"""`fleettop replay PATH...`: the command line of the replay engine (fleettop.supervisor.replay)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from fleettop.supervisor.replay import FORMATS, BadInput, ReplayParams, replay_path


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "replay", help="run recorded traffic or memory traces through the detectors",
        description="Run recorded traffic (response streams, request logs, incident folders) "
                    "and memory traces through the detectors the proxy runs; one verdict per "
                    "input. Exit 0: all ok, 1: a loop or leak, 2: unreadable input.")
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="response stream, request log, memory trace or incident folder")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--config", metavar="FILE",
                   help="take thresholds from this fleet file's breaker: (default: defaults)")
    p.add_argument("--agent", metavar="NAME",
                   help="apply this agent's breaker: override from --config (an incident's "
                        "own agent is used by default)")
    p.add_argument("--format", choices=FORMATS, help="don't sniff: read every PATH as this")
    p.add_argument("--limit", metavar="SIZE",
                   help="memory limit for memory traces' time-to-limit (e.g. 4GiB)")
    p.set_defaults(func=run)
    return p


def _describe(result: dict[str, Any]) -> str:
    name, verdict = result["input"], result["verdict"]
    if result["format"] == "memory":
        slope = result.get("slope_bytes_per_s")
        fit = f"slope {slope / 1024:.1f} KiB/s, R² {result.get('r2') or 0:.3f}" \
            if slope is not None else "too few samples to fit"
        when = (f", declared at {result['detected_at_s']:.0f}s"
                if result.get("detected_at_s") is not None else "")
        return f"{name}: {verdict} (memory trace: {fit}{when})"
    if verdict == "ok":
        size = (f"{result['requests']} requests" if result["format"] == "requests"
                else f"{result.get('chars', 0)} chars")
        return f"{name}: ok ({result['format']}, {size})"
    where = (f"request {result['at_request']}" if result.get("at_request") is not None
             else f"char {result['at_char']}")
    tier = (result.get("evidence") or {}).get("tier")
    line = (f"{name}: loop ({result['kind']}{', ' + tier if tier else ''}) at {where}: "
            f"{result['reason']}")
    if result.get("reproduced") is not None:
        line += " [recorded trip reproduced]" if result["reproduced"] else \
            f" [recorded {result['recorded'].get('kind')} not reproduced]"
    return line


def _params_for(args: argparse.Namespace, fleet: Any, incident: Path | None,
                limit: float | None) -> ReplayParams:
    if fleet is None:
        return ReplayParams(memory_limit=limit)
    agent = args.agent
    if agent is None and incident is not None:
        try:
            agent = json.loads((incident / "event.json").read_text()).get("agent")
        except (OSError, ValueError):
            agent = None
    return ReplayParams.from_fleet(fleet, agent, limit)


def run(args: argparse.Namespace) -> int:
    from fleettop.supervisor.config.units import parse_size

    try:
        limit = float(parse_size(args.limit)) if args.limit else None
    except ValueError as exc:
        print(f"--limit: {exc}", file=sys.stderr)
        return 2
    if args.agent and not args.config:
        print("--agent needs --config (the fleet file that declares the agent)", file=sys.stderr)
        return 2
    fleet = None
    if args.config:
        from fleettop.supervisor.config.load import FleetError, load_fleet

        try:
            fleet = load_fleet(args.config)
        except FleetError as exc:
            for problem in exc.problems:
                print(problem, file=sys.stderr)
            return 2
        if args.agent and args.agent not in fleet.agents:
            print(f"{args.config}: no agent {args.agent!r}", file=sys.stderr)
            return 2
    status = 0
    for raw in args.paths:
        path = Path(raw)
        try:
            params = _params_for(args, fleet, path if path.is_dir() else None, limit)
            result = replay_path(path, args.format, params)
        except (BadInput, OSError, ValueError) as exc:
            message = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            print(f"{raw}: {message}", file=sys.stderr)
            if args.json:
                print(json.dumps({"input": raw, "verdict": "error", "error": message}),
                      flush=True)
            status = 2
            continue
        print(json.dumps(result, default=str) if args.json else _describe(result), flush=True)
        if result["verdict"] != "ok" and status == 0:
            status = 1
    return status
