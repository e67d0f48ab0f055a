"""Environment overrides of a store config: ``KVTIER_<FIELD>[__<FIELD or INDEX>...]``.

Segments are separated by a double underscore and matched case-insensitively; a number indexes
a list (one past the end appends); values are read as YAML scalars. ``KVTIER_CONFIG`` and
``KVTIER_CACHE_DIR`` are not overrides; any other ``KVTIER_`` variable must name a setting.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import Any

import yaml

from kvtier.errors import ConfigError

__all__ = ["ENV_PREFIX", "ENV_RESERVED", "apply_env_to", "field_path"]

ENV_PREFIX = "KVTIER_"
#: ``KVTIER_`` variables that are not configuration overrides.
ENV_RESERVED = frozenset({"KVTIER_CONFIG", "KVTIER_CACHE_DIR"})


def field_path(loc: tuple[Any, ...] | list[Any]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _env_value(text: str) -> Any:
    if text == "":
        return ""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_env_to(data: Mapping[str, Any], environ: Mapping[str, str] | None, top: set[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Return ``data`` with ``KVTIER_...`` overrides applied, and {field path: variable} of what they set.

    ``top`` holds the names of the settings. Raises :class:`ConfigError` naming the variable
    when it names no setting or indexes past the end of a list.
    """
    environ = os.environ if environ is None else environ
    out = copy.deepcopy(dict(data))
    origins: dict[str, str] = {}
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX) or var in ENV_RESERVED:
            continue
        parts = [p.lower() for p in var[len(ENV_PREFIX) :].split("__")]
        if not parts[0] or parts[0] not in top or any(p == "" for p in parts):
            raise ConfigError(
                f"{var}: does not name a kvtier setting; use KVTIER_<SETTING>[__<KEY or INDEX>...] "
                f"with a setting from: {', '.join(sorted(top))}"
            )
        path: list[str | int] = [int(p) if p.isdigit() else p for p in parts]
        node: Any = out
        for depth, seg in enumerate(path[:-1]):
            nxt = path[depth + 1]
            node = _descend(node, seg, isinstance(nxt, int), var, path[: depth + 1])
        last = path[-1]
        value = _env_value(environ[var])
        if isinstance(last, int):
            if not isinstance(node, list) or last > len(node):
                raise ConfigError(f"{var}: {field_path(path)} does not exist (index out of range)")
            if last == len(node):
                node.append(value)
            else:
                node[last] = value
        else:
            if not isinstance(node, dict):
                raise ConfigError(f"{var}: {field_path(path[:-1])} is not a mapping")
            node[last] = value
        origins[field_path(path)] = var
    return out, origins


def _descend(node: Any, seg: str | int, want_list: bool, var: str, path: list[str | int]) -> Any:
    if isinstance(seg, int):
        if not isinstance(node, list):
            raise ConfigError(f"{var}: {field_path(path[:-1])} is not a list")
        if seg > len(node):
            raise ConfigError(
                f"{var}: {field_path(path)} does not exist (the list has {len(node)} entries; "
                f"index {len(node)} appends one)"
            )
        if seg == len(node):
            node.append({})
        if not isinstance(node[seg], (dict, list)):
            node[seg] = [] if want_list else {}
        return node[seg]
    if not isinstance(node, dict):
        raise ConfigError(f"{var}: {field_path(path[:-1])} is not a mapping")
    child = node.get(seg)
    if not isinstance(child, (dict, list)):
        child = node[seg] = [] if want_list else {}
    return child
