"""CPU runaway ("spin") verdicts per agent. Pure: no I/O.

An agent that keeps ≥ ``cpu_percent`` of a core for ≥ ``duration_s`` without
blocking is spinning: a busy loop, a retry without backoff. "Without blocking"
means its voluntary context switches stay under ``max_blocking_per_s``: a busy
server that sleeps on I/O between requests blocks hundreds of times a second.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpinTrip:
    kind: str  # "spin"
    reason: str
    since: float
    t: float
    cpu_percent: float
    voluntary_switches_per_s: float


@dataclass
class SpinDetector:
    cpu_percent: float = 95.0
    duration_s: float = 60.0
    max_blocking_per_s: float = 5.0
    _since: float | None = None
    _tripped: bool = False
    _cpu_sum: float = 0.0
    _n: int = 0

    def feed(self, t: float, cpu_percent: float,
             voluntary_switches_per_s: float) -> SpinTrip | None:
        """One sample; returns a trip once per run of spinning."""
        spinning = (cpu_percent >= self.cpu_percent
                    and voluntary_switches_per_s <= self.max_blocking_per_s)
        if not spinning:
            self._since, self._tripped, self._cpu_sum, self._n = None, False, 0.0, 0
            return None
        if self._since is None:
            self._since = t
        self._cpu_sum += cpu_percent
        self._n += 1
        if self._tripped or t - self._since < self.duration_s:
            return None
        self._tripped = True
        mean = self._cpu_sum / self._n
        return SpinTrip("spin", f"on-CPU {mean:.0f}% of a core for {t - self._since:.0f}s "
                        "without blocking", self._since, t, mean, voluntary_switches_per_s)
