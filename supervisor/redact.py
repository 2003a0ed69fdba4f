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
    """Replace key-shaped substrings in free text."""
    text = _KEY_SHAPES.sub(REDACTED, text)
    text = _BEARER.sub(lambda m: f"{m.group(1)} {REDACTED}", text)
    text = _URL_USERINFO.sub(lambda m: f"{m.group(1)}{REDACTED}@", text)
    return _ASSIGNMENT.sub(lambda m: m.group(1) + REDACTED, text)


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
