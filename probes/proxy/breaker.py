"""fleettop's mitmproxy addon: per-agent auth, token accounting, inline loop breaker.

Pinned to mitmproxy 11.0.2. Caveats, each tested in tests/integration/test_proxy.py:
- Responses are relayed chunk by chunk through a `flow.response.stream` callable (one call per
  upstream read, not aligned to SSE events). It returns the chunk untouched, `[]` to drop one,
  never `b""` (that is the end-of-body marker: the client would see a clean, truncated body),
  or a generator: mitmproxy writes each piece it yields to the client before resuming it (its
  layers pass commands up one at a time), so work after the first `yield` runs once the chunk
  is on its way, still inside the callback. To a plain-TCP HTTP/1.1 client the callback writes
  the chunk to the client's socket itself (`stream_cut.direct_writer`, framed as mitmproxy
  would) and returns `[]`: half of mitmproxy's per-chunk path comes after the callback.
- `flow.kill()` does not stop a stream in flight (mitmproxy #4711). To abort we close the
  client connection through the `proxyserver` addon's connection handler — internal API, in
  stream_cut.py — and mitmproxy then drops the upstream connection too.
- Agents authenticate as `http://AGENT:TOKEN@host:port` (Proxy-Authorization). We check the
  token against the token file ourselves instead of mitmproxy's `proxyauth`, because tokens
  change at every agent start and reverse listeners (one per agent) must not ask for auth.
  The header is removed before the request goes upstream (auth.py). Incidents: incidents.py.
Reports are JSON lines handed to `report` (proxy_main writes them to stdout).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from mitmproxy import ctx, exceptions, http
from mitmproxy.proxy import mode_specs

from fleettop.probes.proxy import wire
from fleettop.probes.proxy.auth import Tokens, auth_required
from fleettop.probes.proxy.config import ProxyConfig
from fleettop.probes.proxy.incidents import Incidents
from fleettop.probes.proxy.state import AgentState, FlowState
from fleettop.probes.proxy.stream_cut import close_client, direct_writer
from fleettop.supervisor.base import jsonlines
from fleettop.supervisor.config.proxy import (
    AgentBreakerSection,
    BreakerSection,
    ProxySection,
)
from fleettop.supervisor.detect.budget import cost_of
from fleettop.supervisor.detect.redact import redact_headers, redact_json, redact_text
from fleettop.supervisor.detect.retry_loop import RetryDetector
from fleettop.supervisor.detect.trip import Trip

log = logging.getLogger("fleettop.proxy")
Report = Callable[[dict[str, Any]], None]


class Commanded(Protocol):
    def command(self, cmd: dict[str, Any]) -> None: ...

# Chunks are parsed in batches of this many bytes, and the text they hold is booked in batches
# of this many chars (ring, detector, budget): fixed costs per call are most of the cost of a
# one-token event. A trip comes at most that much later (the batch is handled inline, by the
# chunk callback that completes it, so an abort still happens in that callback).
_PARSE_BYTES = 512
_DETECT_CHARS = 128
_BOOK_TOKENS = 32  # book output tokens on the budget this many at a time (and at the end)


class FleettopProxy:
    def __init__(self, report: Report | None = None) -> None:
        self.report: Report = report or (lambda event: None)
        self.proxy = ProxySection()
        self.breaker = BreakerSection()
        self.overrides: dict[str, AgentBreakerSection] = {}
        self.reverse_ports: dict[int, str] = {}
        self.agents: dict[str, AgentState] = {}
        self.auth = Tokens()
        self._authed: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._stats_task: asyncio.Task[None] | None = None
        self._prices = self.proxy.price_table()  # rebuilt on config, not per chunk
        self.incidents = Incidents()

    # --- options -------------------------------------------------------------------------
    def load(self, loader: Any) -> None:
        loader.add_option("fleettop_tokens", str, "",
                          "JSON file {agent: token}; re-read when it changes")
        loader.add_option("fleettop_state", str, "", "state dir (incidents are written here)")

    def configure(self, updated: set[str]) -> None:
        if "fleettop_tokens" in updated and ctx.options.fleettop_tokens:
            path = Path(ctx.options.fleettop_tokens)
            if not path.parent.is_dir():
                raise exceptions.OptionsError(f"fleettop_tokens: no directory {path.parent}")
            self.auth.point_at(str(path))
        if "fleettop_state" in updated and ctx.options.fleettop_state:
            self.incidents.state_dir = Path(ctx.options.fleettop_state)

    def apply_config(self, cfg: ProxyConfig) -> None:
        """At start and on each `reload` (proxy/main.py reads the file, once for all addons)."""
        self.proxy = cfg.proxy
        self.breaker = cfg.breaker
        self.overrides = dict(cfg.agents)
        self.reverse_ports = dict(cfg.reverse_ports)
        self._prices = self.proxy.price_table()
        for name, agent in self.agents.items():
            agent.breaker = self.breaker.merged(self.overrides.get(name))
            agent.budget.p = agent.breaker.budget_params()
            agent.retry.p = agent.breaker.loop_params()

    def running(self) -> None:
        self._stats_task = asyncio.get_running_loop().create_task(self._stats_loop())

    def done(self) -> None:
        if self._stats_task:
            self._stats_task.cancel()
        self.incidents.write_pending()  # those still waiting for their turn

    # --- agents and auth -----------------------------------------------------------------
    def agent(self, name: str) -> AgentState:
        state = self.agents.get(name)
        if state is None:
            state = AgentState(name, self.breaker.merged(self.overrides.get(name)),
                               self.proxy.ring_bytes, self.proxy.keep_requests)
            self.agents[name] = state
        return state


    def _identify(self, flow: http.HTTPFlow) -> str | None:
        mode = flow.client_conn.proxy_mode
        if isinstance(mode, mode_specs.ReverseMode):
            port = flow.client_conn.sockname[1] if flow.client_conn.sockname else None
            return self.reverse_ports.get(port) if port is not None else None
        if flow.client_conn in self._authed:
            return self._authed[flow.client_conn]
        user = self.auth.check(flow.request.headers.get("Proxy-Authorization", ""))
        if user is not None:
            del flow.request.headers["Proxy-Authorization"]
        return user

    # --- hooks ---------------------------------------------------------------------------
    def http_connect(self, flow: http.HTTPFlow) -> None:
        user = self.auth.check(flow.request.headers.get("Proxy-Authorization", ""))
        if user is None:
            flow.response = auth_required()
            return
        del flow.request.headers["Proxy-Authorization"]
        self._authed[flow.client_conn] = user
        flow.metadata["proxyauth"] = (user, "")

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        name = self._identify(flow)
        if name is None:
            flow.response = auth_required()
            return
        flow.metadata["fleettop_agent"] = name
        flow.metadata.setdefault("proxyauth", (name, ""))
        agent = self.agent(name)
        if agent.blocked is not None:
            flow.response = self._blocked_response(agent)

    def request(self, flow: http.HTTPFlow) -> None:
        name = flow.metadata.get("fleettop_agent")
        if name is None or flow.response is not None:
            return
        agent = self.agent(name)
        api = wire.classify(flow.request.path) if flow.request.method == "POST" else None
        body = None
        if api is not None:
            try:
                body = wire.parse_request(flow.request.get_content(strict=False))
            except Exception:
                body = None
        flow.metadata["fleettop_flow"] = FlowState(agent, api if body else None, body)
        self._remember_request(agent, flow, api, body)
        now = time.time()
        trip = agent.budget.on_request(now)
        if trip is None and body is not None and agent.breaker.enabled:
            trip = agent.retry.feed(body)
        if body and isinstance(body.get("model"), str):
            agent.last_model = body["model"]
        if trip is not None and self._trip(agent, trip, flow):
            flow.response = self._blocked_response(agent)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        st: FlowState | None = flow.metadata.get("fleettop_flow")
        if st is None or flow.response is None:
            return
        if st.api is None:
            st.agent.passthrough += 1
            flow.response.stream = True  # relay untouched, only counted
            return
        st.parser = wire.ResponseParser(st.api, flow.response.headers.get("content-type"),
                                        flow.response.headers.get("content-encoding"))
        st.agent.active_streams += 1
        st.agent.loop_score = 0.0  # a new answer starts clean
        on_chunk = self._on_chunk
        # Under Content-Length a chunk can complete the body: the client would take it whole
        # and never read an error event after it. Those batches are checked before they go.
        check_after = "content-length" not in flow.response.headers
        direct = direct_writer(flow) if self.proxy.direct_writes and check_after else None
        chunked = "chunked" in flow.response.headers.get("transfer-encoding", "").lower()

        def relay(data: bytes) -> Any:
            if not data or st.parser is None or st.aborted:
                return on_chunk(flow, st, data)  # the end, a parser gone, or a cut stream
            sent: Any = data  # what mitmproxy is to send
            if direct is not None and not direct.is_closing():
                # Straight to the client's socket (what mitmproxy's HTTP/1 layer would write,
                # framing and all); the bookkeeping comes after, nothing waits for it.
                direct.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
                sent = []
            # Most calls only add the chunk to the parse batch: that much is done here, without
            # the call into _on_chunk (same steps, same order as there).
            if st.raw_bytes + len(data) < _PARSE_BYTES:
                st.raw.append(data)
                st.raw_bytes += len(data)
                return sent
            if sent is not data:
                out = on_chunk(flow, st, data)
                return sent if out is data else out
            if check_after:
                return sent_then_checked(data)
            return on_chunk(flow, st, data)

        def sent_then_checked(data: bytes) -> Any:
            # This chunk completes a parse batch. mitmproxy writes each piece we yield before it
            # resumes us, so the chunk goes out first and the batch is parsed and checked right
            # after, still inside this callback: a trip then sends the error event and cuts the
            # stream behind it (upstream is dropped just as before), and no chunk waits for the
            # detector. The body's end is mitmproxy's to send, after this callback: the client
            # can't take the cut stream for a whole answer.
            yield data
            out = on_chunk(flow, st, data)
            if out is not data:
                yield from out

        flow.response.stream = relay

    def error(self, flow: http.HTTPFlow) -> None:
        st: FlowState | None = flow.metadata.get("fleettop_flow")
        if st is not None:
            st.agent.errors += 1
            if st.parser is not None and not st.aborted:
                st.parser = None
                st.agent.active_streams -= 1

    # --- the chunk callback: parse, account, detect, maybe abort -------------------------
    def _on_chunk(self, flow: http.HTTPFlow, st: FlowState, data: bytes) -> Any:
        if st.aborted:
            if not data:
                # The body ended before the delayed cut: cut now, or mitmproxy would send a
                # clean end of message and the client would take the answer as complete.
                # abort(): close() would still flush the terminator mitmproxy writes next.
                # The error event went out with the previous chunk's write.
                close_client(flow, final=True)
            return []
        parser = st.parser
        if parser is None:
            return data
        try:
            if data:
                st.raw.append(data)
                st.raw_bytes += len(data)
                if st.raw_bytes < _PARSE_BYTES:
                    return data
            if st.raw:
                raw = st.raw[0] if len(st.raw) == 1 else b"".join(st.raw)
                st.raw, st.raw_bytes = [], 0
                deltas = parser.feed(raw)
                if deltas:
                    st.pending += deltas
                    st.pending_chars += sum(map(len, deltas))
            if not data:
                st.pending += parser.finish()
            elif st.pending_chars < _DETECT_CHARS:
                return data
            trip = self._account(st, parser, final=not data)
        except Exception:  # never break the relay
            log.exception("fleettop addon: chunk handling failed")
            return data
        if not data:
            st.parser = None
            st.agent.active_streams -= 1
        if trip is not None and self._trip(st.agent, trip, flow):
            return self._abort(flow, st, trip, final=not data)
        return data

    def _account(self, st: FlowState, parser: wire.ResponseParser, final: bool) -> Trip | None:
        """Book the pending text: ring, loop detector, token budget (and at the end, the rest)."""
        agent = st.agent
        trip = None
        if st.pending:
            # The detector's verdicts do not depend on how the text is cut.
            text = st.pending[0] if len(st.pending) == 1 else "".join(st.pending)
            st.pending, st.pending_chars = [], 0
            agent.add_text(text)
            st.chars_out += len(text)
            if agent.breaker.enabled:
                trip = st.detector.feed(text)
        if final and trip is None and agent.breaker.enabled:
            trip = st.detector.finish()
        if agent.breaker.enabled:
            agent.loop_score = st.detector.score  # the latest stream's, for the UI
        info = parser.info
        if info.model:
            agent.last_model = info.model
        tin = info.tokens_in if info.tokens_in is not None else st.est_in
        tout = (info.tokens_out if info.tokens_out is not None
                else wire.estimate_tokens(st.chars_out))
        d_in, d_out = max(0, tin - st.booked_in), max(0, tout - st.booked_out)
        if d_in or d_out >= _BOOK_TOKENS or (final and d_out):  # booked in steps: per chunk
            # it was a tenth of the chunk callback's cost
            st.booked_in += d_in
            st.booked_out += d_out
            cost = cost_of(agent.last_model, d_in, d_out, self._prices)
            budget_trip = agent.budget.on_usage(time.time(), d_in, d_out, cost)
            trip = trip or budget_trip
        return trip

    def _abort(self, flow: http.HTTPFlow, st: FlowState, trip: Trip,
               final: bool = False) -> Any:
        st.aborted = True
        if st.parser is not None:
            st.parser = None
            st.agent.active_streams -= 1
        goodbye: list[bytes] = []
        if self.proxy.error_event and not final:
            message = _block_message(st.agent)
            if str(st.api).startswith("ollama"):
                # Ollama's own error lines are {"error": "text"}; its client chokes on more.
                payload = json.dumps({"error": f"fleettop_breaker ({trip.kind}): {message}"})
            else:
                payload = json.dumps({"error": {"type": "fleettop_breaker", "kind": trip.kind,
                                                "message": message}})
            framing = flow.response.headers.get("content-type", "") if flow.response else ""
            if "event-stream" in framing:
                goodbye = [f"event: error\ndata: {payload}\n\n".encode()]
            elif "json" in framing:
                goodbye = [payload.encode() + b"\n"]
        if goodbye:
            # Let the error event reach the client first, then cut the connection.
            asyncio.get_running_loop().call_later(0.02, close_client, flow)
        else:
            close_client(flow, final=final)
        return goodbye


    # --- trips, blocks, reports ----------------------------------------------------------
    def _trip(self, agent: AgentState, trip: Trip, flow: http.HTTPFlow | None) -> bool:
        """Report a trip; returns True when the policy blocks the agent."""
        policy = getattr(agent.breaker.policy, trip.kind, "block")
        if agent.relaxed is not None and time.time() < agent.relaxed[1]:
            policy = agent.relaxed[0]  # resumed with a lower breaker, for a while
        agent.trips += 1
        blocks = policy != "warn"
        if blocks:
            agent.blocked = trip
        event = {
            "event": "breaker.trip", "agent": agent.name, "kind": trip.kind, "policy": policy,
            "reason": trip.reason, "evidence": _redacted_evidence(trip.evidence),
            "at_char": trip.at_char, "at_request": trip.at_request, "ts": time.time(),
            "mono_ns": time.monotonic_ns(),  # CLOCK_MONOTONIC is machine-wide: for benches
            "model": agent.last_model,
            "url": redact_text(flow.request.pretty_url) if flow is not None else None,
            "text_tail": redact_text(agent.ring()[-2048:]),
        }
        folder = self.incidents.folder_for(agent.name, event)
        event["incident"] = str(folder) if folder is not None else None
        # The report (which freezes the agent) goes out first; the incident's folder and files
        # (~1 ms: the ring is redacted and written) right after the chunk callback returns.
        self.report(event)
        if folder is not None:
            self.incidents.write_soon(folder, event, agent.ring(), list(agent.requests))
        return blocks


    def release(self, name: str) -> bool:
        agent = self.agents.get(name)
        if agent is None or agent.blocked is None:
            return False
        agent.blocked = None
        agent.retry = RetryDetector(agent.breaker.loop_params())
        self.report({"event": "proxy.released", "agent": name, "ts": time.time()})
        return True

    def _blocked_response(self, agent: AgentState) -> http.Response:
        trip = agent.blocked
        body = {"error": {"type": "fleettop_blocked", "agent": agent.name,
                          "kind": trip.kind if trip else None,
                          "reason": trip.reason if trip else None,
                          "message": _block_message(agent)}}
        return http.Response.make(self.proxy.block_status, json.dumps(body).encode(),
                                  {"content-type": "application/json", "retry-after": "60",
                                   "x-fleettop-blocked": agent.name})

    def _remember_request(self, agent: AgentState, flow: http.HTTPFlow, api: str | None,
                          body: dict[str, Any] | None) -> None:
        if self.proxy.keep_requests <= 0:
            return
        agent.requests.append({
            "ts": time.time(), "method": flow.request.method,
            "url": redact_text(flow.request.pretty_url), "api": api,
            "headers": redact_headers(flow.request.headers.items()),
            "body": redact_json(body) if body is not None else None,
            "body_bytes": len(flow.request.raw_content or b""),
        })

    def stats(self, agent: AgentState) -> dict[str, Any]:
        now = time.time()
        out = {"event": "proxy.stats", "agent": agent.name, "ts": now,
               **agent.budget.snapshot(now), "last_model": agent.last_model,
               "blocked": agent.blocked.to_json() if agent.blocked else None,
               "active_streams": agent.active_streams, "trips": agent.trips,
               "passthrough": agent.passthrough, "errors": agent.errors,
               "text_chars": agent.text_total, "loop_score": agent.loop_score}
        if agent.text_total != agent.reported_total:
            agent.reported_total = agent.text_total
            out["text_tail"] = redact_text(agent.ring()[-1024:])
        return out

    def dump(self, name: str) -> dict[str, Any]:
        agent = self.agents.get(name)
        if agent is None:
            return {"event": "proxy.dump", "agent": name, "error": "unknown agent"}
        return {**self.stats(agent), "event": "proxy.dump", "text": redact_text(agent.ring()),
                "recent_requests": list(agent.requests)}

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self.proxy.stats_interval)
            for agent in list(self.agents.values()):
                self.report(self.stats(agent))

    def command(self, cmd: dict[str, Any]) -> None:
        """Commands from the supervisor: release, dump, stats (proxy/main.py does reload)."""
        kind = cmd.get("cmd")
        if kind == "release":
            ok = self.release(str(cmd.get("agent")))
            self.report({"event": "proxy.reply", "cmd": kind, "agent": cmd.get("agent"), "ok": ok})
        elif kind == "dump":
            self.report(self.dump(str(cmd.get("agent"))))
        elif kind == "stats":
            for agent in list(self.agents.values()):
                self.report(self.stats(agent))
        elif kind == "relax":
            # Until `until` (epoch s) every trip of this agent takes `policy` (e.g. warn).
            state = self.agent(str(cmd.get("agent")))
            state.relaxed = (str(cmd.get("policy") or "warn"), float(cmd.get("until") or 0))
            self.report({"event": "proxy.reply", "cmd": kind, "agent": state.name, "ok": True})
        else:
            self.report({"event": "proxy.reply", "cmd": kind, "ok": False,
                         "error": "unknown command"})


def _block_message(agent: AgentState) -> str:
    why = agent.blocked.reason if agent.blocked else "breaker"
    return (f"fleettop blocked agent {agent.name!r}: {why}. Fix the cause, then resume it with "
            f"`fleettop ctl resume {agent.name}` (or `r` in the fleettop UI).")


def _redacted_evidence(evidence: dict[str, Any]) -> dict[str, Any]:
    return redact_json(evidence)


def stdin_commands(addon: Commanded, loop: asyncio.AbstractEventLoop, stream: Any,
                   on_eof: Any = None) -> threading.Thread:
    """Read JSON-line commands from `stream` in a thread and run them on the proxy's loop;
    `on_eof` runs there when the stream ends (the supervisor is gone)."""

    def reader() -> None:
        for line in stream:
            cmd = jsonlines.decode(line)
            if cmd is not None:
                loop.call_soon_threadsafe(addon.command, cmd)
        if on_eof is not None:
            loop.call_soon_threadsafe(on_eof)

    thread = threading.Thread(target=reader, name="fleettop-proxy-commands", daemon=True)
    thread.start()
    return thread
