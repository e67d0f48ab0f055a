"""What the tests of a checked record read hold in common: the function's Python form and,
where the extension is built, its native one, by name; and a record's head and key."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvtier.records import xxcopy


def forms_of(name: str) -> dict[str, Callable[..., int]]:
    """``xxcopy.<name>_python`` as "python" and ``xxcopy.<name>_native`` as "native" where built."""
    forms: dict[str, Callable[..., int]] = {"python": getattr(xxcopy, f"{name}_python")}
    native = getattr(xxcopy, f"{name}_native")
    if native is not None:
        forms["native"] = native
    return forms


def head_and_key(rng: np.random.Generator) -> tuple[bytes, bytes]:
    """A record's 24-byte head and 32-byte key, drawn from ``rng``."""
    return rng.integers(0, 256, 24, dtype=np.uint8).tobytes(), rng.integers(0, 256, 32, dtype=np.uint8).tobytes()
