"""`fleettop replay`: recorded traffic through exactly the detectors the proxy runs.

    fleettop replay [--json] [--config FILE] [--agent NAME] [--format F] PATH...

One verdict per input. The kind of input is sniffed from its content, whatever its name:
`data:` lines → an SSE stream (OpenAI, Anthropic); JSON lines carrying `message`/`response`
deltas → an NDJSON stream (Ollama); JSON lines carrying `messages` or `prompt` → a request log
(one agent's successive requests); a `t_seconds,bytes` header → a memory trace; a folder → an
incident written by the proxy; anything else → plain text. `--format` forces one.

Streams are decoded by the proxy's own parser (`fleettop.probes.proxy.wire.ResponseParser`)
and their text is fed to `LoopDetector` in deltas of at most 32 characters; requests go through
`BudgetTracker.on_request` then `RetryDetector.feed`, in the addon's order. Caveats: recordings
carry no per-chunk clock, so each input is one instant for budgets (an incident's requests keep
their recorded `ts`); tokens come from the usage fields when recorded, else the addon's own
~4 chars/token estimate; an incident's `response.txt` is the agent's ring buffer, which may
hold the tail of earlier responses before the one that tripped.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # numpy, brotli and zstandard load on replay, not with every CLI command
    from fleettop.probes.proxy import wire
    from fleettop.supervisor.detect.budget import BudgetParams, BudgetTracker, Price
    from fleettop.supervisor.detect.token_loop import LoopParams
    from fleettop.supervisor.detect.trip import Trip

FORMATS = ("sse", "ndjson", "text", "requests", "incident", "memory")
DELTA_CHARS = 32
READ_CHUNK = 4096
SNIFF_LINES = 50
# Trip kinds as the proxy names them → the verdict kinds replay reports.
VERDICT_KIND = {"token_loop": "generation", "retry_loop": "retry", "budget": "budget",
                "rate": "budget"}


class BadInput(Exception):
    """An input that cannot be replayed; the message is shown as `PATH: message`."""


@dataclass(frozen=True)
class ReplayParams:
    """The thresholds the proxy would use for one agent."""

    loop: LoopParams = None  # type: ignore[assignment]  # None → the defaults
    budget: BudgetParams = None  # type: ignore[assignment]
    prices: dict[str, Price] = field(default_factory=dict)
    enabled: bool = True
    memory_limit: float | None = None

    def __post_init__(self) -> None:
        from fleettop.supervisor.detect.budget import BudgetParams
        from fleettop.supervisor.detect.token_loop import LoopParams

        if self.loop is None:
            object.__setattr__(self, "loop", LoopParams())
        if self.budget is None:
            object.__setattr__(self, "budget", BudgetParams())

    @classmethod
    def from_fleet(cls, fleet: Any, agent: str | None = None,
                   memory_limit: float | None = None) -> ReplayParams:
        """The fleet's `breaker:` (with `agent`'s override when it has one), as the proxy does."""
        spec = fleet.agents.get(agent) if agent else None
        breaker = fleet.breaker.merged(spec.breaker if spec is not None else None)
        if memory_limit is None and spec is not None and spec.limits.memory:
            memory_limit = float(spec.limits.memory)
        return cls(breaker.loop_params(), breaker.budget_params(), fleet.proxy.price_table(),
                   breaker.enabled, memory_limit)


# --- sniffing ------------------------------------------------------------------------------

_SSE_FIELDS = (b"data:", b"event:", b"id:", b"retry:", b":")
_STREAM_KEYS = {"message", "response", "choices", "delta", "type", "done", "thinking"}


def read_input(path: Path) -> bytes:
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise BadInput(f"broken gzip: {exc}") from None
    return data.removeprefix(b"\xef\xbb\xbf")


def _head_lines(data: bytes) -> list[bytes]:
    lines = []
    for line in io.BytesIO(data[: 1 << 20]):
        if line.strip():
            lines.append(line.strip())
            if len(lines) >= SNIFF_LINES:
                break
    return lines


def _json_object(line: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def _request_body(obj: dict[str, Any]) -> dict[str, Any] | None:
    """A request body from a log line: the body itself, or an incident record's `body`."""
    if "messages" in obj or "prompt" in obj or ("input" in obj and "model" in obj):
        return obj
    body = obj.get("body")
    if isinstance(body, dict) and ("messages" in body or "prompt" in body or "input" in body):
        return body
    return None


def sniff(path: Path, data: bytes | None = None) -> str:
    """Which of FORMATS an input is, from its content."""
    if path.is_dir():
        return "incident"
    head = _head_lines(read_input(path) if data is None else data)
    if not head:
        return "text"
    if head[0].replace(b" ", b"").lower() == b"t_seconds,bytes":
        return "memory"
    if head[0].startswith(_SSE_FIELDS) and any(line.startswith(b"data:") for line in head):
        return "sse"
    obj = _json_object(head[0])
    if obj is not None:
        if _request_body(obj) is not None:
            return "requests"
        if _STREAM_KEYS & obj.keys():
            return "ndjson"
    return "text"


# --- replays -------------------------------------------------------------------------------

class _StreamReplay:
    """One response, as the addon's `_FlowState` + `_account` see it (one instant in time).

    Text is cut into pieces at fixed offsets (every DELTA_CHARS) whatever the framing, so the
    same text gives the same `at_char` as SSE, NDJSON or plain text."""

    def __init__(self, params: ReplayParams, budget: BudgetTracker, now: float = 0.0,
                 est_in: int = 0) -> None:
        from fleettop.supervisor.detect.token_loop import LoopDetector

        self.p = params
        self.detector = LoopDetector(params.loop)
        self.budget = budget
        self.now = now
        self.est_in = est_in
        self.chars = 0
        self.booked_in = 0
        self.booked_out = 0
        self.model: str | None = None
        self.trip: Trip | None = None
        self._pending = ""

    def feed(self, text: str, info: wire.Extract | None = None, final: bool = False
             ) -> Trip | None:
        self._pending += text
        while self.trip is None and (len(self._pending) >= DELTA_CHARS
                                     or (final and self._pending)):
            piece, self._pending = self._pending[:DELTA_CHARS], self._pending[DELTA_CHARS:]
            self.chars += len(piece)
            if self.p.enabled:
                self.trip = self.detector.feed(piece)
            self.account(info)
        if final and self.trip is None:
            self.account(info)  # usage that arrived after the last text
        return self.trip

    def account(self, info: wire.Extract | None) -> None:
        from fleettop.probes.proxy import wire
        from fleettop.supervisor.detect.budget import cost_of

        if info is not None and info.model:
            self.model = info.model
        tin = info.tokens_in if info is not None and info.tokens_in is not None else self.est_in
        tout = (info.tokens_out if info is not None and info.tokens_out is not None
                else wire.estimate_tokens(self.chars))
        d_in, d_out = max(0, tin - self.booked_in), max(0, tout - self.booked_out)
        if d_in or d_out:
            self.booked_in += d_in
            self.booked_out += d_out
            cost = cost_of(self.model, d_in, d_out, self.p.prices)
            trip = self.budget.on_usage(self.now, d_in, d_out, cost)
            if trip is not None and trip.at_char is None:
                trip.at_char = self.chars
            self.trip = self.trip or trip


def _verdict(name: str, fmt: str, trip: Trip | None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"input": name, "format": fmt, "verdict": "ok" if trip is None
                           else "loop", "kind": None, "reason": None, "at_char": None,
                           "at_request": None, "evidence": None}
    if trip is not None:
        out.update(kind=VERDICT_KIND.get(trip.kind, trip.kind), trip_kind=trip.kind,
                   reason=trip.reason, at_char=trip.at_char, at_request=trip.at_request,
                   evidence=trip.evidence)
    out.update(extra)
    return out


def replay_stream(data: bytes, fmt: str, params: ReplayParams, name: str = "") -> dict[str, Any]:
    """An SSE or NDJSON response body (or plain text) through the parser and LoopDetector."""
    from fleettop.probes.proxy import wire
    from fleettop.supervisor.detect.budget import BudgetTracker

    budget = BudgetTracker(params.budget)
    trip = budget.on_request(0.0)
    flow = _StreamReplay(params, budget)
    malformed = events = 0
    if trip is None and fmt == "text":
        trip = flow.feed(data.decode("utf-8", "replace"), final=True)
    elif trip is None:
        ctype = "text/event-stream" if fmt == "sse" else "application/x-ndjson"
        parser = wire.ResponseParser("ollama_chat" if fmt == "ndjson" else None, ctype)
        chunks = [data[i : i + READ_CHUNK] for i in range(0, len(data), READ_CHUNK)]
        for chunk in [*chunks, b""]:  # b"": end of body, as mitmproxy signals it
            deltas = parser.feed(chunk) if chunk else parser.finish()
            trip = flow.feed("".join(deltas), parser.info, final=not chunk)
            if trip is not None:
                break
        malformed, events = parser.malformed, parser.events
        if not events and data.strip():
            raise BadInput(f"no {fmt.upper()} events could be parsed")
    extra: dict[str, Any] = {"chars": flow.chars, "tokens_in": flow.booked_in,
                             "tokens_out": flow.booked_out}
    if fmt != "text":
        extra.update(events=events, malformed=malformed)
    return _verdict(name, fmt, trip, **extra)


def _request_records(data: bytes) -> tuple[list[tuple[float | None, dict[str, Any] | None]], int]:
    records: list[tuple[float | None, dict[str, Any] | None]] = []
    malformed = 0
    for line in io.BytesIO(data):
        if not line.strip():
            continue
        obj = _json_object(line)
        if obj is None:
            malformed += 1
            continue
        ts = obj.get("ts") if "body" in obj and isinstance(obj.get("ts"), int | float) else None
        records.append((ts, _request_body(obj)))
    return records, malformed


def replay_requests(records: Iterable[tuple[float | None, dict[str, Any] | None]],
                    params: ReplayParams, budget: BudgetTracker | None = None
                    ) -> tuple[Trip | None, int]:
    """Successive requests of one agent, in the addon's order: budget, then retry."""
    from fleettop.probes.proxy import wire
    from fleettop.supervisor.detect.budget import BudgetTracker, cost_of
    from fleettop.supervisor.detect.retry_loop import RetryDetector

    budget = budget or BudgetTracker(params.budget)
    retry = RetryDetector(params.loop)
    t0: float | None = None
    n = 0
    for index, (ts, body) in enumerate(records):
        n = index + 1
        t0 = ts if t0 is None and ts is not None else t0
        now = 0.0 if ts is None or t0 is None else ts - t0
        trip = budget.on_request(now)
        if trip is None and body is not None and params.enabled:
            trip = retry.feed(body)
        if trip is None and body is not None:
            # The prompt's tokens, as the addon books them when the response has no usage.
            est = wire.estimate_tokens(wire.request_text_chars(body))
            model = body.get("model") if isinstance(body.get("model"), str) else None
            trip = budget.on_usage(now, est, 0, cost_of(model, est, 0, params.prices))
        if trip is not None:
            trip.at_request = index
            return trip, n
    return None, n


def replay_request_log(data: bytes, params: ReplayParams, name: str = "") -> dict[str, Any]:
    records, malformed = _request_records(data)
    if not any(body is not None for _, body in records):
        raise BadInput("no request bodies (JSON objects with `messages` or `prompt`)")
    trip, n = replay_requests(records, params)
    return _verdict(name, "requests", trip, requests=n, malformed=malformed)


def replay_incident(folder: Path, params: ReplayParams, name: str = "") -> dict[str, Any]:
    """An incident folder: its requests, then its response text, against the recorded trip."""
    from fleettop.supervisor.detect.budget import BudgetTracker

    files = {p.name for p in folder.iterdir()}
    if not files & {"event.json", "response.txt", "requests.jsonl"}:
        raise BadInput("not an incident folder (no event.json, response.txt or requests.jsonl)")
    recorded: dict[str, Any] | None = None
    if "event.json" in files:
        try:
            event = json.loads((folder / "event.json").read_text())
        except ValueError as exc:
            raise BadInput(f"event.json: {exc}") from None
        recorded = {k: event.get(k) for k in ("agent", "kind", "reason", "at_char",
                                              "at_request", "policy", "ts")}
    trips: list[Trip] = []
    n_requests = chars = 0
    if "requests.jsonl" in files:
        records, _ = _request_records((folder / "requests.jsonl").read_bytes())
        trip, n_requests = replay_requests(records, params)
        trips += [trip] if trip else []
    if "response.txt" in files:
        text = (folder / "response.txt").read_text(errors="replace")
        flow = _StreamReplay(params, BudgetTracker(params.budget))
        trip = flow.feed(text, final=True)
        chars = flow.chars
        trips += [trip] if trip else []
    want = recorded.get("kind") if recorded else None
    trip = next((t for t in trips if t.kind == want), trips[0] if trips else None)
    return _verdict(name, "incident", trip, recorded=recorded,
                    reproduced=None if want is None else bool(trip and trip.kind == want),
                    requests=n_requests, chars=chars)


def _memory_rows(data: bytes) -> list[tuple[float, float]]:
    rows: list[tuple[float, float]] = []
    reader = csv.reader(io.StringIO(data.decode("utf-8", "replace")))
    header = next(reader, None)
    if header is None or [h.strip().lower() for h in header] != ["t_seconds", "bytes"]:
        raise BadInput("a memory trace starts with the header `t_seconds,bytes`")
    for lineno, row in enumerate(reader, start=2):
        if not row or not "".join(row).strip() or row[0].lstrip().startswith("#"):
            continue
        try:
            t, v = (float(x) for x in row)
        except ValueError:
            raise BadInput(f"line {lineno}: expected two numbers, got {','.join(row)!r}") from None
        rows.append((t, v))
    return rows


def replay_path(path: str | Path, fmt: str | None = None,
                params: ReplayParams | None = None) -> dict[str, Any]:
    """The verdict for one input (raises BadInput or OSError when it can't be replayed)."""
    params = params or ReplayParams()
    path = Path(path)
    name = str(path)
    data = None if path.is_dir() else read_input(path)
    if fmt is None:
        fmt = sniff(path, data)
    if fmt not in FORMATS:
        raise BadInput(f"unknown format {fmt!r} (one of {', '.join(FORMATS)})")
    if fmt == "incident":
        if not path.is_dir():
            raise BadInput("an incident is a folder")
        return replay_incident(path, params, name)
    if data is None:
        raise BadInput(f"is a folder (only an incident can be; --format {fmt} given)")
    if fmt == "memory":
        from fleettop.supervisor.detect.leaks import replay_trace

        result = dict(replay_trace(_memory_rows(data), limit=params.memory_limit, name=name))
        result["format"] = "memory"
        result["kind"] = "leak" if result["verdict"] == "leak" else None
        return result
    if fmt == "requests":
        return replay_request_log(data, params, name)
    return replay_stream(data, fmt, params, name)


# --- command line --------------------------------------------------------------------------
