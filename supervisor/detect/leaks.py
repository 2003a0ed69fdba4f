"""Memory-leak verdicts over an agent's RSS (or VRAM) samples. Pure: no I/O.

Plain OLS with an R² gate (KernelCap, Prometheus ``predict_linear``) is wrong both
ways: a 64 KiB/min drift with tiny noise has R² = 1.0, and a real 5 MiB/min leak
under a GC sawtooth has R² = 0.03 (research note D §4.3). So a window is a leak
*suspect* only when all of these hold on its bucket minima (the post-GC floor, which
also drops prompt spikes), smoothed by a 3-point median:

- Theil–Sen slope with its 95% lower bound above zero, and at least ``rate_min`` and
  0.1% of the level per minute;
- Mann–Kendall τ ≥ 0.6 with p < 1e-3 (monotonic);
- growth over the window ≥ ``grow_min`` and ≥ 2% of the level;
- no single bucket step above half the growth (a model load is a step, not a leak);
- the recent half still rising at ≥ half the full slope (a finished warm-up or a
  cache that reached its bound is not);
- OLS R² ≥ ``r2_min`` (one gate among several, as the fit's diagnostic).

A leak is declared when a window is suspect on ``persistence`` consecutive
evaluations; it becomes critical when the projected time to the limit is within
the horizon. A bounded cache *while it fills* is indistinguishable from a leak, so
the policy warns on the trend and freezes only on projected exhaustion.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache

import numpy as np

MiB = 1 << 20


@dataclass(frozen=True)
class WindowRule:
    """One evaluation window and its gates."""

    name: str
    window_s: float
    bucket_s: float
    rate_min: float  # bytes/s
    grow_min: float  # bytes
    min_buckets: int
    r2_min: float = 0.8
    after_s: float = 0.0  # ignore this window until the series is this old (warm-up)


# Defaults from research note D §4.5, plus a fast window for leaks of ≥ 30 MiB/min
# (1 MiB/s must be caught within ~90 s of onset); it waits out a 5-min warm-up.
FAST = WindowRule("90s", 90, 5, 30 * MiB / 60, 48 * MiB, 12, r2_min=0.95, after_s=300)
MEDIUM = WindowRule("15m", 900, 30, 2 * MiB / 60, 64 * MiB, 20)
SLOW = WindowRule("60m", 3600, 30, 1 * MiB / 60, 32 * MiB, 60)
DEFAULT_RULES = (FAST, MEDIUM, SLOW)


@dataclass(frozen=True)
class LeakFit:
    """A fit over one window's bucket minima. Slopes in bytes/s, times in seconds."""

    window: str
    n: int  # buckets
    span_s: float
    slope: float  # OLS
    intercept: float  # OLS, at the window's first bucket
    r2: float
    theil_sen: float
    theil_sen_low: float
    theil_sen_high: float
    tau: float  # Mann–Kendall
    p_value: float
    growth: float  # bytes over the span (Theil–Sen)
    level: float  # latest floor, bytes
    limit: float | None
    time_to_limit_s: float | None
    suspect: bool
    failed: tuple[str, ...] = ()  # gates that did not hold

    def to_json(self) -> dict[str, object]:
        d = asdict(self)
        d["failed"] = list(self.failed)
        return d


@dataclass(frozen=True)
class Trip:
    """A verdict change the supervisor acts on: warn, or freeze (critical)."""

    kind: str  # "leak"
    severity: str  # "warn" | "critical"
    reason: str
    fit: LeakFit
    t: float


def ols(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Slope, intercept and R² of the least-squares line."""
    if len(x) < 2 or np.ptp(x) == 0:
        return 0.0, float(y.mean()) if len(y) else 0.0, 0.0
    xm, ym = x.mean(), y.mean()
    sxx = float(((x - xm) ** 2).sum())
    sxy = float(((x - xm) * (y - ym)).sum())
    syy = float(((y - ym) ** 2).sum())
    slope = sxy / sxx
    r2 = 0.0 if syy == 0 else (sxy * sxy) / (sxx * syy)
    return slope, ym - slope * xm, r2


@lru_cache(maxsize=64)
def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.triu_indices(n, k=1)


def theil_sen(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Median pairwise slope with its 95% confidence bounds (Sen 1968, as scipy does)."""
    n = len(x)
    if n < 2:
        return 0.0, 0.0, 0.0
    i, j = _pairs(n)
    dx = x[j] - x[i]
    keep = dx != 0
    slopes = np.sort((y[j] - y[i])[keep] / dx[keep])
    if len(slopes) == 0:
        return 0.0, 0.0, 0.0
    med = float(np.median(slopes))
    sigma = math.sqrt(n * (n - 1) * (2 * n + 5) / 18)
    nt = len(slopes)
    hi = min(int(round((nt + 1.959964 * sigma) / 2)), nt - 1)
    lo = max(int(round((nt - 1.959964 * sigma) / 2)) - 1, 0)
    return med, float(slopes[lo]), float(slopes[hi])


def mann_kendall(y: np.ndarray) -> tuple[float, float]:
    """Kendall's τ of y against time and the two-sided p-value (no tie correction)."""
    n = len(y)
    if n < 3:
        return 0.0, 1.0
    i, j = _pairs(n)
    s = float(np.sign(y[j] - y[i]).sum())
    var = n * (n - 1) * (2 * n + 5) / 18
    z = 0.0 if s == 0 else (s - math.copysign(1, s)) / math.sqrt(var)
    return s / (n * (n - 1) / 2), math.erfc(abs(z) / math.sqrt(2))


def bucket_minima(t: np.ndarray, y: np.ndarray, bucket_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Minimum per bucket (aligned to the newest sample), at each bucket's centre."""
    idx = np.floor((t[-1] - t) / bucket_s).astype(int)  # non-increasing: t is sorted
    starts = np.flatnonzero(np.concatenate(([True], idx[1:] != idx[:-1])))
    mins = np.minimum.reduceat(y, starts)
    centres = t[-1] - (idx[starts] + 0.5) * bucket_s
    return centres, mins


def _median3(y: np.ndarray) -> np.ndarray:
    if len(y) < 3:
        return y
    padded = np.concatenate(([y[0]], y, [y[-1]]))
    out: np.ndarray = np.median(np.stack([padded[:-2], padded[1:-1], padded[2:]]), axis=0)
    return out


def leak_fit(samples: Sequence[tuple[float, float]] | np.ndarray, rule: WindowRule = MEDIUM,
             limit: float | None = None) -> LeakFit:
    """Fit one window (the newest ``rule.window_s`` of samples) and apply its gates."""
    arr = np.asarray(samples, dtype=float).reshape(-1, 2)
    if len(arr):
        arr = arr[arr[:, 0] >= arr[-1, 0] - rule.window_s]
    if len(arr) < 2:
        return LeakFit(rule.name, 0, 0.0, 0.0, float(arr[0, 1]) if len(arr) else 0.0, 0.0,
                       0.0, 0.0, 0.0, 0.0, 1.0, 0.0, float(arr[-1, 1]) if len(arr) else 0.0,
                       limit, None, False, ("too few samples",))
    x, m = bucket_minima(arr[:, 0], arr[:, 1], rule.bucket_s)
    m = _median3(m)
    x0 = x[0]
    xs = x - x0
    slope, intercept, r2 = ols(xs, m)
    b, lo, hi = theil_sen(xs, m)
    tau, p = mann_kendall(m)
    span = float(xs[-1]) if len(xs) else 0.0
    growth = b * span
    level = float(m[-1])
    median_level = float(np.median(m))
    ttl = None
    if limit is not None and b > 0:
        ttl = max(0.0, (limit - float(arr[-1, 1])) / b)
    failed = []
    if len(m) < rule.min_buckets:
        failed.append(f"buckets {len(m)} < {rule.min_buckets}")
    if not lo > 0:
        failed.append("Theil-Sen lower bound <= 0")
    if b < max(rule.rate_min, 0.001 * median_level / 60):
        failed.append("slope below minimum")
    if tau < 0.6 or p >= 1e-3:
        failed.append("not monotonic (Mann-Kendall)")
    if growth < max(rule.grow_min, 0.02 * median_level):
        failed.append("growth below minimum")
    rise = float(m[-1] - m[0])
    steps = np.diff(m)
    if len(steps) and (rise <= 0 or float(steps.max()) >= 0.5 * rise):
        failed.append("single step")
    half = len(m) // 2
    if len(m) >= 4 and theil_sen(xs[half:], m[half:])[0] < 0.5 * b:
        failed.append("recent half flattening")
    if r2 < rule.r2_min:
        failed.append(f"R2 {r2:.2f} < {rule.r2_min}")
    return LeakFit(rule.name, len(m), span, slope, intercept, r2, b, lo, hi, tau, p, growth,
                   level, limit, ttl, not failed, tuple(failed))


@dataclass
class LeakDetector:
    """Feeds samples, evaluates every ``eval_s``, returns a Trip on a verdict change.

    ``limit`` is the agent's memory limit (cgroup memory.max, else host MemAvailable,
    or GPU total minus a reserve for VRAM); ``horizon_s``: critical when the projected
    time to the limit is shorter.
    """

    limit: float | None = None
    horizon_s: float = 20 * 60
    eval_s: float = 5.0
    persistence: int = 2
    rules: tuple[WindowRule, ...] = DEFAULT_RULES
    metric: str = "rss"
    _samples: deque[tuple[float, float]] = field(default_factory=deque)
    _hits: dict[str, int] = field(default_factory=dict)
    _next_eval: float | None = None
    _t0: float | None = None
    state: str = "ok"  # "ok" | "warn" | "critical"
    last_fit: LeakFit | None = None

    def feed(self, t: float, value: float) -> Trip | None:
        if self._t0 is None:
            self._t0 = t
            self._next_eval = t + self.eval_s
        self._samples.append((t, float(value)))
        keep = max(r.window_s for r in self.rules)
        while self._samples and self._samples[0][0] < t - keep:
            self._samples.popleft()
        if self._next_eval is None or t < self._next_eval:
            return None
        self._next_eval = t + self.eval_s
        return self._evaluate(t)

    def _evaluate(self, t: float) -> Trip | None:
        age = t - (t if self._t0 is None else self._t0)
        arr = np.asarray(self._samples, dtype=float)
        declared: LeakFit | None = None
        fits: list[LeakFit] = []
        for rule in self.rules:
            if age < rule.after_s or age < rule.bucket_s * rule.min_buckets:
                self._hits[rule.name] = 0
                continue
            fit = leak_fit(arr, rule, self.limit)
            fits.append(fit)
            self._hits[rule.name] = self._hits.get(rule.name, 0) + 1 if fit.suspect else 0
            if self._hits[rule.name] >= self.persistence and (
                    declared is None or (fit.time_to_limit_s or math.inf)
                    < (declared.time_to_limit_s or math.inf)):
                declared = fit
        suspects = [f for f in fits if f.suspect]
        best = suspects[0] if suspects else max(fits, key=lambda f: f.n, default=None)
        self.last_fit = declared or best or self.last_fit
        if declared is None:
            self.state = "ok"
            return None
        ttl = declared.time_to_limit_s
        new = "critical" if ttl is not None and ttl < self.horizon_s else "warn"
        if new == self.state or (new == "warn" and self.state == "critical"):
            self.state = new
            return None
        self.state = new
        mib_min = declared.theil_sen * 60 / MiB
        reason = f"{self.metric} leak {mib_min:.1f} MiB/min over {declared.window}"
        if ttl is not None:
            reason += f", limit in {ttl / 60:.0f} min"
        return Trip("leak", new, reason, declared, t)


def replay_trace(rows: Iterable[tuple[float, float]], limit: float | None = None,
                 name: str = "") -> dict[str, object]:
    """Verdict for a recorded memory trace (``t_seconds,bytes``), for ``fleettop replay``."""
    det = LeakDetector(limit=limit)
    detected_at: float | None = None
    t0: float | None = None
    for t, v in rows:
        t0 = t if t0 is None else t0
        trip = det.feed(t, v)
        if trip is not None and detected_at is None:
            detected_at = t - t0
    fit = det.last_fit
    return {
        "input": name,
        "verdict": "leak" if detected_at is not None else "ok",
        "slope_bytes_per_s": fit.slope if fit else None,
        "theil_sen_bytes_per_s": fit.theil_sen if fit else None,
        "r2": fit.r2 if fit else None,
        "detected_at_s": detected_at,
        "final_state": det.state,
    }
