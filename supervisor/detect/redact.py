"""Redaction of credentials before anything is stored, logged, reported or shown.

Headers: Authorization, Proxy-Authorization, x-api-key, api-key, cookies and any header whose
name says key/token/secret. Bodies: JSON fields named like credentials, and key-shaped strings
anywhere (OpenAI/Anthropic/Google/HF/GitHub/Slack/AWS keys, Bearer tokens, JWTs, URL userinfo).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

REDACTED = "[REDACTED]"

_SECRET_HEADERS = {"authorization", "proxy-authorization", "x-api-key", "api-key", "cookie",
                   "set-cookie", "x-goog-api-key", "openai-organization", "x-auth-token"}
_SECRET_NAME = re.compile(r"(?i)(api[-_]?key|token|secret|passw(or)?d|authori[sz]ation|cookie|"
                          r"credential|private[-_]?key)")
_KEY_SHAPES = re.compile(
    r"(?x)"
    r"(?:sk|pk|rk)-(?:ant-|proj-|live-|test-)?[A-Za-z0-9_\-]{16,}"  # OpenAI, Anthropic, Stripe
    r"|AIza[0-9A-Za-z_\-]{30,}"                                   # Google
    r"|hf_[A-Za-z0-9]{20,}"                                       # Hugging Face
    r"|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"   # GitHub
    r"|xox[abprs]-[A-Za-z0-9\-]{10,}"                             # Slack
    r"|(?:AKIA|ASIA)[0-9A-Z]{16}"                                 # AWS access key id
    r"|gsk_[A-Za-z0-9]{20,}|r8_[A-Za-z0-9]{20,}"                  # Groq, Replicate
    r"|eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}"  # JWT
)
_BEARER = re.compile(r"(?i)\b(bearer|basic|token)\s+[A-Za-z0-9._~+/=\-]{8,}")
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)[^/\s:@]+:[^/\s@]+@")
_ASSIGNMENT = re.compile(
    r"(?i)\b((?:api[-_]?key|token|secret|password|passwd)[\"']?\s*[:=]\s*[\"']?)[^\s\"',;&]{6,}"
)


def redact_text(text: str) -> str:
    """Replace key-shaped substrings in free text.

    The same as the four substitutions in order, but each pattern is only tried where its
    leading literal occurs (found with str.find): a regex scan of every position costs ~70 ns
    a char per pattern, and the ring redacted for an incident is 16 KiB."""
    text = _sub_at(_KEY_SHAPES, text, text, _KEY_PREFIXES, REDACTED)
    text = _sub_at(_BEARER, text, _folded(text), _BEARER_WORDS,
                   lambda m: f"{m.group(1)} {REDACTED}")
    if "://" in text:
        text = _URL_USERINFO.sub(lambda m: f"{m.group(1)}{REDACTED}@", text)
    return _sub_at(_ASSIGNMENT, text, _folded(text), _ASSIGNMENT_WORDS,
                   lambda m: m.group(1) + REDACTED)


# Where each pattern can start: every alternative begins with one of these literals.
_KEY_PREFIXES = ("sk-", "pk-", "rk-", "AIza", "hf_", "ghp_", "gho_", "ghu_", "ghs_", "ghr_",
                 "github_pat_", "xoxa-", "xoxb-", "xoxp-", "xoxr-", "xoxs-", "AKIA", "ASIA",
                 "gsk_", "r8_", "eyJ")
_BEARER_WORDS = ("bearer", "basic", "token")
_ASSIGNMENT_WORDS = ("api", "token", "secret", "passw")
# Under re.IGNORECASE these match "i" and "s" too (the Kelvin sign lowercases to "k" itself).
_FOLD = {0x131: "i", 0x17F: "s"}


def _folded(text: str) -> str | None:
    """`text` lowercased char for char, where an (?i) pattern's ASCII literals can be looked
    up; None when lowercasing changes the length (then positions would not line up)."""
    low = text.lower()
    if not text.isascii():
        if len(low) != len(text):
            return None
        low = low.translate(_FOLD)
    return low


def _sub_at(pattern: re.Pattern[str], text: str, hay: str | None, literals: tuple[str, ...],
            repl: Any) -> str:
    """`pattern.sub(repl, text)`, trying a match only where one of `literals` starts in `hay`
    (None: everywhere)."""
    if hay is None:
        return pattern.sub(repl, text)
    starts: set[int] = set()
    for lit in literals:
        at = hay.find(lit)
        while at >= 0:
            starts.add(at)
            at = hay.find(lit, at + 1)
    if not starts:
        return text
    out: list[str] = []
    last = 0
    for at in sorted(starts):
        if at < last:
            continue
        m = pattern.match(text, at)
        if m is None:
            continue
        out.append(text[last:at])
        out.append(repl if isinstance(repl, str) else repl(m))
        last = m.end()
    if not out:
        return text
    out.append(text[last:])
    return "".join(out)


def redact_headers(headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> dict[str, str]:
    items = headers.items() if isinstance(headers, Mapping) else headers
    out: dict[str, str] = {}
    for name, value in items:
        lname = name.lower()
        if lname in _SECRET_HEADERS or _SECRET_NAME.search(lname):
            out[name] = REDACTED
        else:
            out[name] = redact_text(str(value))
    return out


def redact_json(obj: Any) -> Any:
    """A copy of a decoded JSON value with credential fields and key-shaped strings redacted."""
    if isinstance(obj, dict):
        return {k: (REDACTED if isinstance(v, str) and isinstance(k, str)
                    and _SECRET_NAME.search(k) and k not in _NOT_SECRET else redact_json(v))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact_json(v) for v in obj]
    if isinstance(obj, str):
        return redact_text(obj)
    return obj


# Usage fields are named like tokens but are counts, not credentials.
_NOT_SECRET = {"max_tokens", "max_completion_tokens", "max_output_tokens", "prompt_tokens",
               "completion_tokens", "total_tokens", "input_tokens", "output_tokens", "num_predict",
               "max_new_tokens", "top_k", "stop_token_ids"}
