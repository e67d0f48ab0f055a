"""Byte-size strings: ``"8GiB"``, ``"512MiB"``, ``"1.5GB"``, ``"4096"``."""

from __future__ import annotations

import re

from kvtier.errors import ConfigError

__all__ = ["parse_size", "format_size"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, *, field: str = "size") -> int:
    """Return ``value`` as a number of bytes; ``field`` names the setting in error messages."""
    if isinstance(value, bool):
        raise ConfigError(f"{field}: expected a byte size like '8GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{field}: a byte size cannot be negative, got {value}")
        return value
    if not isinstance(value, str):
        raise ConfigError(f"{field}: expected a byte size like '8GiB', got {value!r}")
    match = _SIZE_RE.match(value)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ConfigError(
            f"{field}: cannot read {value!r} as a byte size; "
            "use a number with an optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit.lower()])


def format_size(num_bytes: int) -> str:
    """A short human form: ``format_size(3 * 2**30) == '3.0GiB'``."""
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{size:.0f}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    return f"{size:.1f}TiB"
