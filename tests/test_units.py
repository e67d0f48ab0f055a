"""Byte-size parsing and formatting."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.units import format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        (4096, 4096),
        (0, 0),
        ("8GiB", 8 * 2**30),
        ("512 MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("2kb", 2000),
        ("3KiB", 3072),
        ("1TiB", 2**40),
        ("7b", 7),
        (" 2 g ", 2 * 10**9),
    ],
)
def test_parse_size(text: int | str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["lots", "-1", "1.2.3GB", "5 parsecs", "", -1, True, 1.5, None])
def test_parse_size_rejects_with_the_field_name(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.capacity"):
        parse_size(bad, field="tiers[0].capacity")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("num", "text"),
    [(0, "0B"), (1023, "1023B"), (1024, "1.0KiB"), (3 * 2**30, "3.0GiB"), (5 * 2**40, "5.0TiB"), (1536 * 2**20, "1.5GiB")],
)
def test_format_size(num: int, text: str) -> None:
    assert format_size(num) == text


def test_format_then_parse_round_trips_exact_units() -> None:
    for num in (2**10, 2**20, 7 * 2**30):
        assert parse_size(format_size(num)) == num
