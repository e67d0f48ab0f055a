"""Store configuration: which tiers, in what order, with which policy.

``load_config`` accepts a dict (or an already validated :class:`StoreConfig`) and returns a
validated, frozen configuration. Errors name the field path, e.g. ``tiers[1].capacity``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvtier.errors import ConfigError
from kvtier.units import parse_size

__all__ = ["TierConfig", "StoreConfig", "load_config", "DEFAULT_CONFIG"]


class TierConfig(BaseModel):
    """One tier: a backend name plus that backend's own options (passed through)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    backend: str
    name: str | None = None
    capacity: int | str
    policy: str | None = None

    @field_validator("capacity")
    @classmethod
    def _size(cls, value: int | str) -> int:
        size = parse_size(value, field="capacity")
        if size <= 0:
            raise ValueError("expected a positive byte size")
        return size

    def options(self) -> dict[str, Any]:
        """The options given to the backend's constructor."""
        data = self.model_dump(exclude={"backend", "name", "policy"})
        data.update(self.model_extra or {})
        return data


class StoreConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tiers: list[TierConfig] = Field(min_length=1)
    policy: str = "lru"
    write: Literal["back", "through"] = "back"
    engine_blocks_per_block: int = Field(default=1, ge=1)
    block_bytes: int | None = Field(default=None, ge=1)
    staging_blocks: int = Field(default=32, ge=1)
    namespace: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


DEFAULT_CONFIG: dict[str, Any] = {
    "tiers": [{"backend": "cpu", "capacity": "2GiB"}],
    "policy": "lru",
}


def _field_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def load_config(config: Mapping[str, Any] | StoreConfig, *, source: str = "config") -> StoreConfig:
    """Validate ``config``; a :class:`~kvtier.errors.ConfigError` names ``source`` and the field."""
    if isinstance(config, StoreConfig):
        return config
    if not isinstance(config, Mapping):
        raise ConfigError(f"{source}: expected a mapping of settings, got {type(config).__name__}")
    try:
        return StoreConfig.model_validate(dict(config))
    except ValidationError as exc:
        problems = "; ".join(f"{_field_path(e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"{source}: {problems}") from None
