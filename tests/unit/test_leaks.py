"""Leak verdicts on seeded synthetic traces of every kind research note D names."""

from __future__ import annotations

import numpy as np
import pytest

from fleettop.supervisor.detect.leaks import (
    FAST,
    MEDIUM,
    LeakDetector,
    leak_fit,
    mann_kendall,
    ols,
    replay_trace,
    theil_sen,
)

MiB = 1 << 20
GiB = 1 << 30
LIMIT = 16 * GiB


def base(rng: np.random.Generator, minutes: float = 40) -> tuple[np.ndarray, np.ndarray]:
    t = np.arange(0, minutes * 60, 1.0)
    return t, 300 * MiB + rng.normal(0, 2 * MiB, len(t))


def spikes(rng: np.random.Generator, t: np.ndarray) -> np.ndarray:
    """Prompt-processing spikes: 0.3–1.5 GiB for 2–20 s, about once a minute."""
    out = np.zeros(len(t))
    start = 0.0
    while start < t[-1]:
        start += rng.uniform(30, 90)
        dur, height = rng.uniform(2, 20), rng.uniform(0.3, 1.5) * GiB
        out[(t >= start) & (t < start + dur)] += height
    return out


def sawtooth(t: np.ndarray, amp: float = 200 * MiB, period: float = 30) -> np.ndarray:
    return amp * ((t % period) / period)


def trace(kind: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t, y = base(rng)
    if kind == "leak_60mib_min":
        y += 60 * MiB / 60 * t
    elif kind == "leak_10mib_min_spikes":
        y += 10 * MiB / 60 * t + spikes(rng, t)
    elif kind == "leak_5mib_min_sawtooth":
        y += 5 * MiB / 60 * t + sawtooth(t)
    elif kind == "staircase_spikes":
        y += 64 * MiB * np.floor(t / rng.uniform(80, 100)) + spikes(rng, t)
    elif kind == "leak_1mib_s_after_10min":
        y += np.clip(t - 600, 0, None) * MiB
    elif kind == "flat_spikes":
        y += spikes(rng, t)
    elif kind == "warmup_plateau_spikes":
        y += 400 * MiB / (1 + np.exp(-(t - 120) / 25)) + spikes(rng, t)
    elif kind == "model_load_step":
        y += 2 * GiB * (t >= 1200)
    elif kind == "sawtooth_only":
        y += sawtooth(t)
    elif kind == "tiny_drift":
        y = 300 * MiB + rng.normal(0, 4 * 1024, len(t)) + 64 * 1024 / 60 * t
    elif kind == "small_cache_fill":
        y += np.clip(t - 600, 0, 240) * (48 * MiB / 240)
    elif kind == "bounded_cache_fill":
        y += np.clip(t - 300, 0, 900) * (20 * MiB / 60)
    else:
        raise ValueError(kind)
    return np.column_stack([t, y])


LEAKS = ["leak_60mib_min", "leak_10mib_min_spikes", "leak_5mib_min_sawtooth",
         "staircase_spikes", "leak_1mib_s_after_10min"]
NOT_LEAKS = ["flat_spikes", "warmup_plateau_spikes", "model_load_step", "sawtooth_only",
             "tiny_drift", "small_cache_fill"]


def run(samples: np.ndarray, limit: float = LIMIT) -> tuple[LeakDetector, list]:
    det = LeakDetector(limit=limit)
    trips = [tr for t, v in samples if (tr := det.feed(t, v)) is not None]
    return det, trips


@pytest.mark.parametrize("kind", LEAKS)
@pytest.mark.parametrize("seed", [1])
def test_leaks_are_declared(kind, seed):
    _, trips = run(trace(kind, seed))
    assert trips and trips[0].kind == "leak", kind


@pytest.mark.parametrize("kind", NOT_LEAKS)
@pytest.mark.parametrize("seed", [1, 2])
def test_non_leaks_are_not(kind, seed):
    det, trips = run(trace(kind, seed))
    assert trips == [], [(tr.t, tr.reason, tr.fit.failed) for tr in trips]
    assert det.state == "ok"


def test_fast_leak_declared_within_90s_of_onset():
    _, trips = run(trace("leak_1mib_s_after_10min", 4))
    assert trips, "the leak was never declared"
    # After the onset (a verdict before it would be a false alarm) and within the bound.
    assert 600 < trips[0].t <= 690, [(tr.t, tr.reason) for tr in trips]


def test_bounded_cache_fill_warns_at_most_and_clears():
    # A cache filling to a bound looks like a leak while it fills (note D §4.4): it may
    # warn, but with the limit far away it is never critical, and the verdict clears.
    det, trips = run(trace("bounded_cache_fill", 5))
    assert all(tr.severity == "warn" for tr in trips)
    assert det.state == "ok"


def test_critical_when_the_limit_is_near():
    det, trips = run(trace("leak_60mib_min", 6)[:900], limit=1 * GiB)
    assert any(tr.severity == "critical" for tr in trips)
    crit = next(tr for tr in trips if tr.severity == "critical")
    assert crit.fit.time_to_limit_s is not None and crit.fit.time_to_limit_s < det.horizon_s


def test_r2_alone_would_misjudge_both_ways():
    saw = trace("leak_5mib_min_sawtooth", 7)[-900:]
    t, y = saw[:, 0], saw[:, 1]
    assert ols(t, y)[2] < 0.5  # raw R² hides the leak under the sawtooth...
    fit = leak_fit(saw, MEDIUM, LIMIT)
    assert fit.r2 > 0.8 and fit.suspect  # ...bucket minima recover it
    drift = trace("tiny_drift", 7)[-900:]
    assert ols(drift[:, 0], drift[:, 1])[2] > 0.95  # a tiny drift has R² near 1...
    assert not leak_fit(drift, MEDIUM, LIMIT).suspect  # ...and is no leak


def test_estimators_on_exact_lines():
    x = np.arange(20.0)
    y = 3 * x + 5
    assert ols(x, y) == pytest.approx((3, 5, 1))
    b, lo, hi = theil_sen(x, y)
    assert b == pytest.approx(3) and lo == pytest.approx(3) and hi == pytest.approx(3)
    tau, p = mann_kendall(y)
    assert tau == 1 and p < 1e-6


def test_fit_fields_and_replay_verdict():
    fit = leak_fit(trace("leak_60mib_min", 8)[:400], FAST, LIMIT)
    assert fit.suspect and fit.slope == pytest.approx(MiB, rel=0.1)
    assert fit.time_to_limit_s and fit.time_to_limit_s > 0
    assert set(fit.to_json()) >= {"slope", "intercept", "r2", "theil_sen", "time_to_limit_s"}
    out = replay_trace(map(tuple, trace("leak_60mib_min", 8)), name="x.csv")
    assert out["verdict"] == "leak" and out["detected_at_s"] is not None
    ok = replay_trace(map(tuple, trace("flat_spikes", 8)), name="y.csv")
    assert ok["verdict"] == "ok" and ok["detected_at_s"] is None
