"""Named plugins: backends, codecs and eviction policies.

Built-in and third-party plugins are found the same way, through the entry-point groups
``kvtier.backends``, ``kvtier.codecs`` and ``kvtier.policies`` (built-ins are declared in
kvtier's own ``pyproject.toml``). Entries are *listed* when a registry is first used and
*loaded* on first use of a name. A name may also be a fully qualified ``package.module:Object``.
Two distributions claiming one name is an error that names both; an unknown name is an error
that lists the known ones. An entry point that fails to load raises
:class:`~kvtier.errors.MissingDependencyError` (an ``ImportError``) or
:class:`~kvtier.errors.PluginLoadError` (anything else), naming the distribution and the entry
point; its original exception is chained.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from kvtier.errors import ConfigError, MissingDependencyError, PluginLoadError, UnknownNameError

__all__ = ["Registry", "backends", "codecs", "policies", "load_object"]


@dataclass(frozen=True, slots=True)
class _Entry:
    name: str
    value: str
    distribution: str
    entry_point: EntryPoint | None = None


def _hint(exc: ImportError, otherwise: str) -> str:
    """What to do about ``exc``: for a missing module of kvtier's own (not a dependency), the
    real cause (a shadowing copy of kvtier, an incomplete install); else ``otherwise``."""
    missing = getattr(exc, "name", None)
    if isinstance(missing, str) and (missing == "kvtier" or missing.startswith("kvtier.")):
        from kvtier._source_tree import import_problem

        return import_problem(missing)
    return otherwise


def load_object(spec: str, *, what: str = "object") -> Any:
    """Import ``package.module:Attr`` (or ``package.module.Attr``)."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{what}: {spec!r} is not of the form 'package.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = _hint(exc, "is the package that provides it installed?")
        raise MissingDependencyError(f"{what}: cannot import {module_name!r} for {spec!r} ({exc}); {hint}") from exc
    except Exception as exc:  # the module's own bug must not surface as a foreign error
        raise PluginLoadError(f"{what}: importing {module_name!r} for {spec!r} raised {type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise ConfigError(f"{what}: module {module_name!r} has no attribute {attr!r}") from exc
    return obj


class Registry:
    """One entry-point group, listed lazily, loaded on first use, cached."""

    def __init__(self, group: str, kind: str) -> None:
        self.group = group
        self.kind = kind
        self._lock = threading.Lock()
        self._entries: dict[str, list[_Entry]] | None = None
        self._loaded: dict[str, Any] = {}
        self._manual: dict[str, Any] = {}

    def _scan(self) -> dict[str, list[_Entry]]:
        if self._entries is None:
            found: dict[str, list[_Entry]] = {}
            seen: set[tuple[str, str, str]] = set()
            for ep in entry_points(group=self.group):
                dist = ep.dist.name if ep.dist is not None else "<unknown distribution>"
                ident = (ep.name, ep.value, dist)
                if ident in seen:  # the same distribution seen twice on sys.path
                    continue
                seen.add(ident)
                found.setdefault(ep.name, []).append(_Entry(ep.name, ep.value, dist, ep))
            self._entries = found
        return self._entries

    def refresh(self) -> None:
        """Forget the listing (after installing a plugin at run time)."""
        with self._lock:
            self._entries = None
            self._loaded.clear()

    def register(self, name: str, obj: Any) -> None:
        """Register ``obj`` under ``name`` in this process (tests, embedded use)."""
        with self._lock:
            self._manual[name] = obj
            self._loaded.pop(name, None)

    def unregister(self, name: str) -> None:
        with self._lock:
            self._manual.pop(name, None)
            self._loaded.pop(name, None)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(set(self._scan()) | set(self._manual))

    def entries(self) -> dict[str, list[str]]:
        """Name -> providing distributions, for ``kvtier config show`` and error messages."""
        with self._lock:
            out = {name: [e.distribution for e in es] for name, es in self._scan().items()}
        for name in self._manual:
            out.setdefault(name, []).append("<registered in process>")
        return out

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (":" in name or name in self.names())

    def get(self, name: str) -> Any:
        """The object registered as ``name`` (or imported from ``package.module:Name``)."""
        if not isinstance(name, str) or not name:
            raise UnknownNameError(f"{self.kind}: expected a name, got {name!r}; known: {self.names()}")
        with self._lock:
            if name in self._manual:
                return self._manual[name]
            if name in self._loaded:
                return self._loaded[name]
            candidates = self._scan().get(name)
        if candidates is None:
            if ":" in name:
                obj = load_object(name, what=self.kind)
                with self._lock:
                    self._loaded[name] = obj
                return obj
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; known {self.kind}s: {', '.join(self.names()) or '(none)'}"
            )
        if len(candidates) > 1:  # identical listings were merged in _scan
            dists = " and ".join(sorted(f"{e.distribution} ({e.value})" for e in candidates))
            raise ConfigError(f"{self.kind} name {name!r} is claimed by more than one distribution: {dists}")
        entry = candidates[0]
        where = f"entry point {entry.name} = {entry.value!r} (group {self.group}) of distribution {entry.distribution}"
        try:
            obj = entry.entry_point.load() if entry.entry_point is not None else load_object(entry.value)
        except ImportError as exc:
            hint = _hint(exc, f"Install its dependencies (e.g. pip install '{entry.distribution}').")
            raise MissingDependencyError(f"{self.kind} {name!r}: {where} cannot be imported: {exc}. {hint}") from exc
        except Exception as exc:  # a plugin's own bug must not surface as a foreign error
            raise PluginLoadError(
                f"{self.kind} {name!r}: {where} failed to load: {type(exc).__name__}: {exc}. "
                f"Fix or reinstall {entry.distribution}, or remove it."
            ) from exc
        with self._lock:
            self._loaded[name] = obj
        return obj


backends = Registry("kvtier.backends", "backend")
codecs = Registry("kvtier.codecs", "codec")
policies = Registry("kvtier.policies", "policy")
