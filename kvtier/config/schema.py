"""The schema of one tier and of the metrics section of a store config, and the validators
the whole config shares (byte sizes, registered names); :mod:`kvtier.config.loader` builds the
store config from them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from kvtier import registry
from kvtier.errors import ConfigError, MissingDependencyError
from kvtier.units import parse_size

__all__ = ["BlockBytes", "ByteSize", "FlushBytes", "InlineBytes", "MetricsConfig", "StagingBytes", "TierConfig"]


def _strip_field(message: str, name: str) -> str:
    """``"capacity: cannot read ..."`` -> ``"cannot read ..."`` (the caller adds the full path)."""
    prefix = f"{name}: "
    return message[len(prefix) :] if message.startswith(prefix) else message


def _size(name: str, *, allow_zero: bool = False) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        try:
            size = parse_size(value, field=name)
        except ConfigError as exc:
            raise ValueError(_strip_field(str(exc), name)) from None
        if size == 0 and not allow_zero:
            raise ValueError(f"expected a positive byte size such as '4GiB', got {value!r}")
        return size

    return parse


def known_names(reg: registry.Registry) -> str:
    plural = reg.kind[:-1] + "ies" if reg.kind.endswith("y") else reg.kind + "s"
    return f"known {plural}: {', '.join(reg.names()) or '(none)'}"


def check_name(reg: registry.Registry, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a {reg.kind} name; {known_names(reg)}")
    if value not in reg:
        raise ValueError(f"unknown {reg.kind} {value!r}; {known_names(reg)}")
    if ":" in value:  # a fully qualified name must import now, not when the store opens
        try:
            reg.get(value)
        except (ConfigError, MissingDependencyError) as exc:
            raise ValueError(str(exc)) from None
    return value


ByteSize = Annotated[int, BeforeValidator(_size("capacity"))]
FlushBytes = Annotated[int, BeforeValidator(_size("flush_on_close_bytes"))]
BlockBytes = Annotated[int, BeforeValidator(_size("block_bytes"))]
StagingBytes = Annotated[int, BeforeValidator(_size("staging_bytes", allow_zero=True))]
InlineBytes = Annotated[int, BeforeValidator(_size("inline_max_bytes", allow_zero=True))]


class TierConfig(BaseModel):
    """One tier: a backend name, its capacity, and the backend's own options (passed through).

    Options other than ``backend``, ``name``, ``capacity``, ``policy`` and ``admit_after`` are handed to the
    backend's constructor unchanged (``path``, ``device``, ``codec``, ``sync_mode``, ...).
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    backend: str
    name: str | None = None
    capacity: ByteSize
    policy: str | None = None
    #: Admission rule (manager-side): a block enters this tier once it was offered this many times.
    admit_after: int = Field(default=1, ge=1)

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        return check_name(registry.backends, value)

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str | None) -> str | None:
        return None if value is None else check_name(registry.policies, value)

    def options(self) -> dict[str, Any]:
        """The keyword arguments for the backend's constructor."""
        data: dict[str, Any] = {"capacity": self.capacity}
        data.update(self.model_extra or {})
        return data

    def to_dict(self) -> dict[str, Any]:
        data = self.model_dump(exclude_none=True)
        if self.admit_after == 1:
            del data["admit_after"]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TierConfig:
        return cls.model_validate(dict(data))


class MetricsConfig(BaseModel):
    """Prometheus export (needs the ``metrics`` extra). Off by default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Register the store with prometheus_client's default registry while it is open.
    prometheus: bool = False
    #: Also serve ``/metrics`` over HTTP on this port (implies ``prometheus``).
    port: int | None = Field(default=None, ge=0, le=65535)
    #: Address the HTTP server binds to.
    addr: str = "127.0.0.1"
    #: Value of the ``store`` label, to tell several stores of one process apart.
    store_label: str = Field(default="kvtier", min_length=1)

    @property
    def enabled(self) -> bool:
        return self.prometheus or self.port is not None

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)
