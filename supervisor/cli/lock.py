"""`fleettop lock run|status`: the GPU lock for any program, and a look at its queue.

    fleettop lock run [--timeout 10m] [--name digest] [--model qwen2.5:7b] [-f fleet.yaml] -- CMD...
    fleettop lock status [--json] [-f fleet.yaml]

Without `-f`/`--dir` the queue is the fleet's that this runs in, else the one of ./fleet.yaml
(as `ctl` does), else a queue per user; both verbs say which they used.
`lock run` exits with CMD's status; if the lock isn't granted in time it exits 75 (EX_TEMPFAIL)
and says the run was skipped — a cron job simply tries again at its next tick. CMD gets
PR_SET_PDEATHSIG, so killing `lock run` (which frees the lock) also stops CMD: nothing keeps
using the GPU after its lock is gone.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from fleettop.supervisor.gpu.lock import ENV_LOCK_DIR, GpuLock, LockTimeout, default_folder, status
from fleettop.supervisor.gpu.lock import fleet_lock_folder as lock_folder_of

EXIT_SKIPPED = 75
"""EX_TEMPFAIL: not granted in time; skipped this run."""

_PR_SET_PDEATHSIG = 1
DEFAULT_FLEET = "fleet.yaml"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("lock", help="run a command under the GPU lock, or show its queue")
    sub = p.add_subparsers(dest="lock_cmd", required=True)
    r = sub.add_parser("run", help="wait for the GPU lock (FIFO), run CMD, release")
    r.add_argument("--timeout", default=None,
                   help="give up after this long (90s, 10m); default: wait forever")
    r.add_argument("--name", default=None, help="name shown in the queue (default: CMD)")
    r.add_argument("--model", default=None, help="model this run wants (shown in the queue)")
    _folder_args(r)
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    s = sub.add_parser("status", help="holder, queue in order, waits")
    s.add_argument("--json", action="store_true", help="one JSON object")
    _folder_args(s)
    p.set_defaults(func=run)
    return p


def _folder_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-f", "--file", default=None, help="fleet file whose lock queue to use")
    p.add_argument("--dir", default=None, help="lock folder (overrides -f)")


def resolve_folder(args: argparse.Namespace) -> tuple[Path, str]:
    """The lock queue to use, and what chose it: `--dir`, else `-f FILE`'s fleet, else the
    fleet this runs inside ($FLEETTOP_GPU_LOCK_DIR), else ./fleet.yaml's fleet (as `ctl`
    does), else one queue per user."""
    if getattr(args, "dir", None):
        return Path(args.dir), "--dir"
    file = getattr(args, "file", None)
    if file:
        return fleet_lock_folder(file), f"the fleet of {file}"
    if os.environ.get(ENV_LOCK_DIR):
        return Path(os.environ[ENV_LOCK_DIR]), f"${ENV_LOCK_DIR}"
    if os.path.exists(DEFAULT_FLEET):
        return fleet_lock_folder(DEFAULT_FLEET), f"the fleet of ./{DEFAULT_FLEET}"
    return default_folder(), "no fleet here: the per-user queue"


def fleet_lock_folder(fleet_file: str) -> Path:
    """The fleet's queue: its `gpu.lock_dir`, else `<state dir>/gpu` (what its agents use)."""
    from fleettop.supervisor.base import paths
    from fleettop.supervisor.config.load import load_fleet

    fleet = load_fleet(fleet_file)
    return lock_folder_of(paths.state_dir(fleet_file, override=fleet.state_dir), fleet.gpu)


def run(args: argparse.Namespace) -> int:
    if args.lock_cmd == "status":
        return _status(args)
    return _run(args)


def _parse_timeout(value: str | None) -> float | None:
    if value is None:
        return None
    from fleettop.supervisor.config.units import parse_duration

    return parse_duration(value)


def _set_pdeathsig() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _run(args: argparse.Namespace) -> int:
    cmd = list(args.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("fleettop lock run: give a command after --", file=sys.stderr)
        return 2
    try:
        timeout = _parse_timeout(args.timeout)
    except ValueError as exc:
        print(f"fleettop lock run: --timeout: {exc}", file=sys.stderr)
        return 2
    name = args.name or Path(cmd[0]).name
    folder, why = _folder_or_report(args)
    if folder is None:
        return 2
    print(f"fleettop lock: queue {folder} ({why})", file=sys.stderr)
    lock = GpuLock(folder, name=name, model=args.model, timeout=timeout)
    try:
        lock.acquire()
    except LockTimeout as exc:
        print(f"fleettop lock: {exc}: skipped this run, will retry at the next schedule",
              file=sys.stderr)
        return EXIT_SKIPPED
    except KeyboardInterrupt:
        return 130
    try:
        return _run_child(cmd)
    finally:
        lock.release()


def _run_child(cmd: list[str]) -> int:
    try:
        child = subprocess.Popen(cmd, preexec_fn=_set_pdeathsig)  # noqa: PLW1509
    except OSError as exc:
        print(f"fleettop lock run: {cmd[0]}: {exc.strerror}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126

    def forward(signum: int, _frame: object) -> None:
        child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT,
                                                       signal.SIGHUP)}
    try:
        rc = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - rc if rc < 0 else rc


def _folder_or_report(args: argparse.Namespace) -> tuple[Path | None, str]:
    from fleettop.supervisor.config.load import FleetError

    try:
        return resolve_folder(args)
    except FleetError as exc:
        print(f"fleettop lock: cannot use the fleet's queue:\n{exc}", file=sys.stderr)
        return None, ""


def _status(args: argparse.Namespace) -> int:
    folder, why = _folder_or_report(args)
    if folder is None:
        return 2
    st = status(folder)
    if args.json:
        print(json.dumps({**st, "chosen_by": why}))
        return 0
    print(render_status(st) + f"\n  (queue chosen by {why})")
    return 0


def _who(info: dict[str, Any]) -> str:
    model = f" [{info['model']}]" if info.get("model") else ""
    return f"{info.get('name') or '?'} (pid {info['pid']}){model}"


def render_status(st: dict[str, Any]) -> str:
    lines = [f"GPU lock {st['folder']}"]
    holder = st.get("holder")
    if holder:
        lines.append(f"  held by {_who(holder)} for {holder['held_s']:.1f}s"
                     f" (waited {float(holder.get('waited_s') or 0):.1f}s)")
    else:
        lines.append("  free")
    for q in st.get("queue", []):
        lines.append(f"  {q['position']:>3}. {_who(q)} waiting {q['waited_s']:.1f}s")
    for s in st.get("stale", []):
        lines.append(f"  stale: {_who(s)}: {s['why']}")
    for name in st.get("ignored", []):
        lines.append(f"  ignored file: {name}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (also used by tests): `python -m fleettop.supervisor.cli.lock ...`."""
    parser = argparse.ArgumentParser(prog="fleettop")
    add_parser(parser.add_subparsers(dest="command_name", required=True))
    args = parser.parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
