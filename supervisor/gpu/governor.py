"""Resource governor: back off before the machine thrashes, in levels 0–4.

Figures: PSI (`/proc/pressure/{memory,cpu,io}` and each agent cgroup's `memory.pressure`),
swap-in/out and refault rates from `/proc/vmstat`, the share of free RAM still in high-order
blocks (`/proc/buddyinfo`), GPU memory use, and RAM that no process accounts for. Each figure
has a four-step ladder; the level is the highest step any figure reaches. Up is immediate;
down is one level at a time, only after `cooldown` at the level and only once every figure is
`hysteresis` below its step, so a level doesn't flap on a noisy average.

Levels map to actions (configurable): shrink the context of new requests (the proxy reads the
caps from the state file), evict idle models, freeze the lowest-priority agents (resumed by the
governor when pressure clears), kill as a last resort. Every level change and action is an
event carrying the figures that caused it. Readers take a root path so tests feed files.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleettop.supervisor.base.files import atomic_write_json
from fleettop.supervisor.base.periodic import every
from fleettop.supervisor.config.gpu import GovernorSection

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
HIGH_ORDER = 4
"""Blocks of order ≥ 4 (64 KiB with 4 KiB pages): what huge pages and DMA buffers need."""
DESCENDING = {"high_order_free"}


# --- readers -------------------------------------------------------------------------------


def read_psi(path: str | os.PathLike[str]) -> dict[str, dict[str, float]] | None:
    """`some avg10=.. avg60=.. avg300=.. total=..` (+ `full`) → {"some": {...}, "full": {...}}."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[kind] = {k: float(v) for k, v in (p.split("=", 1) for p in rest.split())}
    return out


def read_vmstat(root: str | os.PathLike[str] = "/") -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in (Path(root) / "proc/vmstat").read_text().splitlines():
            key, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                out[key] = int(value)
    return out


def read_meminfo(root: str | os.PathLike[str] = "/") -> dict[str, int]:
    """Bytes."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in (Path(root) / "proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                with contextlib.suppress(ValueError):
                    out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def high_order_free_share(root: str | os.PathLike[str] = "/") -> float | None:
    """Share of free pages sitting in blocks of order ≥ HIGH_ORDER, over all zones."""
    total = high = 0
    try:
        lines = (Path(root) / "proc/buddyinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        counts = line.split(",", 1)[-1].split()[2:]  # "Node 0, zone Normal n0 n1 ..."
        for order, count in enumerate(counts):
            with contextlib.suppress(ValueError):
                pages = int(count) << order
                total += pages
                if order >= HIGH_ORDER:
                    high += pages
    return high / total if total else None


RSS_SCAN_EVERY = 30.0
AGENT_PSI_EVERY = 10.0
"""Walking every process is the governor's dearest read; the figure moves slowly."""


def rss_total(root: str | os.PathLike[str] = "/") -> int:
    """Σ VmRSS of every process (bytes). Shared pages count more than once: an upper bound."""
    total = 0
    proc = Path(root) / "proc"
    with contextlib.suppress(OSError):
        for entry in os.scandir(proc):
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                for line in Path(entry.path, "status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
                        break
    return total


class Sampler:
    """Reads every figure once per call; rates come from the previous call."""

    def __init__(self, root: str | os.PathLike[str] = "/", *,
                 cgroups: Callable[[], Mapping[str, Path | None]] = dict,
                 gpu: Any = None, clock: Callable[[], float] = time.monotonic,
                 rss_every: float = RSS_SCAN_EVERY) -> None:
        self.root = Path(root)
        self.rss_every = rss_every
        self.cgroups = cgroups
        self.gpu = gpu
        self.clock = clock
        self._prev: tuple[float, dict[str, int]] | None = None
        self._rss: tuple[float, int] | None = None
        self._agent_psi_at: float | None = None
        self._agent_psi: dict[str, float] = {}
        self.worst_agent: str | None = None

    def sample(self) -> dict[str, float]:
        fig: dict[str, float] = {}
        for res, keys in (("memory", ("some", "full")), ("io", ("full",)), ("cpu", ("some",))):
            psi = read_psi(self.root / "proc/pressure" / res)
            for k in keys:
                if psi and k in psi:
                    fig[f"{res}_{k}_avg10"] = psi[k].get("avg10", 0.0)
        worst = None
        # With 200 agents the per-cgroup reads are most of the governor's cost: on a calm box
        # read them every AGENT_PSI_EVERY only (an agent can still feel pressure alone,
        # against its own memory.max).
        calm = not fig.get("memory_some_avg10") and not fig.get("memory_full_avg10")
        now = self.clock()
        due = self._agent_psi_at is None or now - self._agent_psi_at >= AGENT_PSI_EVERY
        if calm and not due:
            fig.update(self._agent_psi)
        else:
            self._agent_psi_at = now
        if due or not calm:
            for name, cg in self.cgroups().items():
                psi = read_psi(Path(cg) / "memory.pressure") if cg else None
                if psi and "some" in psi and (worst is None or psi["some"]["avg10"] > worst[1]):
                    worst = (name, psi["some"]["avg10"])
            self._agent_psi = {"agent_memory_some_avg10": worst[1]} if worst else {}
            fig.update(self._agent_psi)
        now, vm = self.clock(), read_vmstat(self.root)
        if self._prev is not None and now > self._prev[0]:
            dt, old = now - self._prev[0], self._prev[1]

            def rate(*keys: str) -> float:
                return sum(max(0, vm.get(k, 0) - old.get(k, 0)) for k in keys) / dt

            fig["swap_pages_per_s"] = rate("pswpin", "pswpout")
            fig["refault_pages_per_s"] = rate("workingset_refault_anon",
                                              "workingset_refault_file", "workingset_refault")
        self._prev = (now, vm)
        mem = read_meminfo(self.root)
        total = mem.get("MemTotal", 0)
        if total:
            free = mem.get("MemFree", 0)
            used = total - free - mem.get("Buffers", 0) - mem.get("Cached", 0) \
                - mem.get("SReclaimable", 0)
            if self._rss is None or now - self._rss[0] >= self.rss_every:
                self._rss = (now, rss_total(self.root))
            fig["unaccounted"] = max(0, used - self._rss[1]) / total
            share = high_order_free_share(self.root)
            if share is not None:
                fig["high_order_free"] = share
                fig["free_share"] = free / total
        if self.gpu is not None:
            gm = self.gpu.read_memory()
            if gm is not None and gm.total:
                fig["gpu_used"] = gm.used / gm.total
        self.worst_agent = worst[0] if worst else None
        return fig


# --- levels --------------------------------------------------------------------------------


def level_for(fig: Mapping[str, float], config: GovernorSection, *,
              slack: float = 0.0) -> tuple[int, dict[str, int]]:
    """The highest ladder step any figure reaches; `slack` lowers every step (hysteresis)."""
    th = config.thresholds
    steps: dict[str, int] = {}
    for name in type(th).model_fields:
        if name == "fragmentation_below" or name not in fig:
            continue
        ladder: list[float] = getattr(th, name)
        value = fig[name]
        if name in DESCENDING:
            if fig.get("free_share", 0.0) >= th.fragmentation_below:
                continue  # plenty free: a split-up free list costs nothing yet
            n = sum(1 for t in ladder if value <= t * (1 + slack))
        else:
            n = sum(1 for t in ladder if value >= t * (1 - slack))
        if n:
            steps[name] = n
    return max(steps.values(), default=0), steps


@dataclass(slots=True)
class GovernorState:
    level: int = 0
    since: float = 0.0
    num_ctx_cap: int | None = None
    max_tokens_cap: int | None = None
    figures: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"level": self.level, "since": self.since, "num_ctx_cap": self.num_ctx_cap,
                "max_tokens_cap": self.max_tokens_cap, "figures": self.figures,
                "pid": os.getpid()}


def read_state(path: str | os.PathLike[str]) -> GovernorState:
    """Proxy side: the caps in force now (level 0 when the file is missing or its writer died)."""
    try:
        data = json.loads(Path(path).read_text())
        os.kill(int(data["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return GovernorState()
    return GovernorState(int(data["level"]), float(data["since"]), data.get("num_ctx_cap"),
                         data.get("max_tokens_cap"), data.get("figures") or {})


def shrink_request(body: dict[str, Any], num_ctx_cap: int | None,
                   max_tokens_cap: int | None) -> dict[str, Any]:
    """Cap a new request's context/output (Ollama options, OpenAI/Anthropic max_tokens) in
    place; returns {field: (old, new)} for what changed."""
    changed: dict[str, Any] = {}

    def cap(holder: dict[str, Any], key: str, limit: int | None, add: bool) -> None:
        if limit is None:
            return
        old = holder.get(key)
        if (isinstance(old, int) and old > limit) or (old is None and add):
            holder[key] = limit
            changed[key] = (old, limit)

    ollama = "options" in body or "prompt" in body or "keep_alive" in body
    if ollama:
        options = body.setdefault("options", {})
        if isinstance(options, dict):
            cap(options, "num_ctx", num_ctx_cap, add=True)
            cap(options, "num_predict", max_tokens_cap, add=True)
    else:
        key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        cap(body, key, max_tokens_cap, add=True)
    return changed


Emit = Callable[..., Any]


class Governor:
    def __init__(self, sampler: Sampler, config: GovernorSection, *, supervisor: Any = None,
                 evictor: Any = None, emit: Emit | None = None,
                 state_path: str | os.PathLike[str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.sampler = sampler
        self.config = config
        self.sup = supervisor
        self.evictor = evictor
        self.emit = emit if emit is not None else (supervisor.emit if supervisor else
                                                   (lambda *a, **k: None))
        self.state_path = Path(state_path) if state_path else None
        self.clock = clock
        self.state = GovernorState(since=clock())
        self.frozen: list[str] = []
        """Agents this governor froze, oldest first; it resumes them, newest first."""
        self._last_action: dict[str, float] = {}
        self._seen: deque[int] = deque(maxlen=10)

    def _actions(self, level: int) -> list[str]:
        return list(self.config.actions.get(level, [])) if level else []

    async def step(self, figures: Mapping[str, float] | None = None) -> GovernorState:
        fig = dict(self.sampler.sample() if figures is None else figures)
        now = self.clock()
        seen, steps = level_for(fig, self.config)
        self._seen.append(seen)
        confirm = self.config.confirm
        up = min(list(self._seen)[-confirm:]) if len(self._seen) >= confirm else 0
        current = self.state.level
        if up > current:
            self._change(up, now, fig, steps, "pressure rose")
        elif current > 0 and now - self.state.since >= self.config.cooldown:
            down, _ = level_for(fig, self.config, slack=self.config.hysteresis)
            if down < current:
                self._change(current - 1, now, fig, steps, "pressure eased")
        self.state.figures = {k: round(v, 4) for k, v in fig.items()}
        await self._act(now, fig)
        self._save()
        return self.state

    def _change(self, level: int, now: float, fig: Mapping[str, float],
                steps: Mapping[str, int], why: str) -> None:
        old = self.state.level
        self.state.level, self.state.since = level, now
        acts = self._actions(level)
        shrink = "shrink_context" in acts
        self.state.num_ctx_cap = self.config.context_caps.get(level) if shrink else None
        self.state.max_tokens_cap = self.config.max_tokens_caps.get(level) if shrink else None
        causes = ", ".join(f"{k}={fig[k]:.3g}" for k in sorted(steps, key=lambda k: -steps[k]))
        self.emit("governor.level", None, f"level {old} → {level}: {why}"
                  + (f" ({causes})" if causes else ""), **{"from": old, "to": level},
                  figures={k: round(v, 4) for k, v in fig.items()}, steps=dict(steps),
                  actions=acts, num_ctx_cap=self.state.num_ctx_cap,
                  max_tokens_cap=self.state.max_tokens_cap)

    def _due(self, action: str, now: float) -> bool:
        last = self._last_action.get(action)
        if last is not None and now - last < self.config.cooldown:
            return False
        self._last_action[action] = now
        return True

    async def _act(self, now: float, fig: Mapping[str, float]) -> None:
        level = self.state.level
        acts = self._actions(level)
        figures = {k: round(v, 4) for k, v in fig.items()}
        reason = f"governor level {level}"
        if self.evictor is not None:
            for action in ("evict_all", "evict_idle"):
                if action in acts and self._due(action, now):
                    result = await self.evictor.evict_idle(reason,
                                                           idle_only=action == "evict_idle")
                    self.emit("governor.action", None, f"{action}: {len(result.evictions)} "
                              f"model(s) unloaded", action=action, level=level, figures=figures)
                    break
        if self.sup is None:
            return
        if "freeze_lowest" in acts and self._due("freeze_lowest", now):
            victim = self._victim()
            if victim:
                await self.sup.freeze_agent(victim, reason=f"{reason}: memory pressure",
                                            source="governor", evidence=figures)
                self.frozen.append(victim)
                self.emit("governor.action", victim, f"froze {victim} (lowest priority)",
                          action="freeze_lowest", level=level, figures=figures)
        if "kill_lowest" in acts and self._due("kill_lowest", now):
            victim = self._victim(include_frozen=True)
            if victim:
                self.emit("governor.action", victim, f"stopping {victim}: last resort",
                          action="kill_lowest", level=level, figures=figures)
                if victim in self.frozen:
                    self.frozen.remove(victim)
                await self.sup.stop_agent(victim)
        freezing_levels = [lv for lv, a in self.config.actions.items() if "freeze_lowest" in a]
        if self.frozen and level < min(freezing_levels, default=5):
            name = self.frozen.pop()
            await self.sup.resume_agent(name, reason=f"governor: pressure cleared "
                                        f"(level {level})")
            self.emit("governor.action", name, f"resumed {name}: pressure cleared",
                      action="resume", level=level, figures=figures)

    def _victim(self, include_frozen: bool = False) -> str | None:
        states = {"running", "frozen"} if include_frozen else {"running"}
        agents = [a for a in self.sup.snapshot().get("agents", [])
                  if a.get("state") in states and a["name"] not in self.config.protect]
        if not agents:
            return None
        agents.sort(key=lambda a: (a.get("priority", 0), -(a.get("rss_bytes") or 0)))
        return str(agents[0]["name"])

    def _save(self) -> None:
        if self.state_path is None:
            return
        atomic_write_json(self.state_path, self.state.to_json())

    async def run(self, stop: asyncio.Event | None = None) -> None:
        await every(self.config.interval, self.step, stop,
                    lambda exc: self.emit("governor.error", None, str(exc)))
