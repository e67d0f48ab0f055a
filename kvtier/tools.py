"""Offline tools over a persistent tier's directory: ``inspect`` (what is stored) and ``verify``
(does every record pass its checksum), behind ``kvtier inspect`` and ``kvtier verify``.

Both read the directory without knowing the model: the store's meta record gives the block
size, dtype, namespace and format version. Records are checked with :mod:`kvtier.record`'s
public functions only (``parse_header``, ``decode_record``), never unpickled. ``verify`` reads
nothing into the store it checks; with ``delete=True`` the bad records are then removed through
the backend's own public ``delete_blocks``, so the backend's index stays consistent.

Supported layouts: an ``lmdb`` tier (a directory holding ``data.mdb``). Other layouts raise a
:class:`~kvtier.errors.ConfigError` that says so.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier import registry
from kvtier.backend import BlockFormat
from kvtier.codec import BUILTIN_CODEC_IDS, UnsupportedRecordError
from kvtier.errors import ConfigError, CorruptBlockError
from kvtier.record import HEADER_SIZE, StoreMeta, decode_meta, decode_record, parse_header

__all__ = ["TierReport", "VerifyReport", "detect_tier", "inspect_tier", "verify_tier"]

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


def detect_tier(path: str | os.PathLike[str]) -> str:
    """The backend name whose on-disk layout ``path`` holds."""
    root = Path(path)
    if not root.exists():
        raise ConfigError(f"{root}: no such directory")
    if (root / "data.mdb").is_file():
        return "lmdb"
    raise ConfigError(f"{root}: not a kvtier tier directory this build can read (expected an lmdb tier holding data.mdb)")


class _LmdbReader:
    """Read-only view of an lmdb tier, in the layout documented in ``kvtier.backends.lmdb_tier``."""

    def __init__(self, path: Path) -> None:
        import lmdb

        from kvtier.backends import lmdb_tier

        self.path = path
        self._meta_key: bytes = getattr(lmdb_tier, "_META_KEY", b"kvtier-meta")
        try:
            self.env = lmdb.open(str(path), readonly=True, max_dbs=3, subdir=True, lock=os.access(path, os.W_OK))
            self.blocks = self.env.open_db(b"blocks", create=False)
            self.meta_db = self.env.open_db(b"meta", create=False)
        except lmdb.Error as exc:
            raise ConfigError(f"{path}: cannot open the lmdb environment read-only: {exc}") from exc

    def meta(self) -> StoreMeta | None:
        with self.env.begin(db=self.meta_db) as txn:
            raw = txn.get(self._meta_key)
        return None if raw is None else decode_meta(raw)

    def count(self) -> int:
        with self.env.begin() as txn:
            return int(txn.stat(self.blocks)["entries"])

    def map_size(self) -> int:
        return int(self.env.info()["map_size"])

    def records(self) -> Iterator[tuple[bytes, bytes]]:
        with self.env.begin(db=self.blocks) as txn:
            for key, value in txn.cursor():
                yield bytes(key), value

    def close(self) -> None:
        self.env.close()


def _open(path: str | os.PathLike[str]) -> tuple[str, _LmdbReader]:
    kind = detect_tier(path)
    return kind, _LmdbReader(Path(path))


def _codec_name(codec_id: int) -> str:
    return BUILTIN_CODEC_IDS.get(codec_id, f"id-{codec_id}")


def inspect_tier(path: str | os.PathLike[str], *, progress: Progress | None = None) -> TierReport:
    """Count blocks, bytes, codecs and versions of the tier at ``path`` (headers only)."""
    kind, reader = _open(path)
    try:
        meta = reader.meta()
        report = TierReport(
            path=str(path),
            kind=kind,
            format_version=meta.format_version if meta else None,
            block_bytes=meta.block_bytes if meta else None,
            dtype=meta.dtype if meta else None,
            namespaces=[{**meta.namespace, "digest": meta.namespace_digest.hex()}] if meta else [],
        )
        total = reader.count()
        for done, (_key, value) in enumerate(reader.records(), 1):
            report.blocks += 1
            try:
                header = parse_header(value, raw_length=meta.block_bytes if meta else 0, available=len(value))
            except CorruptBlockError:
                report.unreadable += 1
                report.stored_bytes += len(value)
                continue
            report.stored_bytes += header.record_length
            report.raw_bytes += header.raw_length
            name = _codec_name(header.codec_id)
            report.codecs[name] = report.codecs.get(name, 0) + 1
            version = str(header.version)
            report.record_versions[version] = report.record_versions.get(version, 0) + 1
            if progress is not None:
                progress(done, total)
        return report
    finally:
        reader.close()


def verify_tier(path: str | os.PathLike[str], *, delete: bool = False, progress: Progress | None = None) -> VerifyReport:
    """Check every record's header and checksum (and that it decodes); optionally delete bad ones."""
    kind, reader = _open(path)
    report = VerifyReport(path=str(path), kind=kind)
    try:
        meta = reader.meta()
        if meta is None:
            raise ConfigError(f"{path}: the tier has no meta record, so its block size is unknown")
        out = memoryview(bytearray(meta.block_bytes))
        total = reader.count()
        for done, (key, value) in enumerate(reader.records(), 1):
            report.checked += 1
            try:
                decode_record(key, value, out, available=len(value))
            except UnsupportedRecordError as exc:
                report.bad.append({"key": key.hex(), "reason": f"unsupported: {exc}"})
            except CorruptBlockError as exc:
                report.bad.append({"key": key.hex(), "reason": str(exc)})
            if progress is not None:
                progress(done, total)
        map_size = reader.map_size()
    finally:
        reader.close()
    if delete and report.bad:
        report.deleted = _delete(kind, Path(path), meta, map_size, [bytes.fromhex(b["key"]) for b in report.bad])
    return report


def _delete(kind: str, path: Path, meta: StoreMeta, capacity: int, keys: list[bytes]) -> int:
    """Remove ``keys`` through the backend's public API (it keeps its own index consistent)."""
    backend = registry.backends.get(kind)(capacity=max(capacity, HEADER_SIZE + meta.block_bytes), path=str(path))
    fmt = BlockFormat(
        block_bytes=meta.block_bytes, dtype=meta.dtype, namespace_digest=meta.namespace_digest, namespace=meta.namespace
    )

    async def run() -> int:
        await backend.open(fmt)
        try:
            before = backend.stats().get("deleted", 0)
            await backend.delete(keys)
            return int(backend.stats().get("deleted", 0) - before)
        finally:
            await backend.aclose()

    return asyncio.run(run())
