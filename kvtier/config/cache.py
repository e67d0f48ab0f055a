"""kvtier's own cache directory: what is in it, and removing it (``kvtier cache show|clear``).

The directory is the platform's user cache directory for ``kvtier`` (``~/.cache/kvtier`` on
Linux, or ``$KVTIER_CACHE_DIR``). The default configuration keeps its LMDB tier there
(``lmdb/``), and ``kvtier sim`` keeps its own small tiers under ``sim/``. Nothing outside this
directory is ever listed or removed: a tier configured elsewhere is the operator's to manage.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from kvtier.errors import ConfigError

__all__ = ["CacheEntry", "cache_dir", "cache_entries", "clear_cache"]


def cache_dir() -> str:
    """The kvtier cache directory (``$KVTIER_CACHE_DIR`` overrides the platform default)."""
    override = os.environ.get("KVTIER_CACHE_DIR")
    if override:
        return os.path.abspath(override)
    from platformdirs import user_cache_dir

    return user_cache_dir("kvtier")


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """One top-level entry of the cache directory and the disk bytes under it."""

    path: str
    bytes: int
    kind: str  # "lmdb tier", "file tier", "simulator tiers", "other"


def _disk_bytes(path: str) -> int:
    if os.path.isfile(path) or os.path.islink(path):
        try:
            return os.lstat(path).st_blocks * 512
        except OSError:
            return 0
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                continue
    return total


def _kind(path: str) -> str:
    if os.path.basename(path) == "sim":
        return "simulator tiers"
    if os.path.isfile(os.path.join(path, "data.mdb")):
        return "lmdb tier"
    if os.path.isfile(os.path.join(path, "kvtier-meta.kvm")):
        return "file tier"
    return "other"


def cache_entries(root: str | None = None) -> list[CacheEntry]:
    """The top-level entries of the cache directory (empty when it does not exist)."""
    root = root or cache_dir()
    if not os.path.isdir(root):
        return []
    out = []
    with os.scandir(root) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            out.append(CacheEntry(entry.path, _disk_bytes(entry.path), _kind(entry.path)))
    return out


def clear_cache(root: str | None = None, *, only: str | None = None, dry_run: bool = False) -> list[CacheEntry]:
    """Remove what is under the cache directory (or only its entry ``only``, e.g. ``"sim"``);
    returns what was (or, with ``dry_run``, would be) removed. Symlinks are removed, never
    followed. Close every store using these tiers first: an open LMDB keeps its mapped file."""
    root = root or cache_dir()
    if os.path.islink(root):
        raise ConfigError(f"cache directory {root!r} is a symlink; remove what it points to yourself")
    entries = cache_entries(root)
    if only is not None:
        entries = [e for e in entries if os.path.basename(e.path) == only]
    if dry_run:
        return entries
    for entry in entries:
        if os.path.isdir(entry.path) and not os.path.islink(entry.path):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)
    return entries
