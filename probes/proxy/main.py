"""The proxy process: mitmproxy's DumpMaster with fleettop's addon, on loopback only.

    python -m fleettop.probes.proxy.main --state-dir DIR --config CFG.json --tokens TOK.json \
        [--host 127.0.0.1] [--port 0]

Protocol with the supervisor (`fleettop.supervisor.capabilities.proxy.ProxyLink`):
- stdout: one JSON object per line. `{"event": "proxy.ready", "port", "reverse": {agent: port},
  "ca_cert", "confdir", "event_loop", "merge_reads"}` once listening; then `proxy.stats` (per
  agent, every `proxy.stats_interval`), `breaker.trip` (agent, kind
  token_loop|retry_loop|budget|rate, policy, reason, evidence, at_char|at_request, text_tail,
  incident), `proxy.released`, `proxy.dump`, `proxy.reply`; from the GPU addon `proxy.gpu`
  (gate and router state, when it changes), `gpu.waited`, `gpu.timeout`, `route.changed`,
  `route.failed`, `governor.shrunk` (each with agent and reason). Nothing else is written to
  stdout (mitmproxy logs go to stderr).
- stdin: one JSON command per line: `{"cmd": "release", "agent": A}`, `{"cmd": "dump",
  "agent": A}`, `{"cmd": "stats"}`, `{"cmd": "reload"}` (re-read --config). EOF on stdin
  (the supervisor went away) stops the proxy.
The CA lives in `<state-dir>/mitmproxy` (mitmproxy's confdir); its key files are made 0600.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

from fleettop.probes.proxy.breaker import FleettopProxy, stdin_commands
from fleettop.probes.proxy.gpu import FleettopGpu
from fleettop.probes.proxy.relay import merge_reads, merge_reads_on, new_event_loop
from fleettop.supervisor.base.jsonlines import LineWriter


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class _Both:
    """Supervisor commands go to the breaker's addon; `reload` reaches the GPU addon too."""

    def __init__(self, addon: FleettopProxy, gpu: FleettopGpu) -> None:
        self.addon, self.gpu = addon, gpu

    def command(self, cmd: dict[str, Any]) -> None:
        if cmd.get("cmd") == "reload":
            self.gpu.configure({"fleettop_config"})
        self.addon.command(cmd)


def _protect_ca(confdir: Path) -> None:
    for path in confdir.glob("mitmproxy-ca*"):
        if not path.name.endswith("-cert.pem") and not path.name.endswith("-cert.cer"):
            os.chmod(path, 0o600)


async def _run(args: argparse.Namespace, out: LineWriter, cfg: dict[str, Any]) -> int:
    from mitmproxy.options import Options
    from mitmproxy.tools.dump import DumpMaster

    state = Path(args.state_dir)
    confdir = state / "mitmproxy"
    host = args.host
    port = args.port or _free_port(host)
    reverse: dict[str, dict[str, Any]] = cfg.get("reverse") or {}
    modes = [f"regular@{port}"]
    reverse_ports: dict[str, str] = {}
    reverse_out: dict[str, int] = {}
    for agent, spec in reverse.items():
        rport = int(spec.get("port") or 0) or _free_port(host)
        modes.append(f"reverse:{spec['upstream']}@{rport}")
        reverse_ports[str(rport)] = agent
        reverse_out[agent] = rport
    cfg["reverse_ports"] = reverse_ports
    cfg_path = Path(args.config) if args.config else state / "proxy-config.json"
    fd = os.open(cfg_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(cfg, fh)

    opts = Options(listen_host=host, mode=modes, confdir=str(confdir))
    master = DumpMaster(opts, with_termlog=False, with_dumper=False)
    addon = FleettopProxy(report=out)
    # Order matters: FleettopProxy authenticates and parses first; the GPU addon then routes,
    # waits for the GPU and caps (probes/proxy/gpu.py).
    gpu = FleettopGpu(report=out)
    master.addons.add(addon, gpu)
    proxy_cfg = cfg.get("proxy") or {}
    updates: dict[str, Any] = {
        "fleettop_config": str(cfg_path), "fleettop_state": str(state),
        "connection_strategy": "lazy", "stream_large_bodies": "1m",
    }
    if args.tokens:
        updates["fleettop_tokens"] = args.tokens
    if proxy_cfg.get("upstream_ca"):
        updates["ssl_verify_upstream_trusted_ca"] = proxy_cfg["upstream_ca"]
    if proxy_cfg.get("ssl_insecure"):
        updates["ssl_insecure"] = True
    master.options.update(**updates)
    _protect_ca(confdir)

    loop = asyncio.get_running_loop()
    run = loop.create_task(master.run())

    if not args.no_stdin:
        stdin_commands(_Both(addon, gpu), loop, sys.stdin, on_eof=master.shutdown)

    for _ in range(200):  # wait until the listeners are bound
        await asyncio.sleep(0.02)
        server = master.addons.get("proxyserver")
        if run.done() or (server is not None and server.is_running and server.listen_addrs()):
            break
    if run.done():
        run.result()
        return 1
    _protect_ca(confdir)
    out({"event": "proxy.ready", "host": host, "port": port, "reverse": reverse_out,
         "pid": os.getpid(), "confdir": str(confdir), "merge_reads": merge_reads_on(),
         "event_loop": type(loop).__module__.split(".")[0],  # uvloop | asyncio
         "ca_cert": str(confdir / "mitmproxy-ca-cert.pem")})
    await run
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fleettop-proxy", description=__doc__.split("\n")[0])
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--config", default="",
                        help="JSON {proxy, breaker, agents, reverse, gpu}")
    parser.add_argument("--tokens", default="", help="JSON {agent: token}, re-read on change")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--no-stdin", action="store_true", help="don't read commands on stdin")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    # Reports own stdout; everything mitmproxy or Python logs goes to stderr.
    out = LineWriter(sys.stdout)
    sys.stdout = sys.stderr
    logging.basicConfig(stream=sys.stderr, level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    confdir = Path(args.state_dir) / "mitmproxy"
    confdir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(confdir, 0o700)
    cfg = json.loads(Path(args.config).read_text()) if args.config else {}
    relay = cfg.get("proxy") or {}
    merge_reads(bool(relay.get("merge_reads", True)))
    kind = str(relay.get("event_loop") or "uvloop")
    try:
        with asyncio.Runner(loop_factory=lambda: new_event_loop(kind)) as runner:
            return runner.run(_run(args, out, cfg))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
