"""How the ``kvtier`` commands print: a plain text table, or one JSON document."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

__all__ = ["print_json", "table"]


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """``rows`` under ``headers``, columns padded to their widest cell, a rule under the header."""
    cells = [[str(h) for h in headers], *[["" if c is None else str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str))
