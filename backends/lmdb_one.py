"""One raw record of an ``lmdb`` tier's split layout copied into its row and checked, record by
record (:func:`copy_plain`, :func:`copy_keyed`): the loop of
:meth:`kvtier.backends.lmdb_layout.JobReader.read_in_one_pass` for what the tight pass of
:mod:`kvtier.backends.lmdb_plain` does not take (keyed records, rows that are not views)."""

from __future__ import annotations

from typing import Any

import torch
from kvtier.backends.lmdb_entries import INDEX

from kvtier import devices
from kvtier.errors import CorruptBlockError
from kvtier.records.codec import NoneCodec
from kvtier.records.format import (
    HEAD_MAX,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    RECORD_VERSION,
    RecordMac,
    parse_header,
    record_checksum,
    verify_payload,
)
from kvtier.records.record import CHECKED

__all__ = ["copy_keyed", "copy_plain"]

_PLAIN_ENTRY = INDEX.size + HEADER_SIZE  # a split, unkeyed record's index entry
_KEYED_ENTRY = INDEX.size + HEAD_MAX  # a split, keyed record's index entry


def copy_plain(key: bytes, pair: tuple[Any, Any], row: torch.Tensor, size: int) -> bool:
    """Copy a plain raw record of ``size`` bytes into ``row`` (host memory) and check it;
    ``False`` (``row`` perhaps written) when it is anything else or its check fails."""
    entry, value = pair
    if len(entry) != _PLAIN_ENTRY or len(value) != size:
        return False
    magic, version, codec_id, _, flags, raw, stored, checksum = HEADER.unpack_from(entry, INDEX.size)
    if magic != MAGIC or version != RECORD_VERSION or codec_id != NoneCodec.codec_id or flags or raw != size or stored != size:
        return False
    if devices.locate is not None or not row.is_cpu or not row.is_contiguous():
        return False
    view = row.numpy().data
    view[:] = value
    # The row just written, while it is in the CPU's cache: what the caller gets is checked.
    return record_checksum(entry[INDEX.size : INDEX.size + CHECKED], key, view) == checksum


def copy_keyed(key: bytes, pair: tuple[Any, Any], row: torch.Tensor, size: int, mac: RecordMac) -> bool:
    """:func:`copy_plain` for a keyed raw record: the row's MAC is checked (a MAC guards
    against tampering: the bytes the caller gets are the ones checked)."""
    entry, value = pair
    if len(entry) != _KEYED_ENTRY or len(value) != size:
        return False
    if devices.locate is not None or not row.is_cpu or not row.is_contiguous():
        return False
    head = entry[INDEX.size :]
    try:
        header = parse_header(head, raw_length=size, available=len(head) + size, mac=mac)
        if header.codec_id != NoneCodec.codec_id:
            return False
        view = row.numpy().data
        view[:] = value
        verify_payload(key, head, header, view, mac=mac)
    except CorruptBlockError:
        return False
    return True
