"""Per-agent proxy credentials: each agent's run gets a token of its own (HTTP_PROXY's
user:password); the supervisor writes them to a 0600 file the proxy re-reads when it changes."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from mitmproxy import http

_BASIC = re.compile(r"^\s*basic\s+(\S+)\s*$", re.I)


class Tokens:
    def __init__(self) -> None:
        self.path = ""
        """The tokens file ({agent: token}); empty: nobody is let in."""
        self.tokens: dict[str, str] = {}
        self._mtime = -1.0

    def point_at(self, path: str) -> None:
        self.path, self._mtime = path, -1.0

    def reload(self) -> None:
        path = self.path
        if not path:
            return
        try:
            mtime = os.stat(path).st_mtime_ns
            if mtime == self._mtime:
                return
            self.tokens = {str(k): str(v) for k, v in json.loads(Path(path).read_text()).items()}
            self._mtime = mtime
        except (OSError, ValueError, AttributeError):
            pass

    def check(self, header: str) -> str | None:
        """The agent a `Proxy-Authorization: Basic` header names, if its token is right."""
        m = _BASIC.match(header or "")
        if not m:
            return None
        try:
            import base64

            user, _, token = base64.b64decode(m.group(1)).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return None
        self.reload()
        expected = self.tokens.get(user)
        if expected is None or not token or not const_eq(expected, token):
            return None
        return user


def auth_required() -> http.Response:
    return http.Response.make(
        407, b'{"error": "fleettop proxy: credentials required (http://AGENT:TOKEN@host:port)"}',
        {"Proxy-Authenticate": 'Basic realm="fleettop"', "content-type": "application/json"})


def const_eq(a: str, b: str) -> bool:
    import hmac

    return hmac.compare_digest(a.encode(), b.encode())
