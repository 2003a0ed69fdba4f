"""Model router: agents ask for a task ("a model for write"), the router picks the model.

`route(task, hardware, models, routes, load)` walks the route's candidates in order and takes
the first that fits now: its server is up, it runs on this hardware (a GPU model needs a GPU
with enough VRAM in total, and enough free now unless it is already loaded), the GPU queue is
not longer than the route allows, it is within budget, and its context is big enough. Every
candidate gets a verdict, so `fleettop route TASK` can say why. The same fleet file then runs
on a laptop with no GPU (tiny CPU model or a cloud tier) and on a workstation (the 7B).

Proxy side: `task_of(model)` recognises `route:TASK`; `route(...)` picks; `apply_choice(body,
choice)` rewrites the request's model, and `choice.url` is the upstream to send it to.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fleettop.supervisor.config.gpu import ModelEntry, ModelsSection, Route, RoutesSection

PREFIX = "route:"


@dataclass(frozen=True, slots=True)
class Hardware:
    gpu: bool = False
    vram_total: int = 0
    vram_free: int = 0
    cpus: int = 1
    ram_total: int = 0


@dataclass(frozen=True, slots=True)
class Spend:
    requests: int = 0
    tokens: int = 0
    usd: float = 0.0


@dataclass(slots=True)
class Load:
    """What is true right now, beyond the hardware."""

    gpu_queue: int = 0
    """Waiters on the GPU lock."""
    down: set[str] = field(default_factory=set)
    """Model names whose server did not answer."""
    loaded: set[str] = field(default_factory=set)
    """Model names already resident on the GPU."""
    spent: dict[str, Spend] = field(default_factory=dict)
    """Spend in the current budget period, per model name."""


@dataclass(frozen=True, slots=True)
class Choice:
    task: str
    name: str
    entry: ModelEntry
    fallback: int
    """0 = first choice, 1 = first fallback, ..."""
    verdicts: list[tuple[str, str]]

    @property
    def model(self) -> str:
        return self.entry.model or self.name

    @property
    def url(self) -> str:
        return self.entry.url

    def to_json(self) -> dict[str, Any]:
        return {"task": self.task, "name": self.name, "model": self.model, "url": self.url,
                "backend": self.entry.backend, "device": self.entry.device,
                "fallback": self.fallback,
                "verdicts": [{"candidate": c, "verdict": v} for c, v in self.verdicts]}


class NoRoute(LookupError):
    def __init__(self, task: str, verdicts: list[tuple[str, str]]) -> None:
        why = "; ".join(f"{c}: {v}" for c, v in verdicts) or "no such task in routes:"
        super().__init__(f"no model for task {task!r} ({why})")
        self.task = task
        self.verdicts = verdicts


def gib(n: int) -> str:
    return f"{n / 2**30:.1f}GiB"


def verdict(name: str, entry: ModelEntry, route: Route, hw: Hardware, load: Load) -> str:
    """"ok" or why this candidate can't serve now."""
    if name in load.down:
        return "server down"
    if entry.device == "gpu":
        if not hw.gpu:
            return "needs a GPU; none here"
        need = entry.vram or 0
        if need > hw.vram_total:
            return f"needs {gib(need)} of VRAM; the GPU has {gib(hw.vram_total)}"
        if name not in load.loaded and need > hw.vram_free:
            return f"needs {gib(need)} of VRAM; {gib(hw.vram_free)} free now"
        if route.max_queue is not None and load.gpu_queue > route.max_queue:
            return f"GPU queue is {load.gpu_queue} (route allows {route.max_queue})"
    if route.min_context and entry.context and entry.context < route.min_context:
        return f"context {entry.context} < {route.min_context}"
    budget = entry.budget
    spent = load.spent.get(name, Spend())
    if budget is not None:
        if budget.requests is not None and spent.requests >= budget.requests:
            return f"over budget: {spent.requests}/{budget.requests} requests"
        if budget.tokens is not None and spent.tokens >= budget.tokens:
            return f"over budget: {spent.tokens}/{budget.tokens} tokens"
        if budget.usd is not None and spent.usd >= budget.usd:
            return f"over budget: ${spent.usd:.2f}/${budget.usd:.2f}"
    return "ok"


def route(task: str, hardware: Hardware, models: ModelsSection | Mapping[str, ModelEntry],
          routes: RoutesSection | Mapping[str, Route], load: Load | None = None) -> Choice:
    """The model for `task` now. A task not in `routes` but naming a model routes to it."""
    load = load or Load()
    table = models.root if isinstance(models, ModelsSection) else models
    paths = routes.root if isinstance(routes, RoutesSection) else routes
    rt = paths.get(task)
    if rt is None:
        if task not in table:
            raise NoRoute(task, [])
        rt = Route(use=[task])
    verdicts: list[tuple[str, str]] = []
    for i, name in enumerate(rt.use):
        entry = table.get(name)
        v = "unknown model" if entry is None else verdict(name, entry, rt, hardware, load)
        verdicts.append((name, v))
        if v == "ok" and entry is not None:
            return Choice(task, name, entry, i, verdicts)
    raise NoRoute(task, verdicts)


def task_of(model: object) -> str | None:
    """`route:write` → `write`; anything else → None (not a routed request)."""
    if isinstance(model, str) and model.startswith(PREFIX) and len(model) > len(PREFIX):
        return model[len(PREFIX):]
    return None


def apply_choice(body: dict[str, Any], choice: Choice) -> None:
    """Rewrite a request body for the chosen model (OpenAI, Ollama and Anthropic all use
    `model`); the proxy sends it to `choice.url`."""
    body["model"] = choice.model


def detect_hardware(gpu: Any = None) -> Hardware:
    """This machine: CPUs and RAM from psutil, VRAM from a GpuMemorySource (none: no GPU)."""
    import psutil

    mem = None
    if gpu is not None:
        mem = gpu.read_memory()
    return Hardware(gpu=mem is not None and mem.total > 0,
                    vram_total=mem.total if mem else 0,
                    vram_free=(mem.total - mem.used) if mem else 0,
                    cpus=os.cpu_count() or 1, ram_total=psutil.virtual_memory().total)
