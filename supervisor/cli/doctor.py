"""`fleettop doctor [-f FILE] [--json]`: what this machine lets fleettop do, and how to fix it.

Each check is ok / warn / fail with a one-line remediation. Exit 1 when any check
fails. ``FLEETTOP_DOCTOR_FAIL=name,name`` forces checks to fail (for tests and for
seeing the remediation text).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fleettop.probes.sensors import ebpf

INSTALL_HINT = "sudo .ci/install-bpf.sh (python3-bpfcc, linux-headers-amd64, /lib/modules links)"


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str
    fix: str = ""


Checker = Callable[[argparse.Namespace], Check]


def check_root(_: argparse.Namespace) -> Check:
    if os.geteuid() == 0:
        return Check("root", "ok", "running as root")
    if ebpf._has_bpf_caps():
        return Check("root", "ok", "not root, but CAP_BPF and CAP_PERFMON are effective")
    return Check("root", "warn", "not root: eBPF probes and cgroup freezing are unavailable; "
                 "procfs and SIGSTOP are used instead",
                 "run as root, or grant CAP_BPF,CAP_PERFMON (setcap) to the interpreter")


def check_tracefs(_: argparse.Namespace) -> Check:
    root = ebpf.tracefs()
    if root is None:
        return Check("tracefs", "fail", "tracefs is not mounted",
                     "mount -t tracefs nodev /sys/kernel/tracing")
    missing = [f"{c}:{n}" for c, n in ebpf.REQUIRED_TRACEPOINTS if not ebpf.tracepoint_exists(c, n)]
    if missing:
        return Check("tracefs", "fail", f"{root}: missing {', '.join(missing)}",
                     "a kernel with CONFIG_FTRACE and scheduler tracepoints")
    optional = [f"{c}:{n}" for c, n in ebpf.OPTIONAL_TRACEPOINTS.values()
                if not ebpf.tracepoint_exists(c, n)]
    if optional:
        return Check("tracefs", "warn", f"{root}; absent (fields left empty): "
                     f"{', '.join(optional)}")
    return Check("tracefs", "ok", f"{root}, all tracepoints fleettop uses are present")


def check_btf(_: argparse.Namespace) -> Check:
    if not Path("/sys/kernel/btf/vmlinux").exists():
        return Check("btf", "warn", "no /sys/kernel/btf/vmlinux: exit codes of an agent's "
                     "children are not reported", "a kernel built with CONFIG_DEBUG_INFO_BTF=y")
    off = ebpf.btf_member_offset("task_struct", "exit_code")
    if off < 0:
        return Check("btf", "warn", "BTF present but task_struct.exit_code not found")
    return Check("btf", "ok", f"/sys/kernel/btf/vmlinux (task_struct.exit_code at +{off})")


def check_kprobes(_: argparse.Namespace) -> Check:
    root = ebpf.tracefs()
    has = bool(root and (root / "kprobe_events").exists()) or Path(
        "/sys/bus/event_source/devices/kprobe").exists()
    if has:
        return Check("kprobes", "ok", "available (fleettop does not need them)")
    return Check("kprobes", "ok", "not available; fine: fleettop uses tracepoints only")


def check_bcc(_: argparse.Namespace) -> Check:
    if ebpf.bcc_available():
        return Check("bcc", "ok", "importable (system dist-packages are used if needed)")
    return Check("bcc", "warn", "bcc not importable: the procfs fallback is used",
                 f"apt-get install python3-bpfcc, or {INSTALL_HINT}")


def check_headers(_: argparse.Namespace) -> Check:
    rel = os.uname().release
    build = Path(f"/lib/modules/{rel}/build")
    source = Path(f"/lib/modules/{rel}/source")
    if not (build / "include").exists():
        return Check("headers", "warn", f"no kernel headers at {build}: bcc can't compile",
                     f"apt-get install linux-headers-{rel} (or linux-headers-amd64 linked "
                     f"there for a custom kernel): {INSTALL_HINT}")
    kconfig = [p for p in (build, source) if (p / "include/linux/kconfig.h").exists()]
    if not kconfig:
        return Check("headers", "warn", f"{build} lacks include/linux/kconfig.h",
                     f"link {source} to the -common headers directory: {INSTALL_HINT}")
    return Check("headers", "ok", f"{build} -> {build.resolve()}")


def check_lockdown(_: argparse.Namespace) -> Check:
    mode = ebpf.lockdown_mode()
    if mode is None:
        return Check("lockdown", "ok", "no lockdown LSM")
    if mode == "confidentiality":
        return Check("lockdown", "fail", "lockdown=confidentiality blocks eBPF reads",
                     "boot with lockdown=integrity or none (or accept the procfs fallback)")
    return Check("lockdown", "ok", f"lockdown={mode}")


def check_bpf_load(args: argparse.Namespace) -> Check:
    if getattr(args, "no_trial", False):
        return Check("bpf_load", "warn", "trial load skipped (--no-trial)")
    try:
        ebpf.check_environment(need_bcc=False)
    except ebpf.ProbeUnavailable as exc:
        return Check("bpf_load", "warn", f"not attempted: {exc}; procfs fallback in use",
                     INSTALL_HINT)
    if not ebpf.bcc_available():
        return Check("bpf_load", "warn", "not attempted: bcc missing", INSTALL_HINT)
    try:
        proc = subprocess.run([sys.executable, "-m", "fleettop.probes.sensors.ebpf"],
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=90)
        first = proc.stdout.splitlines()[0] if proc.stdout else b"{}"
        msg = json.loads(first)
    except (subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        return Check("bpf_load", "fail", f"trial load did not answer: {exc}", INSTALL_HINT)
    if msg.get("type") == "ready":
        return Check("bpf_load", "ok", f"loaded and attached in {msg['load_s']}s, loader RSS "
                     f"{msg['rss_bytes'] >> 20} MiB (a separate process)")
    why = msg.get("why") or proc.stderr.decode(errors="replace").strip()[-300:]
    return Check("bpf_load", "fail", f"BPF load failed: {why}", INSTALL_HINT)


def check_cgroup(_: argparse.Namespace) -> Check:
    from fleettop.supervisor.core import cgroups

    mount = cgroups.find_v2_mount()
    if mount is None:
        return Check("cgroup", "warn", "no cgroup v2 mount: agents are frozen with SIGSTOP",
                     "mount -t cgroup2 none /sys/fs/cgroup (or boot with systemd unified)")
    if not os.access(mount, os.W_OK):
        return Check("cgroup", "warn", f"cgroup v2 at {mount} is not writable",
                     "run as root, or delegate a subtree (systemd-run --user -p Delegate=yes)")
    controllers = (mount / "cgroup.controllers").read_text().split() if (
        mount / "cgroup.controllers").exists() else []
    probe = mount / f"fleettop-doctor-{os.getpid()}"
    try:
        probe.mkdir()
        freezer = (probe / "cgroup.freeze").exists()
        kill = (probe / "cgroup.kill").exists()
    except OSError as exc:
        return Check("cgroup", "warn", f"cannot create a cgroup under {mount}: {exc}",
                     "run as root or delegate a subtree")
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()
    missing = [c for c in ("memory", "cpu", "pids") if c not in controllers]
    detail = (f"{mount}, freezer {'yes' if freezer else 'no'}, cgroup.kill "
              f"{'yes' if kill else 'no'}, controllers: {' '.join(controllers) or 'none'}")
    if not freezer:
        return Check("cgroup", "warn", detail + ": no cgroup.freeze (kernel < 5.2)",
                     "a 5.2+ kernel; SIGSTOP is used meanwhile")
    if missing:
        return Check("cgroup", "warn", detail + f"; v2 lacks {', '.join(missing)} "
                     "(hybrid mount?): memory limits use v1 or are skipped",
                     "boot with systemd.unified_cgroup_hierarchy=1")
    return Check("cgroup", "ok", detail)


def check_psi(_: argparse.Namespace) -> Check:
    missing = [r for r in ("cpu", "memory", "io") if not Path(f"/proc/pressure/{r}").exists()]
    if missing:
        return Check("psi", "warn", f"/proc/pressure/{{{','.join(missing)}}} missing: the "
                     "governor reads vmstat only", "boot with psi=1 (CONFIG_PSI)")
    return Check("psi", "ok", "/proc/pressure/{cpu,memory,io}")


def check_nvml(_: argparse.Namespace) -> Check:
    from fleettop.probes.sensors.nvml import NvmlGpu

    gpu = NvmlGpu()
    try:
        if not gpu.available:
            return Check("nvml", "warn", gpu.why + " (GPU features off; everything else works)",
                         "install the NVIDIA driver if this machine has a GPU")
        snap = gpu.sample()
        names = ", ".join(f"{g.name} {g.mem_total >> 20} MiB" for g in snap.gpus)
        return Check("nvml", "ok", f"driver {gpu.driver}: {names}")
    finally:
        gpu.close()


def _fleet(args: argparse.Namespace) -> Any:
    path = getattr(args, "file", None)
    if not path:
        return None
    from fleettop.supervisor.config.load import load_fleet

    return load_fleet(path)


def check_fleet(args: argparse.Namespace) -> Check:
    path = getattr(args, "file", None)
    if not path:
        return Check("fleet", "ok", "no fleet file given (-f FILE to check one)")
    try:
        fleet = _fleet(args)
    except Exception as exc:  # FleetError carries line:col and the field
        return Check("fleet", "fail", f"{path}: {exc}", "fix the fleet file at that position")
    return Check("fleet", "ok", f"{path}: {len(fleet.agents)} agents")


def check_ports(args: argparse.Namespace) -> Check:
    ports: list[int] = []
    with contextlib.suppress(Exception):
        fleet = _fleet(args)
        proxy = getattr(fleet, "proxy", None) if fleet is not None else None
        port = getattr(proxy, "port", None)
        if port is None and isinstance(proxy, dict):
            port = proxy.get("port")
        if port:
            ports.append(int(port))
    busy = []
    for port in ports or [0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                busy.append(port)
    if busy:
        return Check("ports", "fail", f"127.0.0.1:{busy[0]} is in use",
                     f"free it (ss -ltnp 'sport = :{busy[0]}') or set proxy.port: 0")
    what = f"127.0.0.1:{ports[0]} is free" if ports else "loopback binding works (proxy port 0)"
    return Check("ports", "ok", what)


def check_proxy_ca(args: argparse.Namespace) -> Check:
    """The proxy's CA: in the fleet's state dir, its private key readable by the owner only."""
    path = getattr(args, "file", None)
    if not path:
        return Check("proxy_ca", "ok", "no fleet file given: the CA is per fleet state dir")
    try:
        from fleettop.supervisor.base import paths

        fleet = _fleet(args)
        confdir = paths.state_dir(path, getattr(fleet, "state_dir", None)) / "proxy/mitmproxy"
    except Exception as exc:  # the fleet check reports a bad file
        return Check("proxy_ca", "warn", f"cannot locate the state dir: {exc}")
    key = confdir / "mitmproxy-ca.pem"
    if not key.exists():
        return Check("proxy_ca", "ok", f"{confdir}: made at the first start (key 0600)")
    loose = [p.name for p in confdir.glob("mitmproxy-ca*")
             if p.name in ("mitmproxy-ca.pem", "mitmproxy-ca.p12") and p.stat().st_mode & 0o077]
    if loose:
        return Check("proxy_ca", "fail", f"{confdir}: {', '.join(loose)} readable by others",
                     f"chmod 600 {confdir}/mitmproxy-ca.pem {confdir}/mitmproxy-ca.p12")
    return Check("proxy_ca", "ok", f"{key} (0600); agents trust {confdir}/mitmproxy-ca-cert.pem")


def check_terminal(_: argparse.Namespace) -> Check:
    term = os.environ.get("TERM", "")
    if not term or term == "dumb":
        return Check("terminal", "warn", f"TERM={term or '(unset)'}: the UI needs a real terminal",
                     "export TERM=xterm-256color (or run --headless)")
    if os.environ.get("TMUX") and shutil.which("tmux"):
        with contextlib.suppress(Exception):
            out = subprocess.run(["tmux", "show", "-sv", "escape-time"], capture_output=True,
                                 text=True, timeout=5).stdout.strip()
            if out.isdigit() and int(out) > 50:
                return Check("terminal", "warn", f"tmux escape-time is {out} ms: Esc feels slow",
                             "tmux set -sg escape-time 10 (and in ~/.tmux.conf)")
    return Check("terminal", "ok", f"TERM={term}")


def check_proxy_relay(_: argparse.Namespace) -> Check:
    """How the proxy will relay: one piece per read needs the pinned mitmproxy, and uvloop."""
    from importlib import metadata

    from fleettop.probes.proxy.relay import PINNED

    try:
        mitm = metadata.version("mitmproxy")
    except metadata.PackageNotFoundError:
        return Check("proxy_relay", "fail", "mitmproxy is not installed: no token proxy",
                     f"pip install mitmproxy=={PINNED} (./run.sh installs it)")
    try:
        uv = metadata.version("uvloop")
    except metadata.PackageNotFoundError:
        uv = ""
    if mitm != PINNED:
        return Check("proxy_relay", "warn",
                     f"mitmproxy {mitm} is not {PINNED}: the proxy relays chunk by chunk and "
                     "its abort path is untested there", f"pip install mitmproxy=={PINNED}")
    if not uv:
        return Check("proxy_relay", "warn", "uvloop is not installed: the proxy runs on "
                     "asyncio's event loop (slower per chunk)", "pip install uvloop")
    return Check("proxy_relay", "ok", f"mitmproxy {mitm}, one piece per read, uvloop {uv}")


CHECKS: list[Checker] = [
    check_root, check_tracefs, check_btf, check_kprobes, check_bcc, check_headers,
    check_lockdown, check_bpf_load, check_cgroup, check_psi, check_nvml, check_fleet,
    check_ports, check_proxy_ca, check_proxy_relay, check_terminal,
]


def run_checks(args: argparse.Namespace) -> list[Check]:
    forced = {x for x in os.environ.get("FLEETTOP_DOCTOR_FAIL", "").split(",") if x}
    out = []
    for fn in CHECKS:
        try:
            c = fn(args)
        except Exception as exc:  # a broken check is a finding, not a crash
            c = Check(fn.__name__.removeprefix("check_"), "fail", f"check crashed: {exc!r}")
        if c.name in forced:
            c = Check(c.name, "fail", f"forced to fail (FLEETTOP_DOCTOR_FAIL): {c.detail}",
                      c.fix or "unset FLEETTOP_DOCTOR_FAIL")
        out.append(c)
    return out


def add_parser(parent: Any) -> argparse.ArgumentParser:
    """Add `doctor` to a subparsers object, or fill in a `doctor` parser made by the CLI."""
    if hasattr(parent, "add_parser"):
        p = parent.add_parser("doctor", help="check what this machine lets fleettop do",
                              description=__doc__.splitlines()[0])
    else:
        p = parent
    p.add_argument("file", nargs="?", help="fleet file to validate")
    p.add_argument("-f", "--file", dest="file_opt", help="fleet file to validate")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--no-trial", action="store_true", help="skip the trial BPF load")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    if getattr(args, "file_opt", None):
        args.file = args.file_opt
    if not getattr(args, "file", None) and os.path.exists("fleet.yaml"):
        args.file = "fleet.yaml"  # like `ctl`, the fleet of the current folder by default
    checks = run_checks(args)
    failed = any(c.status == "fail" for c in checks)
    if getattr(args, "json", False):
        print(json.dumps({"ok": not failed, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        marks = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}
        for c in checks:
            print(f"[{marks[c.status]}] {c.name:<9} {c.detail}")
            if c.fix and c.status != "ok":
                print(f"{'':17}fix: {c.fix}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fleettop")
    add_parser(ap.add_subparsers(dest="cmd", required=True))
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
