"""The fleet file's top-level sections, one model per capability.

Each capability fills in its own section; until it does, the section is a permissive mapping
so fleet files that already carry it keep loading.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class _Reserved(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    def get(self, key: str, default: Any = None) -> Any:
        return (self.model_extra or {}).get(key, default)


class ProxySection(_Reserved):
    pass


class BreakerSection(_Reserved):
    pass


class LeakSection(_Reserved):
    pass


class ProbesSection(_Reserved):
    pass


class GpuSection(_Reserved):
    pass


class GovernorSection(_Reserved):
    pass


class ModelsSection(_Reserved):
    pass


class RoutesSection(_Reserved):
    pass


class ServeSection(_Reserved):
    pass


class UiSection(_Reserved):
    pass
