"""Old import paths of modules that moved into the layer packages (kvtier 0.2 and earlier).

``import kvtier.policies`` (or ``kvtier.codec``, ``kvtier.layout``, ...) still works: the old
name is bound to the module at its new path, the very same module object, so classes,
``isinstance`` checks and monkeypatches are shared between the two names.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

#: old dotted path -> new dotted path; a prefix also maps its submodules.
MOVED: dict[str, str] = {
    "kvtier.admission": "kvtier.manager.admission",
    "kvtier.eventlog": "kvtier.manager.eventlog",
    "kvtier.plan": "kvtier.manager.plan",
    "kvtier.policies": "kvtier.manager.policies",
    "kvtier.promotion": "kvtier.manager.promotion",
    "kvtier.tiers": "kvtier.manager.tiers",
    "kvtier.shared_index": "kvtier.backends.shared_index",
    "kvtier.backends.redis_meta": "kvtier.backends.remote_meta",
    "kvtier.backends.redis_shares": "kvtier.backends.remote_shares",
    "kvtier.jobs": "kvtier.transfer.jobs",
    "kvtier.layout": "kvtier.transfer.layout",
    "kvtier.staging": "kvtier.transfer.staging",
    "kvtier.movers": "kvtier.transfer.movers",
    "kvtier.flush": "kvtier.transfer.flush",
    "kvtier.codec": "kvtier.records.codec",
    "kvtier.record": "kvtier.records.format",
    "kvtier.record_jobs": "kvtier.records.checks",
    "kvtier.deploy": "kvtier.config.deploy",
    "kvtier.cache": "kvtier.config.cache",
    "kvtier.cli": "kvtier.tools.cli",
    "kvtier.bench": "kvtier.tools.bench",
}


def new_path(old: str) -> str | None:
    """The current path of a module once importable as ``old``, or ``None``."""
    head, dot, rest = old, "", ""
    while head:
        if head in MOVED:
            return MOVED[head] + dot + rest
        head, sep, tail = head.rpartition(".")
        rest = tail + dot + rest if rest or dot else tail
        dot = sep
    return None


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target
        self.target_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.target_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # Nothing to run (the module at the new path has run already); the import machinery set
        # ``__spec__`` to the old name's spec, so give the module its own back.
        module.__spec__ = self.target_spec


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds an old path and answers with the module at its new one."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("kvtier."):
            return None
        new = new_path(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(new))


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once). It answers only for the old names, and it
    must come first: an old package path (``kvtier.bench``) is the new package, whose folder the
    path finder would otherwise search for ``kvtier.bench.plot`` and load that module twice."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
