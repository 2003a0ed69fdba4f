"""`fleettop` command line. `fleettop FILE` opens the UI; everything else is a subcommand."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import sys
import time
from typing import Any

from fleettop.supervisor.base import paths
from fleettop.supervisor.config import units
from fleettop.supervisor.config.fleet import Fleet
from fleettop.supervisor.config.load import FleetError, Problem, load_fleet_marked
from fleettop.supervisor.control import server as control

DEFAULT_FILE = "fleet.yaml"
# Subcommands with a module of their own: each module's add_parser(subparsers)
# adds its parser and sets `func` to its run(args) -> int.
PLUGIN_MODULES = {
    "doctor": "fleettop.supervisor.cli.doctor",
    "lock": "fleettop.supervisor.cli.lock",
    "route": "fleettop.supervisor.cli.route",
    "replay": "fleettop.supervisor.cli.replay",
}


def _add_file_opt(p: argparse.ArgumentParser) -> None:
    p.add_argument("-f", "--file", default=DEFAULT_FILE,
                   help="the fleet file (default: ./fleet.yaml)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleettop",
        description="htop for a fleet of local AI agents, with a circuit breaker. "
                    "`fleettop FILE` opens the terminal UI on the fleet in FILE.")
    parser.add_argument("--version", action="version", version=f"fleettop {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    ui = sub.add_parser("ui", help="open the terminal UI (the default: `fleettop FILE`)")
    ui.add_argument("file", nargs="?", default=DEFAULT_FILE)
    ui.add_argument("--readonly", action="store_true", help="no mutating actions")
    ui.add_argument("--refresh", default="1s", help="UI refresh interval (default 1s)")
    ui.add_argument("--serve", nargs="?", const="", metavar="HOST:PORT",
                    help="also serve /ws, /metrics and the web view (default: serve: in FILE)")

    run = sub.add_parser("run", help="run a fleet (use --headless on servers)")
    run.add_argument("file", nargs="?", default=DEFAULT_FILE)
    run.add_argument("--headless", action="store_true",
                     help="no UI: one event per line on stdout")
    run.add_argument("--for", dest="duration", metavar="DURATION",
                     help="stop the fleet after this long (e.g. 30s, 15m)")
    run.add_argument("--events", choices=("json", "text"), default="json")
    run.add_argument("--readonly", action="store_true",
                     help="the control socket refuses mutating commands")
    run.add_argument("--no-telemetry", action="store_true",
                     help="no eBPF/procfs sampling (CPU%% and RSS still come on request)")
    run.add_argument("--serve", nargs="?", const="", metavar="HOST:PORT",
                     help="serve /ws, /metrics and the web view (default: serve: in FILE)")

    check = sub.add_parser("check", help="validate fleet files; exit 2 with FILE:LINE:COL errors")
    check.add_argument("files", nargs="*", default=[DEFAULT_FILE])

    ctl = sub.add_parser("ctl", help="control a running fleet over its socket")
    _add_file_opt(ctl)
    csub = ctl.add_subparsers(dest="ctl_command", metavar="ACTION", required=True)
    st = csub.add_parser("status", help="agents, states, pids, CPU, RSS")
    st.add_argument("--json", action="store_true")
    for verb in ("freeze", "resume"):
        p = csub.add_parser(verb, help=f"{verb} an agent's whole tree, or any pid")
        p.add_argument("name", nargs="?")
        p.add_argument("--pid", type=int)
        p.add_argument("--reason", default="")
        p.add_argument("--json", action="store_true")
        if verb == "resume":
            p.add_argument("--breaker", choices=("warn", "block", "freeze", "kill"),
                           help="until --for has passed, its trips take this policy "
                                "(warn: report, don't freeze again)")
            p.add_argument("--for", dest="relax_for", default="10m",
                           help="how long --breaker holds (default 10m)")
    for verb, text in (("restart", "restart an agent"), ("stop", "stop an agent"),
                       ("start", "start an agent")):
        p = csub.add_parser(verb, help=text)
        p.add_argument("name")
        p.add_argument("--json", action="store_true")
        if verb == "stop":
            p.add_argument("--signal", choices=("TERM", "INT", "KILL", "HUP", "QUIT"))
    rl = csub.add_parser("reload", help="re-read the fleet file: start new agents, stop removed "
                         "ones, restart changed ones (a bad file changes nothing)")
    rl.add_argument("--json", action="store_true")
    lg = csub.add_parser("logs", help="an agent's log tail")
    lg.add_argument("name")
    lg.add_argument("-n", type=int, default=50)
    lg.add_argument("--json", action="store_true")
    ev = csub.add_parser("events", help="recent events; --follow streams them")
    ev.add_argument("--follow", action="store_true")
    ev.add_argument("-n", type=int, default=50)
    ev.add_argument("--json", action="store_true")

    mock = sub.add_parser("mock-llm", help="the bundled mock LLM backend (OpenAI + Ollama wire)",
                          add_help=False)
    mock.add_argument("args", nargs=argparse.REMAINDER)
    demo = sub.add_parser("demo", help="run one of the bundled demo agents", add_help=False)
    demo.add_argument("args", nargs=argparse.REMAINDER)

    for module in PLUGIN_MODULES.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("mock-llm", "demo"):
        return _passthrough(argv[0], argv[1:])
    if argv and not argv[0].startswith("-") and argv[0] not in _subcommands():
        argv = ["ui", *argv]  # `fleettop fleet.yaml`
    if not argv:
        argv = ["ui"]
    args = build_parser().parse_args(argv)
    try:
        if args.command == "check":
            return cmd_check(args.files)
        if args.command == "run":
            return cmd_run(args)
        if args.command == "ui":
            return cmd_ui(args)
        if args.command == "ctl":
            return cmd_ctl(args)
        if getattr(args, "func", None) is not None:
            return int(args.func(args) or 0)
    except control.ControlError as exc:
        print(f"fleettop: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `ctl status --json | head`: the reader left. Quietly, as coreutils do; stdout is
        # pointed at /dev/null so the interpreter's own flush at exit cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    build_parser().print_help()
    return 2


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fleettop")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _subcommands() -> set[str]:
    return {"ui", "run", "check", "ctl", "mock-llm", "demo", "help", *PLUGIN_MODULES}


def _passthrough(name: str, rest: list[str]) -> int:
    if name == "mock-llm":
        from fleettop.supervisor.demo import mock_llm

        return int(mock_llm.main(rest) or 0)
    from fleettop.supervisor.demo import agents

    return int(agents.main(rest) or 0)


def _checked(file: str) -> tuple[Fleet | None, list[Problem], list[Problem]]:
    """The fleet, and what stops it (or may stop it) on this host: (fleet, errors, warnings)."""
    from fleettop.supervisor.config.host import host_problems

    try:
        fleet, marks = load_fleet_marked(file)
    except FleetError as exc:
        return None, exc.problems, []
    errors, warnings = host_problems(fleet, file, marks)
    return fleet, errors, warnings


def _load_or_report(file: str) -> Fleet | None:
    fleet, errors, warnings = _checked(file)
    for problem in warnings:
        print(f"{problem} (warning)", file=sys.stderr)
    if errors:
        for problem in errors:
            print(problem, file=sys.stderr)
        n = len(errors)
        print(f"{file}: {n} problem{'s' if n != 1 else ''}; nothing was started",
              file=sys.stderr)
        return None
    return fleet


def cmd_check(files: list[str]) -> int:
    status = 0
    for file in files:
        fleet, errors, warnings = _checked(file)
        for problem in errors:
            print(problem, file=sys.stderr)
        for problem in warnings:
            print(f"{problem} (warning)", file=sys.stderr)
        if errors or fleet is None:
            status = 2
            continue
        note = f", {len(warnings)} warning{'s' if len(warnings) != 1 else ''}" if warnings else ""
        print(f"{file}: ok ({len(fleet.agents)} agents{note})")
    return status


def _duration(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return units.parse_duration(text)
    except ValueError as exc:
        raise SystemExit(f"fleettop: --for: {exc}") from None


def cmd_run(args: argparse.Namespace) -> int:
    from fleettop.supervisor.cli.run import AlreadyRunning, print_events, run_fleet

    fleet = _load_or_report(args.file)
    if fleet is None:
        return 2
    duration = _duration(args.duration)
    if not args.headless:
        return cmd_ui(args)
    try:
        return asyncio.run(run_fleet(fleet, print_events(args.events), duration=duration,
                                     readonly=args.readonly, setup=_capabilities(args)))
    except AlreadyRunning as exc:
        print(f"fleettop: {exc}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:  # e.g. --serve on a port that is taken
        print(f"fleettop: {exc}", file=sys.stderr)
        return 1


def _capabilities(args: argparse.Namespace) -> Any:
    """Wire the capabilities that are present into a fresh supervisor."""
    from fleettop.supervisor.cli.assemble import setup_for

    return setup_for(args)


def cmd_ui(args: argparse.Namespace) -> int:
    from fleettop.supervisor.cli.run import AlreadyRunning, print_events, run_fleet, running_pid

    file = args.file
    fleet = _load_or_report(file)
    if fleet is None:
        return 2
    try:
        from fleettop.tui import app as tui_app  # noqa: F401
    except ImportError as exc:
        print(f"fleettop: the terminal UI is not available ({exc}); running headless, "
              "events as text. Use `fleettop run --headless` on servers.", file=sys.stderr)
        try:
            return asyncio.run(run_fleet(fleet, print_events("text"),
                                         setup=_capabilities(args)))
        except AlreadyRunning as exc2:
            print(f"fleettop: {exc2}", file=sys.stderr)
            return 1
    from fleettop.supervisor.cli import ui

    if running_pid(file):
        return ui.attach_viewer(fleet, args)
    try:
        return ui.run_with_ui(fleet, args)
    except AlreadyRunning as exc:
        print(f"fleettop: {exc}", file=sys.stderr)
        return 1


# ---- ctl ---------------------------------------------------------------------------------


def cmd_ctl(args: argparse.Namespace) -> int:
    sock = paths.socket_path(args.file)
    verb = args.ctl_command
    as_json = getattr(args, "json", False)
    if verb == "events" and args.follow:
        for event in control.follow(sock, backlog=args.n):
            _print_event(event, as_json)
        return 0
    req: dict[str, Any] = {"cmd": verb}
    if verb in ("freeze", "resume"):
        if args.pid is None and not args.name:
            print(f"fleettop ctl {verb}: give an agent NAME or --pid N", file=sys.stderr)
            return 2
        req.update(name=args.name, pid=args.pid, reason=args.reason or None)
        if verb == "resume" and args.breaker:
            req.update(breaker=args.breaker, **{"for": args.relax_for})
    elif verb in ("restart", "stop", "start", "logs"):
        req["name"] = args.name
        if verb == "logs":
            req["n"] = args.n
        if verb == "stop" and args.signal:
            req["signal"] = args.signal
    elif verb == "events":
        req["n"] = args.n
    reply = control.request(sock, req)
    if as_json:
        print(json.dumps(reply, indent=2, default=str))
        return 0 if reply.get("ok") else 1
    if not reply.get("ok"):
        print(f"fleettop ctl {verb}: {reply.get('error')}", file=sys.stderr)
        return 1
    if verb == "status":
        _print_status(reply)
    elif verb == "logs":
        print("\n".join(reply["lines"]))
    elif verb == "events":
        for event in reply["events"]:
            _print_event(event, False)
    elif verb == "reload":
        for key, label in (("added", "started"), ("removed", "stopped"), ("changed", "restarted"),
                           ("frozen_apply_later", "frozen; new entry applies at next start"),
                           ("needs_fleettop_restart", "changed; restart fleettop to apply")):
            if reply.get(key):
                print(f"{label}: {', '.join(reply[key])}")
        if not any(reply.get(k) for k in ("added", "removed", "changed",
                                          "needs_fleettop_restart")):
            print("no changes")
    else:
        extra = f" via {reply['via']}" if reply.get("via") else ""
        print(f"{args.name or args.pid}: {reply.get('state')}{extra}")
    return 0


def _print_event(event: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(event, default=str), flush=True)
        return
    stamp = time.strftime("%H:%M:%S", time.localtime(event["ts"]))
    who = f" {event['agent']}" if event.get("agent") else ""
    data = event.get("data", {})
    move = f" {data['from']} → {data['to']}" if "from" in data and "to" in data else ""
    reason = f": {event['reason']}" if event.get("reason") else ""
    print(f"{stamp} {event['kind']}{who}{move}{reason}", flush=True)


def _print_status(snap: dict[str, Any]) -> None:
    fleet = snap["fleet"]
    isolation = (f"cgroup {fleet['cgroup_root']}" if fleet["cgroup_root"]
                 else f"process groups ({fleet['isolation_reason']})")
    print(f"fleet {fleet['name']} ({fleet['file']}), supervisor pid {fleet['pid']}, "
          f"isolation: {isolation}")
    if snap.get("serve_token"):
        print(f"web view token: {snap['serve_token']}")
    for comp in snap.get("components", []):
        state = comp.get("state") or comp.get("source") or "?"
        detail = comp.get("detail") or comp.get("why") or ""
        print(f"component {comp.get('name')}: {state} {detail}".rstrip())
    header = f"{'NAME':<16} {'STATE':<10} {'PID':>7} {'CPU%':>6} {'RSS':>9} {'SRC':<6} REASON"
    print(header)
    for a in snap["agents"]:
        pid = str(a["pid"]) if a["pid"] else "-"
        print(f"{a['name']:<16} {a['state']:<10} {pid:>7} {a['cpu_percent']:>6.1f} "
              f"{units.format_bytes(a['rss_bytes']):>9} {a['source']:<6} {a['reason']}")
    for x in snap.get("external", []):
        print(f"{'pid ' + str(x['pid']):<16} {x['state']:<10} {x['pid']:>7} external "
              f"process {x.get('name')}")
    for a in snap["agents"]:
        relaxed = a.get("breaker_relaxed")
        if relaxed:
            until = time.strftime("%H:%M:%S", time.localtime(relaxed["until"]))
            print(f"note: {a['name']}: breaker {relaxed['policy']} until {until}")
        if a.get("log_error"):
            print(f"warning: {a['name']}: {a['log_error']} (the last lines are kept in memory)")
    if os.environ.get("FLEETTOP_DEBUG"):
        print(json.dumps(snap, indent=1, default=str))


if __name__ == "__main__":
    raise SystemExit(main())
