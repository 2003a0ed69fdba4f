"""The fleet file's `proxy:` and `breaker:` sections (and an agent's own `breaker:` override).

    proxy:
      port: 0                 # 0: a free port picked at start
      reverse: {coder: "http://127.0.0.1:11434"}   # agent → upstream, one listener each
      prices: {"gpt-4o*": {input: 2.5, output: 10}}  # USD per 1M tokens, globs allowed
    breaker:
      policy: {token_loop: freeze, retry_loop: freeze, budget: block, rate: block}
      generation: {min_cover: 200, unit_distance: 6, window_distance: 5}
      retry: {repeats: 6, distance: 6, max_lag: null, fuzzy_chars: 64}
      budget: {window: 1h, tokens: 2000000, requests: null, cost: 5.0, rate_per_min: 120}

Defaults were tuned on tests/unit/data (see docs/readme-proxy.md for the corpus numbers).
"""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from fleettop.supervisor.config.units import parse_duration, parse_size

if TYPE_CHECKING:  # the detectors (and numpy) load in the proxy process, not the supervisor
    from fleettop.supervisor.detect.budget import BudgetParams, Price
    from fleettop.supervisor.detect.token_loop import LoopParams

Policy = Literal["warn", "block", "freeze", "kill"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PriceEntry(_Model):
    input: float = Field(0.0, ge=0, description="USD per 1M input tokens")
    output: float = Field(0.0, ge=0, description="USD per 1M output tokens")


class ProxySection(_Model):
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    reverse: dict[str, str] = Field(default_factory=dict)
    reverse_base_port: int = Field(0, ge=0, le=65535)
    upstream_ca: str | None = None
    ssl_insecure: bool = False
    prices: dict[str, PriceEntry] = Field(default_factory=dict)
    ring_bytes: int = Field(16384, ge=8192)
    keep_requests: int = Field(20, ge=0, le=1000)
    stats_interval: float = Field(1.0, gt=0)
    block_status: Literal[403, 429, 503] = 429
    error_event: bool = True
    # How the proxy relays (probes/proxy/relay.py; both read at its start): what one upstream
    # read brought as one piece, and libuv's event loop.
    merge_reads: bool = True
    direct_writes: bool = True  # parsed streams to plain-HTTP/1.1 clients: chunks straight out
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    restart_backoff: float = Field(1.0, gt=0)

    @field_validator("host")
    @classmethod
    def _loopback(cls, value: str) -> str:
        if value != "localhost" and not ipaddress.ip_address(value).is_loopback:
            raise ValueError("the proxy listens on loopback only (127.0.0.1 or ::1)")
        return value

    @field_validator("ring_bytes", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return parse_size(value) if isinstance(value, str) else value

    @field_validator("stats_interval", "restart_backoff", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> Any:
        return parse_duration(value) if isinstance(value, str) else value

    def price_table(self) -> dict[str, Price]:
        from fleettop.supervisor.detect.budget import Price

        return {k: Price(v.input, v.output) for k, v in self.prices.items()}


class PolicySection(_Model):
    token_loop: Policy = "freeze"
    retry_loop: Policy = "freeze"
    budget: Policy = "block"
    rate: Policy = "block"


class GenerationSection(_Model):
    check_every: int = Field(16, ge=1)
    min_period: int = Field(16, ge=1)
    max_period: int = Field(4096, ge=16)
    copies: int = Field(3, ge=2)
    min_cover: int = Field(200, ge=16)
    separator_cover: int = Field(512, ge=16)
    long_period: int = Field(512, ge=16)
    long_copies: int = Field(2, ge=2)
    unit_min_chars: int = Field(40, ge=1)
    unit_min_features: int = Field(6, ge=1)
    unit_distance: int = Field(6, ge=0, le=32)
    unit_code_distance: int = Field(3, ge=-1, le=32)
    unit_history: int = Field(64, ge=1)
    unit_consecutive: int = Field(3, ge=1)
    window: int = Field(256, ge=32)
    stride: int = Field(64, ge=8)
    window_distance: int = Field(5, ge=-1, le=32)
    window_max_lag: int = Field(4096, ge=256)
    window_consecutive: int = Field(3, ge=1)


class RetrySection(_Model):
    distance: int = Field(6, ge=0, le=32)
    history: int = Field(8, ge=1)
    repeats: int = Field(6, ge=2)
    tail_messages: int = Field(2, ge=1)
    prompt_chars: int = Field(1024, ge=16)
    max_lag: int | None = Field(None, ge=1, description="null: repeats // 2")
    fuzzy_chars: int = Field(64, ge=1)


class BudgetSection(_Model):
    window: float = Field(3600.0, gt=0)
    tokens: int | None = Field(None, ge=1)
    requests: int | None = Field(None, ge=1)
    cost: float | None = Field(None, gt=0)
    rate_per_min: float | None = Field(None, gt=0)

    @field_validator("window", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> Any:
        return parse_duration(value) if isinstance(value, str) else value


class BreakerSection(_Model):
    enabled: bool = True
    policy: PolicySection = Field(default_factory=PolicySection)
    generation: GenerationSection = Field(default_factory=GenerationSection)
    retry: RetrySection = Field(default_factory=RetrySection)
    budget: BudgetSection = Field(default_factory=BudgetSection)

    def loop_params(self) -> LoopParams:
        from fleettop.supervisor.detect.token_loop import LoopParams

        g, r = self.generation, self.retry
        return LoopParams(
            a_check_every=g.check_every, a_min_period=g.min_period, a_max_period=g.max_period,
            a_copies=g.copies, a_min_cover=g.min_cover, a_sep_cover=g.separator_cover,
            a_long_period=g.long_period, a_long_copies=g.long_copies,
            b_min_chars=g.unit_min_chars, b_min_features=g.unit_min_features,
            b_max_distance=g.unit_distance, b_fence_distance=g.unit_code_distance,
            b_history=g.unit_history, b_consecutive=g.unit_consecutive,
            c_window=g.window, c_stride=g.stride, c_max_distance=g.window_distance,
            c_max_lag=g.window_max_lag, c_consecutive=g.window_consecutive,
            retry_max_distance=r.distance, retry_history=r.history, retry_repeats=r.repeats,
            retry_tail_messages=r.tail_messages, retry_prompt_chars=r.prompt_chars,
            retry_max_lag=r.max_lag, retry_fuzzy_chars=r.fuzzy_chars,
        )

    def budget_params(self) -> BudgetParams:
        from fleettop.supervisor.detect.budget import BudgetParams

        b = self.budget
        return BudgetParams(window=b.window, max_tokens=b.tokens, max_requests=b.requests,
                            max_cost=b.cost, max_rate_per_min=b.rate_per_min)

    def merged(self, override: AgentBreakerSection | None) -> BreakerSection:
        """This fleet-wide section with an agent's `breaker:` override applied on top."""
        if override is None:
            return self
        data = self.model_dump()
        for key, value in override.model_dump(exclude_none=True).items():
            if isinstance(value, dict):
                data[key].update(value)
            else:
                data[key] = value
        return BreakerSection.model_validate(data)


def _partial(model: type[BaseModel], name: str) -> type[BaseModel]:
    fields: dict[str, Any] = {}
    for fname, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            ann = _partial(ann, f"Agent{ann.__name__}")
        fields[fname] = (ann | None, None)  # type: ignore[operator]
    return create_model(name, __base__=_Model, **fields)


if TYPE_CHECKING:
    class AgentBreakerSection(BreakerSection):
        """For type checkers: at run time every field is optional (made below)."""
else:
    AgentBreakerSection = _partial(BreakerSection, "AgentBreakerSection")
AgentBreakerSection.__doc__ = "An agent's `breaker:` key: any BreakerSection field, all optional."
