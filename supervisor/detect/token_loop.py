"""Token loops: degenerate generation inside one response (retry loops: retry_loop.py).

Pure state machines, no I/O. The proxy addon feeds them from its chunk callback, `fleettop
replay` feeds them recorded traffic; both get the same verdicts for the same text, whatever the
chunking, because normalisation is incremental (a per-delta normalisation breaks exact matching).

Generation (`LoopDetector.feed(delta) -> Trip | None`), three tiers, any one trips:
  A. exact tail period: the tail is >= `a_copies` exact copies of a block of `a_min_period` to
     `a_max_period` chars covering >= `a_min_cover` chars (runs of one separator character need
     `a_sep_cover`); candidate periods are the earlier occurrences of the last 24 chars.
  B. unit SimHash: sentences/lines (list markers dropped, merged to >= 40 chars) fingerprinted
     over the set of word 1+2-grams; `b_consecutive` units in a row within `b_max_distance` bits
     of the unit the same lag back.
  C. window SimHash: 256-char windows every 64 chars over the set of char 5-grams; a window
     within `c_max_distance` bits of a non-overlapping earlier one, `c_consecutive` times in a row.
  B and C pause inside ``` fences: similar code lines sit 6-9 bits apart. A stays on everywhere.
  B and C sit behind a repetition gate: a unit or window is fingerprinted only when one of its
  12-char anchors (one per 32 chars) occurs in the 4 KiB before it, which text that repeats
  nothing seldom does; the earlier ones it is compared with are fingerprinted then.
Defaults are tuned on tests/unit/data (research D: 64-bit SimHash; legit structured text reaches
6-7 bits).
"""

from __future__ import annotations

import bisect
import re
from collections import deque
from dataclasses import dataclass

import numpy as np

from fleettop.supervisor.detect.normalise import Normaliser
from fleettop.supervisor.detect.simhash import (
    fold_rows,
    gram_hashes,
    simhash_features,
)
from fleettop.supervisor.detect.trip import Trip

__all__ = ["LoopParams", "LoopDetector"]


@dataclass(frozen=True)
class LoopParams:
    """Detector thresholds; `BreakerSection.loop_params()` builds one from the fleet file."""

    a_check_every: int = 16
    a_min_period: int = 16
    a_max_period: int = 4096
    a_copies: int = 3
    a_long_period: int = 512
    a_long_copies: int = 2
    a_min_cover: int = 200
    a_sep_cover: int = 512
    b_min_chars: int = 40
    b_min_features: int = 6
    b_max_distance: int = 6
    b_fence_distance: int = 3
    b_history: int = 64
    b_consecutive: int = 3
    c_window: int = 256
    c_stride: int = 64
    c_max_distance: int = 5
    c_max_lag: int = 4096
    c_consecutive: int = 3
    c_batch: int = 8  # windows fingerprinted per pass (a pass every c_batch*c_stride chars)
    retry_max_distance: int = 6
    retry_history: int = 8
    retry_repeats: int = 6
    retry_tail_messages: int = 2
    retry_prompt_chars: int = 1024
    retry_fuzzy_chars: int = 64
    retry_max_lag: int | None = None  # None: retry_repeats // 2


# --- generation loops ----------------------------------------------------------------------

_UNIT_SPLIT = re.compile(r"(?<=[.!?]) |\n")
_LIST_MARKER = re.compile(r"^(?:[-*+>#|]+|\d+[.):]|[a-z][.)])\s*")
_WORD = re.compile(r"\w+")
_KEY = 24
_C_GROUP = 64  # tier C windows handled in one set of array operations, at most
_ANCHOR = 12  # repetition gate: anchors this long ...
_CELL = 32  # ... at every multiple of this many chars ...
_REACH = 4352  # ... found again if they occur this far back (tier C's lag + window)
_B_MAX_UNIT = 4000  # a unit still short of features this long is dropped


def _unit_features(text: str) -> set[str]:
    words = _WORD.findall(text)
    feats = set(words)
    feats.update(f"{a} {b}" for a, b in zip(words, words[1:], strict=False))
    return feats


class _Unit:
    """A tier B unit: its index, where it starts in the normalised text, its text and its
    fingerprint (None until something asks: most units are never compared)."""

    __slots__ = ("index", "start", "text", "fp")

    def __init__(self, index: int, start: int, text: str) -> None:
        self.index = index
        self.start = start
        self.text = text
        self.fp: int | None = None

    def fingerprint(self) -> int:
        if self.fp is None:
            self.fp = simhash_features(_unit_features(self.text))
        return self.fp


class LoopDetector:
    """Degenerate generation inside one response; feed it text deltas as they stream.

    Tiers B and C sit behind a repetition gate: a unit or a window is fingerprinted and
    compared only when one of its anchors (12 chars at every multiple of 32) occurs verbatim
    in the 4 KiB before it. Text that repeats nothing, most text, costs one `str.rfind` per
    32 chars instead of SimHashes; the earlier units and windows that a gated-in one is
    compared with are fingerprinted then (each at most once).
    """

    def __init__(self, params: LoopParams | None = None) -> None:
        self.p = p = params or LoopParams()
        self.norm = Normaliser()
        self.raw_chars = 0
        self.buf = ""
        self.base = 0  # absolute normalised offset of buf[0]
        # The text kept: tier A's longest cover and tier C's reach (lag + window + a batch).
        self._keep = max(p.a_long_copies * p.a_max_period, p.a_copies * p.a_long_period,
                         p.a_sep_cover, p.a_min_cover,
                         p.c_max_lag + p.c_window + p.c_batch * p.c_stride) + _KEY + 64
        self.tripped: Trip | None = None
        self._next_a = p.a_check_every
        self._in_fence = False
        self._seg = ""
        self._seg_at = 0  # absolute normalised offset of _seg[0]
        self._unit = ""
        self._unit_spans: list[tuple[int, int]] = []  # where the pending unit's parts lie
        self._units: deque[_Unit] = deque(maxlen=p.b_history)
        self._unit_index = 0
        self._streaks: dict[int, int] = {}
        self._next_c = p.c_window
        self._w_fps: dict[int, int] = {}  # window end -> fingerprint, for those computed
        self._c_hits = 0
        self._cells: dict[int, bool] = {}  # anchor cell -> its text occurred before
        # 5-gram hashes by absolute position, computed once and only where a window needs them.
        self._grams = np.empty(0, dtype=np.uint64)
        self._g_start = 0

    @property
    def n(self) -> int:
        """Normalised characters seen so far."""
        return self.base + len(self.buf)

    def tail_text(self, chars: int = 8192) -> str:
        return self.buf[-chars:]

    @property
    def score(self) -> float:
        """How close this text is to a trip, 0–1: the furthest tier's run of repeats toward
        its trip (sentences or windows in a row that repeat earlier ones); 1 once tripped."""
        if self.tripped is not None:
            return 1.0
        b = max(self._streaks.values(), default=0) / self.p.b_consecutive
        c = self._c_hits / self.p.c_consecutive
        return round(min(1.0, max(b, c)), 2)

    def feed(self, delta: str) -> Trip | None:
        if self.tripped is not None or not delta:
            return None
        self.raw_chars += len(delta)
        text = self.norm.feed(delta)
        if not text:
            return None
        old = len(self.buf)
        self.buf += text
        fences = self.buf.count("```", max(0, old - 2))
        if fences % 2:
            self._in_fence = not self._in_fence
            self._streaks.clear()
            self._c_hits = 0
        trip = self._tier_a() or self._tier_b(text) or self._tier_c()
        if len(self.buf) > 2 * self._keep:
            cut = len(self.buf) - self._keep
            self.buf = self.buf[cut:]
            self.base += cut
        if trip is not None:
            trip.at_char = self.raw_chars
            self.tripped = trip
        return trip

    def finish(self) -> Trip | None:
        """End of the text: fingerprint the windows still waiting for a full tier C batch."""
        if self.tripped is not None or self.n < self._next_c:
            return None
        trip = self._tier_c(final=True)
        if trip is not None:
            trip.at_char = self.raw_chars
            self.tripped = trip
        return trip

    def _repeats(self, lo: int, hi: int) -> list[int]:
        """Anchor cells in [lo, hi) (absolute) whose text occurs within `_REACH` before them.

        One `rfind` per cell, cached: both tiers ask about the same text."""
        first = -(-lo // _CELL) * _CELL
        out = []
        seen = self._cells
        buf, base = self.buf, self.base
        for c in range(first, hi - _ANCHOR + 1, _CELL):
            hit = seen.get(c)
            if hit is None:
                at = c - base
                hit = seen[c] = at >= 0 and buf.rfind(
                    buf[at : at + _ANCHOR], max(0, at - _REACH), at) >= 0
            if hit:
                out.append(c)
        return out

    def _last_seen(self, cells: list[int], lo: int, hi: int) -> list[int]:
        """Where the anchors of `cells` last occur in [lo, hi) (absolute)."""
        buf, base = self.buf, self.base
        lo, hi = max(lo - base, 0), hi - base
        found = []
        for c in cells:
            q = buf.rfind(buf[c - base : c - base + _ANCHOR], lo, hi)
            if q >= 0:
                found.append(q + base)
        return found

    # Tier A: exact period of the tail.
    def _tier_a(self) -> Trip | None:
        p = self.p
        if self.n < self._next_a:
            return None
        self._next_a = self.n + p.a_check_every
        buf, length = self.buf, len(self.buf)
        if length < p.a_min_cover:
            return None
        key = buf[-_KEY:]
        lo = max(0, length - p.a_max_period - _KEY)
        end = length - 1
        tried = 0
        while tried < 8:
            pos = buf.rfind(key, lo, end)
            if pos < 0:
                return None
            end = pos + _KEY - 1
            period = length - _KEY - pos
            if period < p.a_min_period:
                continue
            tried += 1
            block = buf[length - period :]
            copies = p.a_long_copies if period >= p.a_long_period else p.a_copies
            cover = max(copies * period, p.a_min_cover)
            if cover > length:
                continue
            if buf[length - cover + period :] != buf[length - cover : length - period]:
                continue  # cheap rejection first: most candidates end here
            chars = set(block) - {" ", "\n"}
            if len(chars) <= 1 and not any(c.isalnum() for c in chars):
                cover = max(cover, p.a_sep_cover)  # a rule of ==== or ---- is not a loop
                if cover > length or (buf[length - cover + period :]
                                      != buf[length - cover : length - period]):
                    continue
            start = length - cover
            while start > 0 and buf[start - 1] == buf[start - 1 + period]:
                start -= 1
            return Trip(
                "token_loop",
                f"generation repeats a {period}-char block {(length - start) / period:.1f} times",
                {
                    "tier": "exact_period",
                    "period": period,
                    "repeating_span": block[:512],
                    "loop_start": self.base + start,
                    "loop_end": self.base + length,
                    "copies": round((length - start) / period, 2),
                },
            )
        return None

    # Tier B: sentence/line units, same lag.
    def _tier_b(self, text: str) -> Trip | None:
        self._seg += text
        recent = self._seg[-len(text) - 1 :]
        boundary = ("\n" in text or ". " in recent or "! " in recent or "? " in recent)
        if not boundary and len(self._seg) <= 2000:
            return None
        # Without a boundary in this feed there is none in _seg (the split took the earlier ones).
        parts = _UNIT_SPLIT.split(self._seg) if boundary else [self._seg]
        self._seg = parts.pop()
        starts = []
        at = self._seg_at
        for part in parts:  # every separator is one char
            starts.append(at)
            at += len(part) + 1
        self._seg_at = at
        if len(self._seg) > 2000:  # a run-on line without breaks: cut it, tier A/C cover it
            parts.append(self._seg)
            starts.append(at)
            self._seg_at = at + len(self._seg)
            self._seg = ""
        p = self.p
        for part, start in zip(parts, starts, strict=True):
            seg = _LIST_MARKER.sub("", part.strip())
            if not seg:
                continue
            self._unit = f"{self._unit} {seg}" if self._unit else seg
            self._unit_spans.append((start, start + len(part)))
            if len(self._unit) < p.b_min_chars:
                continue
            # Distinct words are features too: all features are counted only when the first 400
            # chars hold too few words (one more: the word cut at 400 may not be one).
            if (len(set(_WORD.findall(self._unit, 0, 400))) <= p.b_min_features
                    and len(_unit_features(self._unit)) < p.b_min_features):
                if len(self._unit) > _B_MAX_UNIT:  # "0 1 0 0" rows forever: not a sentence
                    self._unit, self._unit_spans = "", []
                continue
            unit, spans = self._unit, self._unit_spans
            self._unit, self._unit_spans = "", []
            trip = self._add_unit(unit, spans)
            if trip is not None:
                return trip
        return None

    def _add_unit(self, text: str, spans: list[tuple[int, int]]) -> Trip | None:
        unit = _Unit(self._unit_index, spans[0][0], text)
        self._unit_index += 1
        limit = self.p.b_fence_distance if self._in_fence else self.p.b_max_distance
        hits: dict[int, tuple[int, int, str]] = {}
        cells = self._repeats(spans[0][0], spans[-1][1]) if self._units else []
        if cells:  # gated in: the units holding those texts, then compare with all known
            lo = max(self._units[0].start, unit.start - _REACH)
            first = [u.start for u in self._units]
            for q in self._last_seen(cells, lo, unit.start):
                self._units[max(0, bisect.bisect_right(first, q) - 1)].fingerprint()
            fp = unit.fingerprint()
            known = [u for u in self._units if u.fp is not None]
            if known:
                fps = np.fromiter((u.fp for u in known), dtype=np.uint64, count=len(known))
                dist = np.bitwise_count(fps ^ np.uint64(fp))
                for k in np.flatnonzero(dist <= limit).tolist():
                    prev = known[k]
                    hits[unit.index - prev.index] = (int(dist[k]), prev.fingerprint(), prev.text)
        self._units.append(unit)
        self._streaks = {lag: self._streaks.get(lag, 0) + 1 for lag in hits}
        for lag, streak in self._streaks.items():
            if streak >= self.p.b_consecutive:
                d, pfp, ptext = hits[lag]
                fp = unit.fingerprint()
                return Trip(
                    "token_loop",
                    f"{streak} consecutive sentences repeat the ones {lag} back",
                    {
                        "tier": "unit_simhash",
                        "lag_units": lag,
                        "repeating_span": text[:512],
                        "matched_span": ptext[:512],
                        "fingerprints": [f"{fp:016x}", f"{pfp:016x}"],
                        "distance": d,
                        "max_distance": limit,
                        "in_code_fence": self._in_fence,
                        "at_norm_char": self.n,
                    },
                )
        return None

    # Tier C: sliding char-5-gram windows, `c_batch` windows at a time. A window whose last
    # stride repeats nothing is a miss without a fingerprint; one that does is compared with
    # every earlier window in reach (fingerprinted now if they were not yet), all at once.
    def _tier_c(self, final: bool = False) -> Trip | None:
        p = self.p
        if self.n < self._next_c + (0 if final else (p.c_batch - 1) * p.c_stride):
            return None
        count = (self.n - self._next_c) // p.c_stride + 1
        ends = [self._next_c + i * p.c_stride for i in range(count)]
        self._next_c += count * p.c_stride
        trip = None
        if self._in_fence:
            self._c_hits = 0
        else:
            for g in range(0, count, _C_GROUP):  # bounded arrays, whatever one feed brings
                group_trip = self._c_group(ends[g : g + _C_GROUP])
                trip = trip or group_trip
        low = self._next_c - p.c_max_lag - p.c_stride
        for end in [e for e in self._w_fps if e < low]:
            del self._w_fps[end]
        for cell in [c for c in self._cells if c < low]:
            del self._cells[cell]
        return trip

    def _c_group(self, ends: list[int]) -> Trip | None:
        p = self.p
        live = [e for e in ends if self._repeats(e - p.c_stride, e)]
        if not live:
            self._c_hits = 0
            return None
        # Fingerprint the live windows and the earlier ones holding their repeated text.
        need = set(live)
        for e in live:
            lo, hi = e - p.c_max_lag - p.c_window, e - p.c_window
            for q in self._last_seen(self._repeats(e - p.c_stride, e), lo, hi):
                top = min(q + p.c_window, hi)
                need.update(range(top - (top - p.c_window) % p.c_stride, q + _ANCHOR - 1,
                                  -p.c_stride))
        need = {e for e in need if e >= p.c_window and e not in self._w_fps}
        if need:
            self._fingerprint_windows(sorted(need))
        fps = self._w_fps
        reach = sorted(e for e in fps if e <= live[-1] - p.c_window)
        bests: dict[int, tuple[int, int, int]] = {}
        if reach:
            ring = np.fromiter((fps[e] for e in reach), dtype=np.uint64, count=len(reach))
            all_ends = np.asarray(reach, dtype=np.int64)
            new_ends = np.asarray(live, dtype=np.int64)[:, None]
            new_fps = np.fromiter((fps[e] for e in live), dtype=np.uint64, count=len(live))
            dist = np.bitwise_count(ring[None, :] ^ new_fps[:, None])
            ok = (all_ends[None, :] <= new_ends - p.c_window) & (
                all_ends[None, :] >= new_ends - p.c_max_lag)
            dist[~ok] = 255
            picks = dist.argmin(axis=1)  # the earliest of equals, as a scan would pick
            for j, i in enumerate(picks.tolist()):
                if ok[j, i]:
                    bests[live[j]] = (int(dist[j, i]), reach[i], int(ring[i]))
        trip = None
        for end in ends:
            best = bests.get(end)
            if best is not None and best[0] <= p.c_max_distance:
                self._c_hits += 1
            else:
                self._c_hits = 0
            if trip is None and self._c_hits >= p.c_consecutive and best is not None:
                rel = end - self.base
                trip = Trip(
                    "token_loop",
                    f"{self._c_hits} windows in a row repeat earlier text "
                    f"(Hamming {best[0]} <= {p.c_max_distance})",
                    {
                        "tier": "window_simhash",
                        "window": [end - p.c_window, end],
                        "matched_window": [best[1] - p.c_window, best[1]],
                        "repeating_span": self.buf[rel - p.c_window : rel],
                        "fingerprints": [f"{fps[end]:016x}", f"{best[2]:016x}"],
                        "distance": best[0],
                        "max_distance": p.c_max_distance,
                    },
                )
        return trip

    def _fingerprint_windows(self, ends: list[int]) -> None:
        """SimHash the windows ending at `ends` (over their distinct 5-grams), in one pass."""
        p = self.p
        lo = min(ends) - p.c_window
        hi = max(ends) - 4  # 5-gram starts needed: [lo, hi)
        g_end = self._g_start + self._grams.size
        if lo < self._g_start or lo > g_end:
            self._grams = gram_hashes(self.buf[lo - self.base : hi + 4 - self.base])
            self._g_start = lo
        elif hi > g_end:
            fresh = gram_hashes(self.buf[g_end - self.base : hi + 4 - self.base])
            self._grams = np.concatenate((self._grams, fresh))
        drop = self._next_c - p.c_max_lag - 2 * p.c_window - p.c_stride - self._g_start
        if 0 < drop < lo - self._g_start:
            self._grams = self._grams[drop:]
            self._g_start += drop
        for g in range(0, len(ends), _C_GROUP):
            group = ends[g : g + _C_GROUP]
            fps = fold_rows(self._grams, [e - p.c_window - self._g_start for e in group],
                             p.c_window - 4)
            self._w_fps.update(zip(group, fps, strict=True))


