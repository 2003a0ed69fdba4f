"""The proxy process: mitmproxy's DumpMaster with fleettop's addon, on loopback only.

    python -m fleettop.probes.proxy.main --state-dir DIR --config CFG.json --tokens TOK.json \
        [--host 127.0.0.1] [--port 0]

Protocol with the supervisor (`fleettop.probes.proxy.process.ProxyProcess`):
- stdout: one JSON object per line. `{"event": "proxy.ready", "port", "reverse": {agent: port},
  "ca_cert", "confdir", "event_loop", "merge_reads"}` once listening; then `proxy.stats` (per
  agent, every `proxy.stats_interval`), `breaker.trip` (agent, kind
  token_loop|retry_loop|budget|rate, policy, reason, evidence, at_char|at_request, text_tail,
  incident), `proxy.released`, `proxy.dump`, `proxy.reply`; from the GPU addon `proxy.gpu`
  (gate and router state, when it changes), `gpu.waited`, `gpu.timeout`, `route.changed`,
  `route.failed`, `governor.shrunk` (each with agent and reason). Nothing else is written to
  stdout (mitmproxy logs go to stderr).
- stdin: one JSON command per line: `{"cmd": "release", "agent": A}`, `{"cmd": "dump",
  "agent": A}`, `{"cmd": "stats"}`, `{"cmd": "reload"}` (re-read --config, for both addons).
  EOF on stdin (the supervisor went away) stops the proxy.
The CA lives in `<state-dir>/mitmproxy` (mitmproxy's confdir); its key files are made 0600.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

from fleettop.probes.proxy.breaker import FleettopProxy, stdin_commands
from fleettop.probes.proxy.config import ProxyConfig
from fleettop.probes.proxy.gpu import FleettopGpu
from fleettop.probes.proxy.relay import merge_reads, merge_reads_on, new_event_loop
from fleettop.supervisor.base.jsonlines import LineWriter


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class _Commands:
    """Supervisor commands: `reload` re-reads the config file (once, for both addons);
    everything else is the breaker addon's."""

    def __init__(self, path: Path | None, addon: FleettopProxy, gpu: FleettopGpu,
                 reverse_ports: dict[int, str], out: LineWriter) -> None:
        self.path, self.addon, self.gpu = path, addon, gpu
        self.reverse_ports, self.out = reverse_ports, out

    def command(self, cmd: dict[str, Any]) -> None:
        if cmd.get("cmd") != "reload":
            self.addon.command(cmd)
            return
        try:
            cfg = _read_config(self.path, self.reverse_ports)
            self.addon.apply_config(cfg)
            self.gpu.apply_config(cfg.gpu)
            self.out({"event": "proxy.reply", "cmd": "reload", "ok": True})
        except (OSError, ValueError) as exc:
            self.out({"event": "proxy.reply", "cmd": "reload", "ok": False, "error": str(exc)})


def _read_config(path: Path | None, reverse_ports: dict[int, str]) -> ProxyConfig:
    cfg = ProxyConfig.read(path) if path is not None else ProxyConfig()
    # The listeners are bound once, at start: their ports stay what this process chose.
    return cfg.model_copy(update={"reverse_ports": dict(reverse_ports)})


def _protect_ca(confdir: Path) -> None:
    for path in confdir.glob("mitmproxy-ca*"):
        if not path.name.endswith("-cert.pem") and not path.name.endswith("-cert.cer"):
            os.chmod(path, 0o600)


async def _run(args: argparse.Namespace, out: LineWriter, cfg: ProxyConfig) -> int:
    from mitmproxy.options import Options
    from mitmproxy.tools.dump import DumpMaster

    state = Path(args.state_dir)
    confdir = state / "mitmproxy"
    host = args.host
    port = args.port or _free_port(host)
    modes = [f"regular@{port}"]
    reverse_ports: dict[int, str] = {}
    reverse_out: dict[str, int] = {}
    for agent, spec in cfg.reverse.items():
        rport = spec.port or _free_port(host)
        modes.append(f"reverse:{spec.upstream}@{rport}")
        reverse_ports[rport] = agent
        reverse_out[agent] = rport
    cfg = cfg.model_copy(update={"reverse_ports": reverse_ports})

    opts = Options(listen_host=host, mode=modes, confdir=str(confdir))
    master = DumpMaster(opts, with_termlog=False, with_dumper=False)
    addon = FleettopProxy(report=out)
    # Order matters: FleettopProxy authenticates and parses first; the GPU addon then routes,
    # waits for the GPU and caps (probes/proxy/gpu.py).
    gpu = FleettopGpu(report=out)
    addon.apply_config(cfg)
    gpu.apply_config(cfg.gpu)
    master.addons.add(addon, gpu)
    updates: dict[str, Any] = {
        "fleettop_state": str(state),
        "connection_strategy": "lazy", "stream_large_bodies": "1m",
    }
    if args.tokens:
        updates["fleettop_tokens"] = args.tokens
    if cfg.proxy.upstream_ca:
        updates["ssl_verify_upstream_trusted_ca"] = cfg.proxy.upstream_ca
    if cfg.proxy.ssl_insecure:
        updates["ssl_insecure"] = True
    master.options.update(**updates)
    _protect_ca(confdir)

    loop = asyncio.get_running_loop()
    run = loop.create_task(master.run())

    if not args.no_stdin:
        config_path = Path(args.config) if args.config else None
        stdin_commands(_Commands(config_path, addon, gpu, reverse_ports, out), loop, sys.stdin,
                       on_eof=master.shutdown)

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
                        help="a ProxyConfig as JSON (probes/proxy/config.py)")
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
    try:
        cfg = _read_config(Path(args.config) if args.config else None, {})
    except (OSError, ValueError) as exc:
        print(f"fleettop-proxy: bad --config {args.config}: {exc}", file=sys.stderr)
        return 2
    merge_reads(cfg.proxy.merge_reads)
    kind = cfg.proxy.event_loop
    try:
        with asyncio.Runner(loop_factory=lambda: new_event_loop(kind)) as runner:
            return runner.run(_run(args, out, cfg))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
