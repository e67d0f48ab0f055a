"""Errors of one configured tier, named by its place in the config (``tiers[0].capacity: ...``),
so an operator sees which setting to change."""

from __future__ import annotations

import re

from kvtier.backend import Backend
from kvtier.errors import BackendError, ConfigError, KVTierError
from kvtier.units import format_size

__all__ = ["no_room", "tier_error"]

_FIELD_FIRST = re.compile(r"^([a-z_]+(?:\.[a-z_]+)*): ")


def tier_error(index: int, backend: Backend, exc: KVTierError) -> KVTierError:
    """``exc`` from ``backend.open`` re-raised under the tier's path in the config
    (``tiers[0].capacity: ...``), so the message says which setting to change."""
    text = str(exc)
    prefix = f"{backend.name}: "
    if text.startswith(prefix):
        text = text[len(prefix) :]
    message = f"tiers[{index}].{text}" if _FIELD_FIRST.match(text) else f"tiers[{index}] ({backend.name}): {text}"
    try:
        return type(exc)(message)
    except TypeError:
        return ConfigError(message) if isinstance(exc, ConfigError) else BackendError(message)


def no_room(index: int, backend: Backend, capacity: int) -> str:
    reserve = backend.reserve_bytes()
    overhead = capacity - backend.usable_bytes()
    kept = f", and the {backend.name} tier keeps {format_size(overhead)} of it for its own bookkeeping" if overhead > 0 else ""
    return (
        f"tiers[{index}].capacity: {format_size(capacity)} holds no block: one block needs {format_size(reserve)}{kept}; "
        "give a capacity of several blocks"
    )
