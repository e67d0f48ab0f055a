"""Block keys and namespaces.

A block key is 32 bytes: a chained hash over the token ids of each *full* block, seeded by the
digest of a :class:`Namespace`. The namespace covers everything that changes the K/V bytes of a
block, so two engines whose bytes could differ never share a key. Encoding is canonical
(length-prefixed, little-endian ``struct``), never pickle or ``hash()``: the same tokens give the
same keys in every process, on every machine, after every restart. The golden vectors in
``tests/test_keys.py`` pin the bytes; changing them is a format break and needs a new
``format_version``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Literal

from kvtier.errors import ConfigError, InvalidKeyError

__all__ = [
    "KEY_BYTES",
    "FORMAT_VERSION",
    "Namespace",
    "block_keys",
    "fold_block_hashes",
    "check_keys",
    "exact_bytes",
]

KEY_BYTES = 32
FORMAT_VERSION = 1
HashName = Literal["sha256", "blake2b"]
_HASHES: tuple[str, ...] = ("sha256", "blake2b")


def _hasher(name: str) -> Any:
    if name == "sha256":
        return hashlib.sha256()
    if name == "blake2b":
        return hashlib.blake2b(digest_size=KEY_BYTES)
    raise ConfigError(f"namespace.hash: unknown hash {name!r}; expected one of {list(_HASHES)}")


def _put(h: Any, value: Any) -> None:
    """Feed one value with a type tag and a length prefix, so no two values encode alike."""
    if value is None:
        h.update(b"N")
    elif isinstance(value, bool):
        h.update(b"T" if value else b"F")
    elif isinstance(value, int):
        raw = value.to_bytes((value.bit_length() + 8) // 8 or 1, "little", signed=True)
        h.update(b"I" + struct.pack("<I", len(raw)) + raw)
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        h.update(b"S" + struct.pack("<I", len(raw)) + raw)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        h.update(b"B" + struct.pack("<I", len(raw)) + raw)
    else:
        raise InvalidKeyError(f"cannot encode {type(value).__name__} into a key; use int, str or bytes")


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that changes the bytes of a KV block. Two namespaces with equal fields have
    equal digests; any differing field gives a different digest.

    ``block_size`` is the engine's tokens per *engine* block (vLLM's ``block_size``, a paged
    cache's page size), whatever the number of engine blocks one offloaded block spans: a
    store with ``engine_blocks_per_block: n`` cuts keys every ``n * block_size`` tokens, and
    that ``n`` is part of the KV layout the store folds into the namespace. The connector
    checks it against its own ``block_size`` when it is built.

    ``tenant_salt`` isolates tenants that must not share cache entries; it is part of the digest
    and is never shown in ``repr`` or logs.
    """

    model_id: str
    revision: str = ""
    lora_id: str = ""
    dtype: str = "bfloat16"
    kv_quant: str = ""
    kv_layout: str = ""
    block_size: int = 16
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    config_fingerprint: str = ""
    format_version: int = FORMAT_VERSION
    hash: HashName = "sha256"
    tenant_salt: bytes | None = field(default=None, repr=False)
    _digest: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ConfigError("namespace.model_id: expected a non-empty string")
        if self.hash not in _HASHES:
            raise ConfigError(f"namespace.hash: unknown hash {self.hash!r}; expected one of {list(_HASHES)}")
        for name in ("block_size", "tp_size", "pp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"namespace.{name}: expected a positive integer, got {value!r}")
        for name, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size")):
            rank = getattr(self, name)
            if not isinstance(rank, int) or not 0 <= rank < getattr(self, size):
                raise ConfigError(f"namespace.{name}: expected 0 <= {name} < {size}, got {rank!r}")
        if self.tenant_salt is not None and not isinstance(self.tenant_salt, (bytes, str)):
            raise ConfigError("namespace.tenant_salt: expected bytes or str")
        object.__setattr__(self, "_digest", self._compute_digest())

    @property
    def digest(self) -> bytes:
        """The 32-byte seed of every key in this namespace."""
        return self._digest

    def _compute_digest(self) -> bytes:
        h = _hasher(self.hash)
        h.update(b"kvtier-namespace\x00")
        for f in fields(self):
            if f.name == "_digest":
                continue
            value = getattr(self, f.name)
            if f.name == "tenant_salt" and isinstance(value, str):
                value = value.encode("utf-8")
            _put(h, f.name)
            _put(h, value)
        return h.digest()

    def to_dict(self) -> dict[str, Any]:
        """Plain fields; the tenant salt is included only as ``True``/``False`` (never its value)."""
        data = asdict(self)
        del data["_digest"]
        data["tenant_salt"] = self.tenant_salt is not None
        return data

    def to_dict_with_secrets(self) -> dict[str, Any]:
        """All fields including the salt, for round trips through a trusted config."""
        data = asdict(self)
        del data["_digest"]
        if isinstance(self.tenant_salt, bytes):
            data["tenant_salt"] = self.tenant_salt.hex()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Namespace:
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"namespace: unknown field(s) {unknown}; known: {sorted(known)}")
        data = dict(data)
        salt = data.get("tenant_salt")
        if isinstance(salt, bool):
            raise ConfigError("namespace.tenant_salt: the salt itself is needed, not a flag")
        if isinstance(salt, str):
            try:
                data["tenant_salt"] = bytes.fromhex(salt)
            except ValueError:
                data["tenant_salt"] = salt.encode("utf-8")
        missing = sorted(f.name for f in fields(cls) if f.init and f.default is MISSING and f.name not in data)
        if missing:
            raise ConfigError(f"namespace.{missing[0]}: required setting is missing")
        return cls(**data)


#: the types and lengths of valid keys (:func:`check_keys`)
_KEY_TRAITS = frozenset((bytes, KEY_BYTES))


_BYTES_ONLY = frozenset((bytes,))


def exact_bytes(keys: Sequence[bytes]) -> bool:
    """Whether every key is exactly ``bytes``. Finding a key proves its value, not its type: an
    object of another type (a ``bytes`` subclass, one with its own ``__eq__`` and ``__hash__``)
    can compare equal to a stored key, and a call that keeps the keys it is given (pins, a
    policy's order, stamps) must never keep such an object in place of the key."""
    if len(keys) == 1 and type(keys) in (list, tuple):  # a job of one block
        return type(keys[0]) is bytes
    return _BYTES_ONLY.issuperset(map(type, keys))


def check_keys(keys: Sequence[bytes], *, what: str = "keys") -> None:
    """Raise :class:`InvalidKeyError` naming the first key that is not 32 bytes."""
    if isinstance(keys, (bytes, bytearray, str)):
        raise InvalidKeyError(f"{what}: expected a sequence of 32-byte keys, got a single {type(keys).__name__}")
    # Fast paths: one key asked directly (a third of the set's cost, for jobs of one block);
    # else in C, one set: every key is exactly ``bytes`` and of the right length (a key whose
    # length cannot be taken raises here, and the loop below names it).
    try:
        if len(keys) == 1:
            key = keys[0]
            if type(key) is bytes and len(key) == KEY_BYTES:
                return
        elif {*map(type, keys), *map(len, keys)} <= _KEY_TRAITS:
            return
    except Exception:  # whatever a bad key's __len__ raises, the loop below names the key
        pass
    for i, key in enumerate(keys):
        if type(key) is not bytes:
            raise InvalidKeyError(f"{what}[{i}]: expected bytes, got {type(key).__name__}")
        if len(key) != KEY_BYTES:
            raise InvalidKeyError(f"{what}[{i}]: expected {KEY_BYTES} bytes, got {len(key)}")


def _extras(extra: bytes | Sequence[bytes | None] | None, num_blocks: int) -> list[bytes | None]:
    if extra is None:
        return [None] * num_blocks
    if isinstance(extra, (bytes, bytearray)):
        return [bytes(extra)] * num_blocks
    extras = list(extra)
    if len(extras) < num_blocks:
        raise InvalidKeyError(f"extra: expected one entry per full block ({num_blocks}), got {len(extras)}")
    return extras[:num_blocks]


def block_keys(
    token_ids: Sequence[int],
    *,
    block_size: int,
    namespace: Namespace,
    extra: bytes | Sequence[bytes | None] | None = None,
    parent: bytes | None = None,
) -> list[bytes]:
    """One chained 32-byte key per *full* block of ``token_ids``; a partial tail gives no key.

    ``extra`` folds request-level data into the keys (a multimodal input hash, a cache salt):
    one ``bytes`` for every block, or one entry per block. ``parent`` continues a chain from a
    previously computed key, so keys can be extended incrementally as a request grows.

    ``block_size`` is the tokens per key: ``namespace.block_size`` (the engine's block) or a
    whole multiple of it (an offloaded block that spans several engine blocks).
    """
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise InvalidKeyError(f"block_size: expected a positive integer, got {block_size!r}")
    if block_size % namespace.block_size:
        # ``namespace.block_size`` is the engine's tokens per engine block, and a key covers a
        # whole number of engine blocks (``engine_blocks_per_block`` of them); keys cut at any
        # other size would be filed under a namespace that promises blocks of another shape.
        raise InvalidKeyError(
            f"block_size: {block_size} tokens per block is not a whole number of engine blocks of "
            f"namespace.block_size {namespace.block_size} tokens; pass the namespace built for the engine's block size"
        )
    num_blocks = len(token_ids) // block_size
    extras = _extras(extra, num_blocks)
    prev = namespace.digest if parent is None else parent
    if len(prev) != KEY_BYTES:
        raise InvalidKeyError(f"parent: expected {KEY_BYTES} bytes, got {len(prev)}")
    pack = struct.Struct(f"<{block_size}I").pack
    keys: list[bytes] = []
    for i in range(num_blocks):
        chunk = token_ids[i * block_size : (i + 1) * block_size]
        try:
            payload = pack(*chunk)
        except struct.error as exc:
            raise InvalidKeyError(
                f"token_ids[{i * block_size}:{(i + 1) * block_size}]: token ids must be integers in [0, 2**32)"
            ) from exc
        h = _hasher(namespace.hash)
        h.update(b"kvtier-block\x00")
        h.update(prev)
        ex = extras[i]
        h.update(b"\x00" if ex is None else b"\x01" + struct.pack("<I", len(ex)) + ex)
        h.update(payload)
        prev = h.digest()
        keys.append(prev)
    return keys


def fold_block_hashes(hashes: Iterable[int | bytes], *, namespace: Namespace) -> list[bytes]:
    """Turn block hashes an engine already computes (ints or bytes, already chained over the
    prefix) into kvtier keys by folding each one with the namespace digest."""
    seed = namespace.digest
    keys: list[bytes] = []
    for i, value in enumerate(hashes):
        if isinstance(value, bool) or not isinstance(value, (int, bytes)):
            raise InvalidKeyError(f"hashes[{i}]: expected int or bytes, got {type(value).__name__}")
        h = _hasher(namespace.hash)
        h.update(b"kvtier-fold\x00")
        h.update(seed)
        _put(h, value)
        keys.append(h.digest())
    return keys
