"""A remote tier's meta record: what a tier makes of the one it finds under its prefix.

Every remote tier (``redis``, and those built on :mod:`kvtier.backends.remote_tier`) keeps one
meta record per namespace under its prefix, beside the records.

Anyone who can write under kvtier's prefix on a shared server can plant a meta record, so what
the tier finds there decides how much it trusts the server, never whether the engine starts:

* With a ``mac_key`` the meta record carries a tag (the tier's MAC over the record and its key).
  A record without a valid tag is proven not to be the fleet's: it is replaced by ours. A record
  with a valid tag that names another format is the fleet's own misconfiguration, refused with
  a ``ConfigError`` as any other store refuses a meta record of another namespace.
* Without one, a record that is damaged (bad checksum, truncated) is replaced by ours; one that
  names another format or namespace may be another writer's as much as ours, so the tier
  leaves it alone and serves nothing from that server (every read a miss, every write refused),
  with a warning. So does a keyed store's record (a meta record followed by its tag): the tier
  could check none of the fleet's records, and its own would be deleted by the fleet as forged.
  A record of a meta format this build does not know is another writer's, keyed or not.
"""

from __future__ import annotations

import enum

from kvtier.backend import BlockFormat
from kvtier.errors import CorruptBlockError
from kvtier.records.codec import UnsupportedRecordError
from kvtier.records.format import RecordAuthError, RecordMac, check_meta, decode_meta, encode_meta

__all__ = ["MetaVerdict", "judge_meta", "meta_value"]

_TAG = 32
#: The MAC domain of the tag. It keeps the name it had when only the redis tier had a meta record,
#: so that keyed meta records already on servers still verify.
_DOMAIN = b"kvtier-redis-meta"


class MetaVerdict(enum.Enum):
    OURS = "ours"  #: the tier's own meta record
    REPLACE = "replace"  #: damaged, or proven foreign by its tag: write ours over it
    FOREIGN = "foreign"  #: another format or namespace, unproven: leave it, serve nothing


def meta_value(fmt: BlockFormat, mac: RecordMac | None, meta_key: bytes) -> bytes:
    """The meta record this tier writes under ``meta_key`` (tagged when keyed)."""
    body = encode_meta(fmt, mac)
    return body + mac.tag(_DOMAIN, meta_key, body) if mac is not None else body


def _keyed_meta(raw: bytes) -> str | None:
    """Why ``raw``, unreadable as an untagged meta record, is a keyed store's (a meta record and
    its tag); ``None`` if it is not one."""
    if len(raw) <= _TAG:
        return None
    try:
        meta = decode_meta(raw[:-_TAG])
    except CorruptBlockError:
        return None
    return (
        f"it is a keyed store's meta record (records keyed with {meta.mac or 'hmac-sha256'}), and this tier "
        "has no mac_key to check them; set mac_key_env (the fleet's secret)"
    )


def judge_meta(raw: bytes, fmt: BlockFormat, mac: RecordMac | None, meta_key: bytes, *, where: str) -> tuple[MetaVerdict, str]:
    """What the record ``raw`` found under ``meta_key`` is, and why (see the module doc).
    Raises ``ConfigError`` only for a keyed record with a valid tag that names another format."""
    body = raw
    if mac is not None:
        body, tag = raw[:-_TAG], raw[-_TAG:]
        if len(raw) <= _TAG:
            return MetaVerdict.REPLACE, "its MAC tag does not verify with this tier's mac_key"
        try:
            mac.verify(_DOMAIN, meta_key, body, tag)
        except RecordAuthError:
            return MetaVerdict.REPLACE, "its MAC tag does not verify with this tier's mac_key"
    try:
        meta = decode_meta(body)
    except UnsupportedRecordError as exc:  # (a CorruptBlockError too: caught first)
        return MetaVerdict.FOREIGN, str(exc)
    except CorruptBlockError as exc:
        keyed = _keyed_meta(raw) if mac is None else None
        if keyed is not None:
            return MetaVerdict.FOREIGN, keyed
        return MetaVerdict.REPLACE, str(exc)
    if mac is not None:
        check_meta(meta, fmt, where=where, mac=mac)
        return MetaVerdict.OURS, ""
    try:
        check_meta(meta, fmt, where=where)
    except ValueError as exc:  # ConfigError
        return MetaVerdict.FOREIGN, str(exc)
    return MetaVerdict.OURS, ""
