"""Fleet-file sections for sharing one GPU: `gpu:`, `governor:`, `models:`, `routes:`.

```yaml
gpu:
  lock_timeout: 10m           # how long an exclusive agent or a proxied request waits
  backends:                   # model servers on this GPU (the proxy serialises requests to them)
    - {kind: ollama, url: "http://127.0.0.1:11434"}
  threshold: 85%              # evict idle models above this share of VRAM ...
  schedule:                   # ... or this one, at these times of day
    - {from: "22:00", to: "06:00", threshold: 50%}
  evict_idle_after: 5m
governor: {interval: 2s, cooldown: 30s}
models:
  tiny:   {backend: ollama, url: "http://127.0.0.1:11434", model: "qwen2.5:0.5b", device: cpu}
  writer: {backend: ollama, url: "http://127.0.0.1:11434", model: "qwen2.5:7b", vram: 5GiB}
routes:
  classify: [tiny]
  write: [writer, tiny]
```
"""

from __future__ import annotations

from datetime import time
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    RootModel,
    field_validator,
    model_validator,
)

from fleettop.supervisor.config.units import parse_duration, parse_size, parse_time_of_day

GpuMode = Literal["exclusive", "shared", "none"]
"""Per-agent `gpu:` key. exclusive: the supervisor holds the GPU lock for the agent's whole run;
shared: its requests to local-GPU backends wait for the lock at the proxy; none: no GPU."""


def _fraction(value: object) -> float:
    """`85%`, `0.85` or `85` → 0.85."""
    if isinstance(value, str):
        value = value.strip()
        if value.endswith("%"):
            return float(parse_size(value, allow_percent=True)) / 100.0
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"expected a share like 85% or 0.85, got {value!r}")
    share = float(value) / 100.0 if value > 1 else float(value)
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 100%], got {value!r}")
    return share


Duration = Annotated[float, BeforeValidator(parse_duration)]
Size = Annotated[int, BeforeValidator(parse_size)]
Fraction = Annotated[float, BeforeValidator(_fraction)]
TimeOfDay = Annotated[time, BeforeValidator(parse_time_of_day)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


# --- gpu: ----------------------------------------------------------------------------------

BackendKind = Literal["ollama", "vllm", "llama-swap", "command"]


class GpuBackend(_Strict):
    """A model server that loads models onto this GPU."""

    kind: BackendKind = "ollama"
    url: str | None = None
    """Base URL, e.g. http://127.0.0.1:11434. Requests to it are local-GPU at the proxy."""
    unload_cmd: str | None = None
    """kind=command: shell command run to unload; `{model}` is replaced by the model name."""
    loaded_cmd: str | None = None
    """kind=command: prints the loaded models, one per line (optional)."""
    sleep_level: int = Field(1, ge=1, le=2)
    """kind=vllm: POST /sleep?level=N (1 keeps weights in CPU RAM, 2 drops them)."""

    @model_validator(mode="after")
    def _needs_target(self) -> GpuBackend:
        if self.kind == "command" and not self.unload_cmd:
            raise ValueError("a command backend needs unload_cmd")
        if self.kind != "command" and not self.url:
            raise ValueError(f"a {self.kind} backend needs url")
        return self


class ThresholdWindow(_Strict):
    start: TimeOfDay = Field(alias="from")
    end: TimeOfDay = Field(alias="to")
    threshold: Fraction
    """Evict idle models when GPU memory use is above this share during [from, to)."""


class GpuSection(_Strict):
    lock_dir: str | None = None
    """Lock queue folder; default `<state dir>/gpu`. Point two fleets at one folder to share."""
    lock_timeout: Duration = 600.0
    """How long an exclusive agent (or a proxied request) waits before skipping."""
    backends: list[GpuBackend] = Field(default_factory=list)
    batch_max_wait: Duration = 30.0
    """Proxy batching: requests for the loaded model go first, but none waits longer than this."""
    max_in_flight: int = Field(1, ge=1)
    """Proxy: requests in flight at once to the loaded model."""
    evict: bool = True
    """Run the VRAM watchdog."""
    interval: Duration = 10.0
    threshold: Fraction = 0.85
    schedule: list[ThresholdWindow] = Field(default_factory=list)
    evict_idle_after: Duration = 300.0
    confirm_timeout: Duration = 5.0
    """After an unload, poll this long for the memory to come back before flagging it."""


# --- governor: -----------------------------------------------------------------------------

Ladder = Annotated[list[float], Field(min_length=4, max_length=4)]
"""Four values: the figure at which levels 1, 2, 3 and 4 start."""

GovernorAction = Literal["shrink_context", "evict_idle", "evict_all", "freeze_lowest",
                         "kill_lowest"]


class GovernorThresholds(_Strict):
    memory_some_avg10: Ladder = [10.0, 25.0, 40.0, 60.0]
    memory_full_avg10: Ladder = [2.0, 5.0, 10.0, 20.0]
    io_full_avg10: Ladder = [20.0, 40.0, 60.0, 80.0]
    cpu_some_avg10: Ladder = [80.0, 95.0, 101.0, 101.0]
    agent_memory_some_avg10: Ladder = [20.0, 40.0, 60.0, 80.0]
    """The worst agent cgroup's memory.pressure."""
    swap_pages_per_s: Ladder = [100.0, 1000.0, 5000.0, 20000.0]
    refault_pages_per_s: Ladder = [2000.0, 10000.0, 40000.0, 100000.0]
    gpu_used: Ladder = [0.90, 0.95, 0.98, 0.995]
    unaccounted: Ladder = [0.30, 0.40, 0.50, 0.65]
    """Share of RAM used but owned by no process (kernel, driver pins, leaks)."""
    high_order_free: Ladder = [0.20, 0.10, 0.05, 0.02]
    """Share of free RAM in blocks of order ≥ 4 (64 KiB); lower is worse. Counts only while
    free RAM is under `fragmentation_below` of the total."""
    fragmentation_below: Fraction = 0.10

    @field_validator("high_order_free")
    @classmethod
    def _descending(cls, v: list[float]) -> list[float]:
        if sorted(v, reverse=True) != v:
            raise ValueError("high_order_free must go down from level 1 to 4")
        return v

    @field_validator("memory_some_avg10", "memory_full_avg10", "io_full_avg10",
                     "cpu_some_avg10", "agent_memory_some_avg10", "swap_pages_per_s",
                     "refault_pages_per_s", "gpu_used", "unaccounted")
    @classmethod
    def _ascending(cls, v: list[float]) -> list[float]:
        if sorted(v) != v:
            raise ValueError("a ladder must go up from level 1 to 4")
        return v


def _default_actions() -> dict[int, list[GovernorAction]]:
    return {1: ["shrink_context"], 2: ["shrink_context", "evict_idle"],
            3: ["shrink_context", "evict_idle", "freeze_lowest"],
            4: ["shrink_context", "evict_all", "freeze_lowest", "kill_lowest"]}


class GovernorSection(_Strict):
    enabled: bool = True
    interval: Duration = 2.0
    cooldown: Duration = 30.0
    """Time at a level (and below its thresholds) before stepping down one level."""
    hysteresis: float = Field(0.2, ge=0.0, lt=1.0)
    """Step down only once figures are this share below the level's thresholds."""
    confirm: int = Field(2, ge=1, le=10)
    """Samples in a row a level must be reached before the governor rises to it: one burst
    of page-cache refaults while a fleet starts is not thrashing."""
    thresholds: GovernorThresholds = Field(default_factory=GovernorThresholds)
    actions: dict[Annotated[int, Field(ge=1, le=4)], list[GovernorAction]] = Field(
        default_factory=_default_actions)
    context_caps: dict[Annotated[int, Field(ge=1, le=4)], int] = Field(
        default_factory=lambda: {1: 8192, 2: 4096, 3: 2048, 4: 2048})
    """Cap on `num_ctx` (Ollama) for new requests at each level with shrink_context."""
    max_tokens_caps: dict[Annotated[int, Field(ge=1, le=4)], int] = Field(
        default_factory=lambda: {1: 2048, 2: 1024, 3: 512, 4: 256})
    """Cap on `max_tokens` / `num_predict` for new requests."""
    protect: list[str] = Field(default_factory=list)
    """Agents the governor never freezes or kills."""


# --- models: / routes: ---------------------------------------------------------------------


class Budget(_Strict):
    requests: int | None = Field(None, ge=0)
    tokens: int | None = Field(None, ge=0)
    usd: float | None = Field(None, ge=0)
    period: Duration = 86400.0


class ModelEntry(_Strict):
    backend: Literal["ollama", "openai", "vllm", "llama-swap", "anthropic"] = "openai"
    url: str
    """Base URL of the API (OpenAI-style `/v1` included where the backend wants it)."""
    model: str | None = None
    """Model name the backend knows; default: the entry's key."""
    device: Literal["cpu", "gpu", "cloud"] = "gpu"
    vram: Size | None = None
    """VRAM it needs on the GPU (weights + KV cache at `context`)."""
    context: int | None = Field(None, ge=1)
    cost: float = Field(0.0, ge=0)
    """USD per million tokens; 0 for local or free tiers."""
    budget: Budget | None = None
    api_key_env: str | None = None
    """Environment variable holding the API key the proxy sends upstream."""
    tags: list[str] = Field(default_factory=list)


class ModelsSection(RootModel[dict[str, ModelEntry]]):
    root: dict[str, ModelEntry] = Field(default_factory=dict)


class Route(_Strict):
    use: list[str] = Field(min_length=1)
    """Candidates in order of preference."""
    max_queue: int | None = Field(None, ge=0)
    """Skip GPU candidates while more than this many wait for the GPU lock."""
    min_context: int | None = Field(None, ge=1)


def _route(value: object) -> object:
    if isinstance(value, str):
        return {"use": [value]}
    return {"use": value} if isinstance(value, list) else value


class RoutesSection(RootModel[dict[str, Annotated[Route, BeforeValidator(_route)]]]):
    root: dict[str, Annotated[Route, BeforeValidator(_route)]] = Field(default_factory=dict)


def check_routes(models: ModelsSection, routes: RoutesSection) -> list[str]:
    """Cross-section problems (route → unknown model), as `routes.TASK: message` strings."""
    problems = []
    for task, route in routes.root.items():
        for name in route.use:
            if name not in models.root:
                problems.append(f"routes.{task}: unknown model {name!r} "
                                f"(known: {', '.join(sorted(models.root)) or 'none'})")
    return problems
