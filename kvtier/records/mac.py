"""Keyed records: optional tamper protection for stores others can write to (a shared
directory, Redis).

A :class:`RecordMac` holds a secret shared by the fleet; a backend given one writes every record
with a MAC flag set and a 32-byte tag after the header (the layout is in
:mod:`kvtier.records.format`), and refuses, as a miss, every record whose tag it cannot verify:
an unkeyed record (whatever its checksum), a record keyed with another secret, a forged one. A
store without a secret cannot check a keyed record and treats it as unsupported (a miss). The tag
covers the flags byte, so it cannot be stripped or swapped for the other algorithm's.

Three MACs (``mac_algorithm``):

* ``aes-gmac`` (the default): AES-256-GMAC (GCM with no plaintext, SP 800-38D). Each record gets
  a random 16-byte salt, stored in the tag field, and its own AES key, HMAC-SHA256(root, salt),
  where the root key is HMAC-SHA256 of the secret and a fixed context; the GCM nonce is then
  fixed, since no key is used twice (a salt collision needs about 2^64 records). GMAC runs at
  25-27 GB/s per core here (OpenSSL, VAES and VPCLMULQDQ, through ``cryptography``), next to
  28 GB/s for the XXH3 checksum of a plain record, so a keyed load costs about what a plain one
  does. Where :data:`gmac_copy` is built (``kvtier/records/_gmac.c``), a record's tag is made and
  checked by it instead, in the pass that copies the payload (:meth:`RecordMac.check_native`). Its primitives are FIPS-approved (a FIPS-validated deployment must also run
  ``cryptography`` against a validated OpenSSL).
* ``blake3``: keyed BLAKE3 (about 6 GB/s per core here; 1 MiB or more are hashed on several
  threads), its key derived from the secret (``derive_key`` mode), never the secret itself.
* ``hmac-sha256``: HMAC-SHA256 (1.4-1.8 GB/s per core), the only MAC of the first keyed stores.

A store reads the records of the MACs it accepts (:meth:`RecordMac.accepts`) with the same
secret, so a store keyed under an earlier default stays readable: ``aes-gmac`` reads all three,
``blake3`` reads BLAKE3 and HMAC-SHA256 records, ``hmac-sha256`` only its own. Anything else is
unsupported: a miss, kept for its writer. A keyed store's meta record names its algorithm, and a
tier that cannot read that algorithm's records is refused at open (``check_meta``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable
from typing import Any

import blake3
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from kvtier.errors import ConfigError, CorruptBlockError
from kvtier.records.codec import UnsupportedRecordError

try:
    from kvtier.records import _gmac  # type: ignore[attr-defined]
except ImportError:  # built without a C compiler: AES-GMAC through cryptography alone
    _gmac = None

__all__ = [
    "DEFAULT_MAC_ALGORITHM",
    "FLAG_MAC",
    "FLAG_MAC_BLAKE3",
    "FLAG_MAC_GMAC",
    "HIDDEN_SECRET",
    "MAC_ALGORITHMS",
    "MAC_FLAGS",
    "MAC_TAG_SIZE",
    "RecordAuthError",
    "RecordMac",
]

#: Flag of a record keyed with HMAC-SHA256 (the only MAC of the first keyed stores).
FLAG_MAC = 0x01
#: Flag of a record keyed with keyed BLAKE3.
FLAG_MAC_BLAKE3 = 0x02
#: Flag of a record keyed with AES-256-GMAC (a salt and a per-record key, see the module doc).
FLAG_MAC_GMAC = 0x04
#: The flag bits that name a record's MAC; exactly one is set on a keyed record.
MAC_FLAGS = FLAG_MAC | FLAG_MAC_BLAKE3 | FLAG_MAC_GMAC
#: ``mac_algorithm`` option -> the flag its records carry. The first is the default.
MAC_ALGORITHMS: dict[str, int] = {"aes-gmac": FLAG_MAC_GMAC, "blake3": FLAG_MAC_BLAKE3, "hmac-sha256": FLAG_MAC}
DEFAULT_MAC_ALGORITHM = "aes-gmac"
#: Which records a MAC reads (by flag): its own, and those of the defaults before it.
_READS: dict[int, frozenset[int]] = {
    FLAG_MAC_GMAC: frozenset({FLAG_MAC_GMAC, FLAG_MAC_BLAKE3, FLAG_MAC}),
    FLAG_MAC_BLAKE3: frozenset({FLAG_MAC_BLAKE3, FLAG_MAC}),
    FLAG_MAC: frozenset({FLAG_MAC}),
}
MAC_TAG_SIZE = 32
#: AES-GMAC: the salt that starts the tag field, and the context of its root key.
_GMAC_SALT = 16
_GMAC_CONTEXT = b"kvtier record MAC key v1 aes-256-gmac"
#: Every AES-GMAC key authenticates one record, so one fixed nonce serves them all.
_GMAC_NONCE = bytes(12)
#: ``gmac_copy(key, prefix, src, dst=None) -> bytes``: the 16-byte AES-256-GMAC tag (the fixed
#: nonce, no plaintext) of ``prefix + src`` under ``key``, copying ``src`` into ``dst`` in the
#: same pass and hashing the bytes it stores (``kvtier/records/_gmac.c``: AES-NI for the two
#: AES blocks, AVX-512 and VPCLMULQDQ for GHASH). ``None`` where the extension is not built or
#: this CPU has no path for it: AES-GMAC records are then tagged and checked through
#: ``cryptography`` alone (the general path), with the same tags. Looked up here at each use,
#: so a test can take either path.
gmac_copy: Callable[..., bytes] | None = _gmac.gmac_copy if _gmac is not None and _gmac.path != "none" else None
#: The outcomes of :meth:`RecordMac.check_copy` (``kvtier.records.xxcopy``'s ``CHECK_*``).
_CHECK_GOOD, _CHECK_SHAPE, _CHECK_HEAD, _CHECK_SUM = 0, 1, 2, 3
#: Header bytes a tag covers (``kvtier.records.record.CHECKED``).
_CHECKED = 24
#: BLAKE3's key derivation context for the record MAC key (fixed: it is part of the format).
_BLAKE3_CONTEXT = "kvtier record MAC key v1"
#: Updates of at least this many bytes are hashed by BLAKE3 on several threads.
_BLAKE3_THREADS_MIN = 1 << 20
_MIN_SECRET = 16
#: What a serialised backend shows in place of an inline secret (``from_options`` refuses it).
HIDDEN_SECRET = "<hidden>"


class RecordAuthError(CorruptBlockError):
    """A record whose MAC does not verify (forged, unkeyed, or keyed with another secret): a miss."""


class _GmacHasher:
    """AES-256-GMAC of one record under the key its salt selects; ``update``, then ``digest``:
    the salt and the 16-byte GMAC tag (the record's 32-byte tag field)."""

    __slots__ = ("_digest", "_enc", "_salt")

    def __init__(self, key: bytes, salt: bytes) -> None:
        self._salt = salt
        self._enc = Cipher(algorithms.AES(key), modes.GCM(_GMAC_NONCE)).encryptor()
        self._digest: bytes | None = None

    def update(self, data: Any) -> None:
        self._enc.authenticate_additional_data(data)  # OpenSSL, without the GIL

    def digest(self) -> bytes:
        if self._digest is None:
            self._enc.finalize()
            self._digest = self._salt + self._enc.tag
        return self._digest


class RecordMac:
    """A keyed MAC for records, with a secret shared by every writer and reader.

    ``algorithm`` is ``"aes-gmac"`` (the default), ``"blake3"`` or ``"hmac-sha256"`` (see the
    module doc); records are written with it, and read with the algorithm their flags name where
    :meth:`accepts` allows it. Build it with :meth:`from_options` (what backends do with their
    ``mac_key`` / ``mac_key_env`` / ``mac_algorithm`` options) and pass it as ``mac=`` to
    :func:`encode_record`, :func:`decode_record`, :func:`parse_header` and
    :func:`verify_payload`. The secret is never shown: ``repr`` hides it and backends serialise
    only the variable's name.
    """

    __slots__ = ("_blake3_key", "_gmac_root", "_hmac", "algorithm", "flag")

    def __init__(self, secret: bytes | str, algorithm: str = DEFAULT_MAC_ALGORITHM) -> None:
        if algorithm not in MAC_ALGORITHMS:
            raise ConfigError(f"mac_algorithm: expected one of {list(MAC_ALGORITHMS)}, got {algorithm!r}")
        key = secret.encode() if isinstance(secret, str) else bytes(secret)
        if len(key) < _MIN_SECRET:
            raise ConfigError(f"mac_key: the secret must be at least {_MIN_SECRET} bytes, got {len(key)}")
        self.algorithm = algorithm
        #: The flag of the records this MAC writes.
        self.flag = MAC_ALGORITHMS[algorithm]
        self._hmac = hmac.new(key, digestmod=hashlib.sha256)
        self._blake3_key = blake3.blake3(key, derive_key_context=_BLAKE3_CONTEXT).digest()
        root = hmac.new(key, _GMAC_CONTEXT, hashlib.sha256).digest()
        self._gmac_root = hmac.new(root, digestmod=hashlib.sha256)

    def __repr__(self) -> str:
        return f"RecordMac(algorithm={self.algorithm!r}, secret=<hidden>)"

    @classmethod
    def from_options(
        cls,
        mac_key: bytes | str | None = None,
        mac_key_env: str | None = None,
        *,
        algorithm: str = DEFAULT_MAC_ALGORITHM,
        environ: Any = None,
    ) -> RecordMac | None:
        """The MAC a backend's options ask for, or ``None`` (plain checksums).

        ``mac_key`` is the secret itself (at least 16 bytes); ``mac_key_env`` names an
        environment variable holding it. Give at most one. A variable that is unset or empty is a
        ``ConfigError`` naming it (never a silent fall back to unkeyed records)."""
        if algorithm not in MAC_ALGORITHMS:
            raise ConfigError(f"mac_algorithm: expected one of {list(MAC_ALGORITHMS)}, got {algorithm!r}")
        if mac_key is not None and mac_key_env is not None:
            raise ConfigError("mac_key: give either mac_key or mac_key_env, not both")
        if mac_key_env is not None:
            if not isinstance(mac_key_env, str) or not mac_key_env:
                raise ConfigError(f"mac_key_env: expected an environment variable name, got {mac_key_env!r}")
            value = (os.environ if environ is None else environ).get(mac_key_env)
            if not value:
                raise ConfigError(f"mac_key_env: the environment variable {mac_key_env!r} is not set (it must hold the MAC secret)")
            try:
                return cls(value, algorithm)
            except ConfigError as exc:
                raise ConfigError(f"mac_key_env: {mac_key_env!r}: {exc}") from None
        if mac_key is None:
            return None
        if mac_key == HIDDEN_SECRET:
            raise ConfigError("mac_key: secrets are not serialised; give the secret again, or use mac_key_env")
        if not isinstance(mac_key, (str, bytes)):
            raise ConfigError(f"mac_key: expected a string or bytes, got {type(mac_key).__name__}")
        return cls(mac_key, algorithm)

    def one_pass(self) -> bool:
        """Whether this MAC's own records are checked in the pass that copies them (AES-GMAC
        with the native pass, :data:`gmac_copy`): a keyed load then costs about a copy, as a
        plain one does, and a side thread has nothing to take."""
        return gmac_copy is not None and self.flag == FLAG_MAC_GMAC

    def native(self, flags: int) -> bool:
        """Whether a record with ``flags`` is checked by :meth:`check_native`: an AES-GMAC
        record, where the native pass is built."""
        return gmac_copy is not None and flags & MAC_FLAGS == FLAG_MAC_GMAC and self.accepts(flags)

    def _gmac_key(self, salt: bytes) -> bytes:
        """The AES-256 key of the record whose salt is ``salt``."""
        subkey = self._gmac_root.copy()
        subkey.update(salt)
        return subkey.digest()

    def check_native(self, head: Any, key: bytes, tag: Any, payload: Any, out: Any = None) -> None:
        """Check an AES-GMAC record (``head``: the header's first 24 bytes; ``tag``: its 32-byte
        tag field) in one native pass over ``payload``, copying it into ``out`` on the way when
        given: the bytes checked are the bytes ``out`` receives. :class:`RecordAuthError` on a
        mismatch (``out`` then holds unverified bytes: a miss). Only where :meth:`native` says
        so for the record's flags."""
        fn = gmac_copy
        if fn is None:
            raise RuntimeError("check_native: the native AES-GMAC pass is not built here")
        tag = bytes(tag)
        if len(tag) != MAC_TAG_SIZE:
            raise RecordAuthError(f"record MAC tag: expected {MAC_TAG_SIZE} bytes, got {len(tag)}")
        if not hmac.compare_digest(fn(self._gmac_key(tag[:_GMAC_SALT]), bytes(head) + key, payload, out), tag[_GMAC_SALT:]):
            raise RecordAuthError("record MAC mismatch (forged, or written with another secret)")

    def check_copy(self, head: Any, key: bytes, stored: Any, dst: Any, payload: Any = None) -> int:
        """One raw AES-GMAC record checked and copied into ``dst`` in one call, with the
        contract of :func:`~kvtier.records.xxcopy.xxh3_check_copy` (one of its ``CHECK_*``
        outcomes): ``stored`` begins with ``head`` and the 32-byte tag, and
        the payload follows in it (``len(head) + 32 + len(dst)`` bytes) or is given apart
        (``stored`` then exactly ``len(head) + 32``). ``head`` is the 24 bytes the tag covers
        and the unused checksum field (zero), as ``encode_record`` writes them. The copy and the MAC are one native pass
        (:meth:`check_native`). ``CHECK_SHAPE`` (``dst`` untouched) where the pass is not built:
        the caller's general path reads the record."""
        fn = gmac_copy
        n = len(dst)
        at = len(head)
        if payload is None:
            if fn is None or len(stored) != at + MAC_TAG_SIZE + n:
                return _CHECK_SHAPE
            payload = memoryview(stored)[at + MAC_TAG_SIZE :]
        elif fn is None or len(stored) != at + MAC_TAG_SIZE or len(payload) != n:
            return _CHECK_SHAPE
        if stored[:at] != head:
            return _CHECK_HEAD
        tag = bytes(stored[at : at + MAC_TAG_SIZE])
        got = fn(self._gmac_key(tag[:_GMAC_SALT]), head[:_CHECKED] + key, payload, dst)
        return _CHECK_GOOD if hmac.compare_digest(got, tag[_GMAC_SALT:]) else _CHECK_SUM

    def accepts(self, flags: int) -> bool:
        """Whether records with ``flags`` are checked with this MAC: those of its own algorithm,
        and those of the earlier defaults (``aes-gmac`` reads BLAKE3 and HMAC-SHA256 records,
        ``blake3`` reads HMAC-SHA256 ones)."""
        return flags & MAC_FLAGS in _READS[self.flag]

    def start(self, head: Any, key: bytes, flags: int | None = None, size: int = 0, tag: Any = None) -> Any:
        """A hasher fed with ``head`` (the header's first 24 bytes) and ``key``, for the MAC
        that ``flags`` names (this MAC's own by default); feed it the ``size``-byte payload, then
        compare its ``digest()`` with the 32-byte tag. ``tag`` is the stored tag when checking
        (an AES-GMAC tag starts with the record's salt); without it a new salt is drawn."""
        kind = self.flag if flags is None else flags & MAC_FLAGS
        if not self.accepts(kind):
            raise UnsupportedRecordError(f"record is keyed with another MAC (flags {kind}); this store uses {self.algorithm}")
        h: Any
        if kind == FLAG_MAC_GMAC:
            salt = os.urandom(_GMAC_SALT) if tag is None else bytes(memoryview(tag)[:_GMAC_SALT])
            h = _GmacHasher(self._gmac_key(salt), salt)
        elif kind == FLAG_MAC_BLAKE3:
            threads = blake3.blake3.AUTO if size >= _BLAKE3_THREADS_MIN else 1
            h = blake3.blake3(key=self._blake3_key, max_threads=threads)
        else:
            h = self._hmac.copy()
        h.update(head)
        h.update(key)
        return h

    def tag(self, head: Any, key: bytes, payload: Any) -> bytes:
        """A new 32-byte tag over ``head`` (the header's first 24 bytes), ``key`` and ``payload``."""
        fn = gmac_copy
        if fn is not None and self.flag == FLAG_MAC_GMAC:
            salt = os.urandom(_GMAC_SALT)
            return salt + fn(self._gmac_key(salt), bytes(head) + key, payload)
        h = self.start(head, key, size=memoryview(payload).nbytes)
        h.update(payload)
        return bytes(h.digest())

    def verify(self, head: Any, key: bytes, payload: Any, tag: Any) -> None:
        """Raise :class:`RecordAuthError` unless ``tag`` is a tag of these bytes under one of
        the MACs this one reads (a tag does not say which; its own is tried first)."""
        tag = bytes(tag)
        for kind in sorted(_READS[self.flag], key=lambda k: k != self.flag):
            h = self.start(head, key, kind, memoryview(payload).nbytes, tag=tag)
            h.update(payload)
            if hmac.compare_digest(bytes(h.digest()), tag):
                return
        raise RecordAuthError("record MAC mismatch (forged, or written with another secret)")
