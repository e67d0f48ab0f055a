"""Paths in a config: ``~`` and environment variables are expanded when the config is loaded.

A tier option that names a file or folder (``path``, or a name ending in ``_path``, ``_dir`` or
``_file``, such as the Redis tier's ``tls_ca_file``) may start with ``~`` or ``~user`` (that user's
home) and hold ``$VAR`` or ``${VAR}``. They are expanded once, when the config is loaded, so
``kvtier config check`` shows and checks the same path the store opens. A variable that is not
set is an error naming the tier option and the variable, never a folder named ``$VAR``; so is a
``~user`` whose user does not exist. A relative path stays relative: it is relative to the
working directory of the process that opens the store (not to the config file).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["expand_path", "expand_tier_paths", "is_path_option"]

_VAR = re.compile(r"\$(\w+|\{[^}]*\})")


def is_path_option(name: str) -> bool:
    """Whether a tier option names a file or folder (and is expanded)."""
    return name == "path" or name.endswith(("_path", "_dir", "_file"))


def expand_path(value: str, environ: Mapping[str, str] | None = None) -> str:
    """``value`` with ``~``/``~user`` and ``$VAR``/``${VAR}`` expanded; ``ValueError`` naming a
    variable that is not set or a user that does not exist."""
    env = os.environ if environ is None else environ

    def var(m: re.Match[str]) -> str:
        name = m.group(1).strip("{}")
        if not name or name not in env:
            raise ValueError(f"environment variable ${name or '{}'} in {value!r} is not set")
        return env[name]

    out = _VAR.sub(var, value)
    if out.startswith("~"):
        expanded = os.path.expanduser(out)
        if expanded.startswith("~"):
            user = out[1:].split("/", 1)[0]
            raise ValueError(f"{value!r}: no home folder for {'~' + user if user else '~ (HOME is not set)'}")
        out = expanded
    return out


def expand_tier_paths(data: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """A copy of ``data`` with each tier's path options expanded, and (field, problem) pairs."""
    out = dict(data)
    problems: list[tuple[str, str]] = []
    tiers = out.get("tiers")
    if not isinstance(tiers, list):
        return out, problems
    expanded: list[Any] = []
    for i, tier in enumerate(tiers):
        if not isinstance(tier, Mapping):
            expanded.append(tier)
            continue
        tier = dict(tier)
        for key, value in tier.items():
            if isinstance(key, str) and is_path_option(key) and isinstance(value, str):
                try:
                    tier[key] = expand_path(value)
                except ValueError as exc:
                    problems.append((f"tiers[{i}].{key}", str(exc)))
        expanded.append(tier)
    out["tiers"] = expanded
    return out, problems
