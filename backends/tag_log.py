"""Tenant tags and pins of a tier that lives in a directory (``lmdb``, ``file``).

The tenant of each block and the blocks pinned in the tier are kept in ``kvtier-tags.log`` in
the tier's directory, one line per change, appended as the store saves them (at each pin, unpin
or delete, and at close) and rewritten whole at open (the entries of records that are gone
dropped). A line is ``T <key> <tenant>`` (the block's tenant, its UTF-8 in hex), ``P <key>``
(pinned) or ``U <key>`` (unpinned), keys in hex. A torn or unreadable line (a crash in the
middle of an append) is skipped: a block it named is then the default tenant's, or unpinned.
The file is opened with ``O_NOFOLLOW``, so a symlink in its place is never followed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence

__all__ = ["TAG_LOG_NAME", "DirectoryTags", "read_tag_log", "write_tag_log"]

log = logging.getLogger("kvtier")

TAG_LOG_NAME = "kvtier-tags.log"
_KEY_HEX = 64


def read_tag_log(path: str) -> tuple[dict[bytes, str], list[bytes]]:
    """(tenant of each tagged key, pinned keys in pin order) replayed from ``path``; empty
    when there is no file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return {}, []
    with os.fdopen(fd, "rb") as f:
        data = f.read()
    tenants: dict[bytes, str] = {}
    pins: dict[bytes, None] = {}
    bad = 0
    for raw in data.split(b"\n"):
        if not raw:
            continue
        try:
            parts = raw.decode("ascii").split(" ")
            if len(parts[1]) != _KEY_HEX:
                raise ValueError("key")
            key = bytes.fromhex(parts[1])
            if parts[0] == "T" and len(parts) == 3:
                tenants[key] = bytes.fromhex(parts[2]).decode("utf-8")
            elif parts[0] == "P" and len(parts) == 2:
                pins[key] = None
            elif parts[0] == "U" and len(parts) == 2:
                pins.pop(key, None)
            else:
                raise ValueError("kind")
        except (ValueError, IndexError, UnicodeDecodeError):
            bad += 1
    if bad:
        log.warning("kvtier: %d unreadable lines in %s skipped (their blocks are untagged or unpinned)", bad, path)
    return tenants, list(pins)


def _lines(tenants: Iterable[tuple[bytes, str]], pins: Iterable[tuple[bytes, bool]]) -> bytes:
    out = [f"T {key.hex()} {tenant.encode('utf-8').hex()}\n" for key, tenant in tenants]
    out += [f"{'P' if on else 'U'} {key.hex()}\n" for key, on in pins]
    return "".join(out).encode("ascii")


def write_tag_log(
    path: str,
    tenants: Iterable[tuple[bytes, str]],
    pins: Iterable[tuple[bytes, bool]],
    *,
    whole: bool = False,
    sync: bool = True,
    still_open: Callable[[], bool] | None = None,
) -> bool:
    """Append the changes to ``path`` or, with ``whole``, replace it (atomically) by them. With
    ``still_open``, asked once the file is opened and again before the replace: ``False`` writes
    nothing further (the path may lead to a store opened there since). ``True`` when written."""
    data = _lines(tenants, pins)
    if not data and not whole:
        return True
    target = path + ".tmp" if whole else path
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_TRUNC if whole else os.O_APPEND)
    fd = os.open(target, flags, 0o600)
    try:
        if still_open is not None and not still_open():
            return False
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    if whole:
        if still_open is not None and not still_open():
            return False  # (the temporary file is left: a store's open rewrites its log whole over its own)
        os.replace(target, path)
    return True


class DirectoryTags:
    """``read_tags``/``write_tags`` of the backend protocol for a tier whose ``path`` is its
    directory."""

    path: str
    sync_mode: str
    _closed: bool

    def _tag_log(self) -> str:
        return os.path.join(self.path, TAG_LOG_NAME)

    def read_tags(self) -> tuple[dict[bytes, str], list[bytes]] | None:
        return read_tag_log(self._tag_log())

    def write_tags(
        self, tenants: Sequence[tuple[bytes, str]], pins: Sequence[tuple[bytes, bool]], *, whole: bool = False, sync: bool = True
    ) -> None:
        """Once the tier's close has begun (asked before, once the log is opened and before a
        replace), nothing is written: the path may lead to a store opened there since."""
        if self._closed:
            return
        try:
            if not write_tag_log(
                self._tag_log(), tenants, pins, whole=whole, sync=sync and self.sync_mode == "durable", still_open=lambda: not self._closed
            ):
                log.warning("kvtier: tenant tags of %s not saved: the tier was closed meanwhile", self.path)
        except OSError as exc:  # tags are bookkeeping: a tier that cannot keep them still serves blocks
            log.warning("kvtier: tenant tags of %s not saved: %s", self.path, exc)
