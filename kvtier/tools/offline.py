"""Offline tools over a persistent tier's directory: ``inspect`` (what is stored) and ``verify``
(does every record pass its checksum), behind ``kvtier inspect`` and ``kvtier verify``.

Both read the directory without knowing the model: the store's meta record gives the block
size, dtype, namespace and format version. Records are checked with :mod:`kvtier.records.format`'s
public functions only (``parse_header``, ``decode_record``), never unpickled.

Supported layouts, detected in this order:

* ``lmdb``: a directory holding ``data.mdb``;
* ``file``: a directory holding the file tier's meta record ``kvtier-meta.kvm``.

Any other directory raises a :class:`~kvtier.errors.ConfigError` that says so, and nothing is
created in it. The tools use only the backends' public offline classmethods (``is_store_dir``,
``read_store_meta``, ``count_raw_records``, ``iter_raw_records``, ``delete_raw_records``); the
reading ones open nothing for writing and create no file. ``verify`` writes only with
``delete=True``, and then removes exactly the bad records (for lmdb with their index entries, in
one transaction) through ``delete_raw_records``. That is used rather than opening the backend
normally, which would need a capacity and has side effects of its own at open (the file tier
sweeps stale temp files, the lmdb tier moves an environment it cannot read aside).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier import registry
from kvtier.backends.tag_log import TAG_LOG_NAME, read_tag_log
from kvtier.errors import ConfigError, CorruptBlockError
from kvtier.manager.tenants import DEFAULT_TENANT
from kvtier.records.codec import BUILTIN_CODEC_IDS, UnsupportedRecordError
from kvtier.records.format import RecordMac, StoreMeta, decode_record, parse_header

__all__ = ["TierReport", "VerifyReport", "detect_tier", "find_tiers", "inspect_tier", "verify_tier"]

#: ``progress(done, total)`` is called while records are read.
Progress = Callable[[int, int], None]


@dataclass(slots=True)
class TierReport:
    path: str
    kind: str
    format_version: int | None
    block_bytes: int | None
    dtype: str | None
    namespaces: list[dict[str, Any]]
    blocks: int = 0
    stored_bytes: int = 0
    raw_bytes: int = 0
    unreadable: int = 0
    codecs: dict[str, int] = field(default_factory=dict)
    record_versions: dict[str, int] = field(default_factory=dict)
    #: blocks, stored bytes and pinned blocks per tenant (from the tier's saved tenant tags)
    tenants: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def codec_ratio(self) -> float | None:
        """Raw bytes per stored byte (headers included); above 1 means compression pays."""
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["codec_ratio"] = self.codec_ratio
        return data


@dataclass(slots=True)
class VerifyReport:
    path: str
    kind: str
    checked: int = 0
    bad: list[dict[str, str]] = field(default_factory=list)
    deleted: int = 0

    @property
    def ok(self) -> bool:
        return not self.bad

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        return data


#: Backend names whose layouts the tools read, in detection order, with what marks each.
TIER_KINDS: dict[str, str] = {"lmdb": "an lmdb tier holding data.mdb", "file": "a file tier holding kvtier-meta.kvm"}


def _backend_class(kind: str) -> Any:
    """The registered backend class for ``kind``, if it offers the offline classmethods."""
    if kind not in registry.backends:
        return None
    cls = registry.backends.get(kind)
    return cls if callable(getattr(cls, "is_store_dir", None)) else None


def detect_tier(path: str | os.PathLike[str]) -> str:
    """The backend name whose on-disk layout ``path`` holds (``"lmdb"`` or ``"file"``)."""
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"{root}: no such directory")
    for kind in TIER_KINDS:
        cls = _backend_class(kind)
        if cls is not None and cls.is_store_dir(root):
            return kind
    expected = " or ".join(TIER_KINDS.values())
    raise ConfigError(f"{root}: not a kvtier tier directory this build can read (expected {expected})")


def find_tiers(path: str | os.PathLike[str], *, depth: int = 2) -> list[Path]:
    """The tier directories at ``path``: ``[path]`` when it is one, else those in its subfolders
    (``depth`` levels down), sorted: what an engine integration makes of a configured ``path``
    (vLLM: ``r<rank>-of-<world>``, ``…-g<group>``; SGLang: ``<layout>-tp<r>of<n>``). A
    ConfigError that says where it looked when there is none."""
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"{root}: no such directory")
    kinds = [cls for cls in (_backend_class(k) for k in TIER_KINDS) if cls is not None]

    def is_tier(folder: Path) -> bool:
        return any(cls.is_store_dir(folder) for cls in kinds)

    if is_tier(root):
        return [root]
    found: list[Path] = []
    level = [root]
    for _ in range(depth):
        level = sorted(d for parent in level for d in parent.iterdir() if d.is_dir() and not d.is_symlink())
        found += [d for d in level if is_tier(d)]
        level = [d for d in level if not is_tier(d)]
    if not found:
        expected = " or ".join(TIER_KINDS.values())
        raise ConfigError(
            f"{root}: not a kvtier tier directory this build can read (expected {expected}), and none of its "
            f"subfolders {depth} levels down is one (the vLLM integration keeps each rank's tier in "
            f"<path>/r<rank>-of-<world>, SGLang's in <path>/<layout>-tp<rank>of<size>)"
        )
    return found


def _open(path: str | os.PathLike[str]) -> tuple[str, Any, StoreMeta | None]:
    """The tier's kind, its backend class and its meta record (``None`` if it has none)."""
    kind = detect_tier(path)
    cls = _backend_class(kind)
    meta: StoreMeta | None = cls.read_store_meta(path)
    return kind, cls, meta


def _codec_name(codec_id: int) -> str:
    return BUILTIN_CODEC_IDS.get(codec_id, f"id-{codec_id}")


def inspect_tier(path: str | os.PathLike[str], *, progress: Progress | None = None) -> TierReport:
    """Count blocks, bytes, codecs and versions of the tier at ``path`` (headers only)."""
    kind, cls, meta = _open(path)
    report = TierReport(
        path=str(path),
        kind=kind,
        format_version=meta.format_version if meta else None,
        block_bytes=meta.block_bytes if meta else None,
        dtype=meta.dtype if meta else None,
        namespaces=[{**meta.namespace, "digest": meta.namespace_digest.hex()}] if meta else [],
    )
    total = cls.count_raw_records(path) if progress is not None else 0
    owners, pinned = read_tag_log(os.path.join(path, TAG_LOG_NAME))
    pins = set(pinned)
    for done, (key, value) in enumerate(cls.iter_raw_records(path), 1):
        report.blocks += 1
        usage = report.tenants.setdefault(owners.get(key, DEFAULT_TENANT), {"blocks": 0, "bytes": 0, "pinned": 0})
        usage["blocks"] += 1
        usage["bytes"] += len(value)
        usage["pinned"] += key in pins
        try:
            header = parse_header(value, raw_length=meta.block_bytes if meta else 0, available=len(value), any_keying=True)
        except CorruptBlockError:
            report.unreadable += 1
            report.stored_bytes += len(value)
        else:
            report.stored_bytes += header.record_length
            report.raw_bytes += header.raw_length
            name = _codec_name(header.codec_id)
            report.codecs[name] = report.codecs.get(name, 0) + 1
            version = str(header.version)
            report.record_versions[version] = report.record_versions.get(version, 0) + 1
        if progress is not None:
            progress(done, max(total, done))
    return report


def verify_tier(
    path: str | os.PathLike[str],
    *,
    delete: bool = False,
    progress: Progress | None = None,
    mac: RecordMac | None = None,
) -> VerifyReport:
    """Check every record's header and checksum (and that it decodes); optionally delete bad ones.

    With ``mac`` (the tier's keyed MAC), records are checked against it and unkeyed or forged
    ones are bad; without it, keyed records are reported as unsupported (they cannot be checked).
    ``delete`` removes the records found damaged; an unsupported one (another format, codec or
    MAC, or keyed where no ``mac`` is given) is reported and kept, for a reader that can check it."""
    kind, cls, meta = _open(path)
    if meta is None:
        raise ConfigError(f"{path}: the tier has no meta record, so its block size is unknown")
    report = VerifyReport(path=str(path), kind=kind)
    out = memoryview(bytearray(meta.block_bytes))
    total = cls.count_raw_records(path) if progress is not None else 0
    damaged: list[bytes] = []
    for done, (key, value) in enumerate(cls.iter_raw_records(path), 1):
        report.checked += 1
        try:
            decode_record(key, value, out, available=len(value), mac=mac)
        except UnsupportedRecordError as exc:
            report.bad.append({"key": key.hex(), "reason": f"unsupported: {exc}"})
        except CorruptBlockError as exc:
            report.bad.append({"key": key.hex(), "reason": str(exc)})
            damaged.append(key)
        if progress is not None:
            progress(done, max(total, done))
    if delete and damaged:
        report.deleted = int(cls.delete_raw_records(path, damaged))
    return report
