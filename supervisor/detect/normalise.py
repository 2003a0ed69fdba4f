"""Incremental normalisation of a text stream: the same text gives the same output whatever
its chunking (a per-delta normalisation would break exact matching across chunk borders)."""

from __future__ import annotations

import re

_NL_RUN = re.compile(r"\s*\n\s*")
_SP_RUN = re.compile(r"[^\S\n]+")


class Normaliser:
    """Lowercase; a whitespace run becomes "\\n" if it holds a newline, else " ". Incremental:
    a run split across deltas is held back until it ends, so the output never depends on where
    the stream was cut."""

    def __init__(self) -> None:
        self._pending = ""
        self._started = False

    def feed(self, delta: str) -> str:
        # Two C-speed substitutions, then only the delta's two ends need care. Each is skipped
        # when it cannot change anything: no newline; no double space and no whitespace but " "
        # (every other whitespace char is non-printable).
        s = delta.lower()
        if "\n" in s:
            s = _SP_RUN.sub(" ", _NL_RUN.sub("\n", s))
        elif "  " in s or not s.isprintable():
            s = _SP_RUN.sub(" ", s)
        if not s:
            return ""
        if s[0] in " \n":
            self._pending = "\n" if (s[0] == "\n" or self._pending == "\n") else " "
            s = s[1:]
            if not s:
                return ""
        tail = ""
        if s[-1] in " \n":
            tail, s = s[-1], s[:-1]
        if self._pending and self._started:
            s = self._pending + s
        self._started = True
        self._pending = tail
        return s
