"""Retry loops across requests: an agent re-sending (nearly) the same request again and again.

`RetryDetector.feed(body) -> Trip | None` looks only at the newest content of each request
(its last messages) with UUIDs, timestamps, hex ids and counters masked; a request is a
repeat of one of the last `retry_repeats // 2` when the program-written text is equal, the
remaining numbers are the same (changing numbers are progress, e.g. polling) and the model's
own text is within `retry_max_distance` bits; `retry_repeats` in a row trip.
"""

from __future__ import annotations

import json
import re
from collections import deque
from dataclasses import dataclass
from typing import Any

from fleettop.supervisor.detect.simhash import hamming, simhash_chars
from fleettop.supervisor.detect.token_loop import LoopParams
from fleettop.supervisor.detect.trip import Trip

_MASKS = [
    (re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", re.I),
     "<uuid>"),
    (re.compile(r"\b\d{4}-\d{2}-\d{2}[t ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:z|[+-]\d{2}:?\d{2})?",
                re.I), "<ts>"),
    (re.compile(r"\b\d{2}:\d{2}:\d{2}(?:[.,]\d+)?\b"), "<ts>"),
    (re.compile(r"\b(?:0x)?[0-9a-f]{16,}\b", re.I), "<hex>"),
    (re.compile(r"\b(?=[\w-]*\d)(?=[\w-]*[a-z])[\w-]{16,}\b", re.I), "<id>"),
    (re.compile(r"\b\d{10,}\b"), "<num>"),
    (re.compile(r"\b(attempt|retry|retries|try|tries|iteration|iter|step|round|call|request|run|"
                r"turn|loop|pass|#)\s*(?:no\.?\s*|#\s*)?\d+(?:\s*(?:/|of)\s*\d+)?", re.I),
     r"\1 <n>"),
]
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def mask_volatile(text: str) -> str:
    """Mask UUIDs, timestamps, hex/opaque ids, epoch numbers and attempt counters."""
    for pattern, repl in _MASKS:
        text = pattern.sub(repl, text)
    return text


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_content_text(part) for part in content)
    if isinstance(content, dict):
        parts = [str(content["name"])] if content.get("name") else []
        for key in ("text", "content", "output", "arguments", "input", "thinking"):
            if key in content:
                value = content[key]
                parts.append(value if isinstance(value, str) else _content_text(value)
                             if isinstance(value, list) else json.dumps(value, sort_keys=True))
        if "function" in content:
            parts.append(_content_text(content["function"]))
        return " ".join(parts)
    return str(content)


_MODEL_ROLES = ("assistant", "model", "function_call", "reasoning")


def request_parts(body: Any, messages: int = 2,
                  prompt_chars: int = 1024) -> list[tuple[str, str]] | None:
    """The newest content of an LLM request body as (role, text) pairs; "" role: a prompt."""
    if not isinstance(body, dict):
        return None
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        msgs = body.get("input") if isinstance(body.get("input"), list) else None
    if isinstance(msgs, list) and msgs:
        out = []
        for msg in msgs[-messages:]:
            if isinstance(msg, dict):
                text = _content_text(msg.get("content"))
                if msg.get("tool_calls"):
                    text += " " + _content_text(msg["tool_calls"])
                if not msg.get("content") and not msg.get("tool_calls"):
                    text += " " + _content_text(msg)
                out.append((str(msg.get("role") or msg.get("type") or ""), text))
            else:
                out.append(("", _content_text(msg)))
        return out
    for key in ("prompt", "input"):
        value = body.get(key)
        if isinstance(value, str):
            return [("", value[-prompt_chars:])]
        if isinstance(value, list) and value and isinstance(value[-1], str):
            return [("", value[-1][-prompt_chars:])]
    return None


def request_tail(body: Any, messages: int = 2, prompt_chars: int = 1024) -> str | None:
    """The newest content of an LLM request body (chat, responses, completions, generate)."""
    parts = request_parts(body, messages, prompt_chars)
    if parts is None:
        return None
    return "\n".join(f"{role}: {text}" if role else text for role, text in parts)


@dataclass
class _Seen:
    index: int
    exact: tuple[str, ...]
    fuzzy: str
    fp: int
    numbers: tuple[str, ...]
    text: str


class RetryDetector:
    """Retry loops across one agent's requests; feed it each request body (parsed JSON).

    A retry re-sends the same new content. So the text the program wrote (user, tool, system
    messages, prompts) must be equal once normalised and masked: templated work where a topic,
    a file name or an id changes is progress. Only the model's own text (assistant messages,
    `retry_fuzzy_chars` or longer) may differ, within `retry_max_distance` bits, since sampling
    rephrases it. The match must lie within `retry_max_lag` (default `repeats // 2`) requests
    back (capped by `retry_history`): a cycle counts once it comes round twice within
    `retry_repeats` requests, so a worker cycling through a longer list of tasks is not a loop.
    """

    def __init__(self, params: LoopParams | None = None) -> None:
        self.p = params or LoopParams()
        self._seen: deque[_Seen] = deque(maxlen=self.p.retry_history)
        self.requests = 0
        self.streak = 0
        self._evidence: list[dict[str, Any]] = []

    def feed(self, body: Any) -> Trip | None:
        p = self.p
        parts = request_parts(body, p.retry_tail_messages, p.retry_prompt_chars)
        index = self.requests
        self.requests += 1
        if parts is None:
            return None
        exact: list[str] = []
        fuzzy: list[str] = []
        for role, text in parts:
            masked_part = mask_volatile(" ".join(text.lower().split()))
            if role in _MODEL_ROLES and len(masked_part) >= p.retry_fuzzy_chars:
                fuzzy.append(masked_part)
                exact.append(role)
            else:
                exact.append(f"{role}: {masked_part}")
        masked = "\n".join(exact + fuzzy)
        fuzzy_text = "\n".join(fuzzy)
        fp = simhash_chars(fuzzy_text) if fuzzy_text else 0
        numbers = tuple(_NUMBER.findall(masked))
        match: tuple[int, _Seen] | None = None
        lag = p.retry_max_lag if p.retry_max_lag is not None else p.retry_repeats // 2
        lag_limit = max(1, min(p.retry_history, lag))
        recent = list(self._seen)[-lag_limit:]
        key = tuple(exact)
        for seen in recent:
            if seen.exact != key or seen.numbers != numbers:
                continue
            d = 0 if seen.fuzzy == fuzzy_text else hamming(fp, seen.fp)
            if d <= p.retry_max_distance and (match is None or d < match[0]):
                match = (d, seen)
        self._seen.append(_Seen(index, key, fuzzy_text, fp, numbers, masked[:512]))
        if match is None:
            self.streak = 0
            self._evidence = []
            return None
        self.streak += 1
        self._evidence.append({"request": index, "matches_request": match[1].index,
                               "lag": index - match[1].index,
                               "distance": match[0], "fingerprint": f"{fp:016x}"})
        self._evidence = self._evidence[-p.retry_repeats:]
        if self.streak + 1 < p.retry_repeats:
            return None
        trip = Trip(
            "retry_loop",
            f"{self.streak + 1} near-identical requests in a row",
            {
                "tier": "request_tail",
                "repeats": self.streak + 1,
                "max_distance": self.p.retry_max_distance,
                "repeating_span": masked[:512],
                "hits": list(self._evidence),
            },
            at_request=index,
        )
        self.streak = 0
        self._evidence = []
        return trip
