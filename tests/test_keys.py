"""Block keys and namespaces: golden vectors, determinism, validation."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from kvtier.errors import ConfigError, InvalidKeyError
from kvtier.keys import KEY_BYTES, Namespace, block_keys, check_keys, fold_block_hashes

# Golden vectors. These hex strings pin the on-disk key format: persistent tiers are indexed by
# these bytes, so if one of them changes, every block stored by an earlier version becomes
# unreachable. Changing them is a format break: bump ``FORMAT_VERSION`` and update them together,
# never just to make this test pass.
GOLDEN_NAMESPACE = {"model_id": "golden/model", "revision": "r1", "block_size": 4}
GOLDEN_TOKENS = list(range(10))  # two full blocks of 4 and a partial tail of 2
GOLDEN = {
    "sha256": {
        "digest": "bf1e58dcb401cac62a1f06627902f42c2a96ad5116c9a10dd1be5002c56695ea",
        "keys": [
            "f8c9c25e77d5cb474a25cde2e2a4bdd71904555e9e3428bc7875685abf498242",
            "43d8f3a03a247a0d4ab9faa9ab3edcf8197cddbb4487a89f3f35a472296ad02c",
        ],
        "folded": [
            "9f492b64e79e3592893ff93d76302ea49ba0797e0e6887318c3bbfb881b2f94e",
            "760e00fa41bcc7c34913a63c560a09ad937d7fab61dac2817095e591bb529ec8",
        ],
    },
    "blake2b": {
        "digest": "e774ee1213989aa620d49843657f4f5826aea1cfe2d6498841d66745894b79da",
        "keys": [
            "b63ef3464e04749d5d707e3e998505fca58b7f111c11dac0580db65fccb6115b",
            "648bb16689ec7bb20bd23c7bb75cad16f57c42c94fa55b476aa04593fefd3d93",
        ],
        "folded": [
            "4d0abb27a644d465d1d2311d9fbf9f23d8702ef314e5c4066894833431b7b5d2",
            "549b9c5528208203dbb179387713de9906550b35f906b5396c97190082b7e1dd",
        ],
    },
}
GOLDEN_HASHES: list[int | bytes] = [12345, b"\x01" * 8]


def ns(**overrides: object) -> Namespace:
    return Namespace(**{**GOLDEN_NAMESPACE, **overrides})  # type: ignore[arg-type]


@pytest.mark.parametrize("hash_name", ["sha256", "blake2b"])
def test_golden_vectors(hash_name: str) -> None:
    space = ns(hash=hash_name)
    want = GOLDEN[hash_name]
    assert space.digest.hex() == want["digest"]
    assert [k.hex() for k in block_keys(GOLDEN_TOKENS, block_size=4, namespace=space)] == want["keys"]
    assert [k.hex() for k in fold_block_hashes(GOLDEN_HASHES, namespace=space)] == want["folded"]


def test_hashes_give_different_keys() -> None:
    a = block_keys(GOLDEN_TOKENS, block_size=4, namespace=ns(hash="sha256"))
    b = block_keys(GOLDEN_TOKENS, block_size=4, namespace=ns(hash="blake2b"))
    assert len(a) == len(b) == 2
    assert not set(a) & set(b)
    assert all(len(k) == KEY_BYTES for k in a + b)


_CHILD = """
import sys
from kvtier.keys import Namespace, block_keys, fold_block_hashes
space = Namespace(model_id="golden/model", revision="r1", block_size=4, hash=sys.argv[1])
keys = block_keys(list(range(10)), block_size=4, namespace=space)
keys += fold_block_hashes([12345, b"\\x01" * 8], namespace=space)
print(space.digest.hex(), *[k.hex() for k in keys])
"""


@pytest.mark.parametrize("hash_name", ["sha256", "blake2b"])
def test_keys_equal_across_processes(hash_name: str) -> None:
    space = ns(hash=hash_name)
    here = [space.digest.hex()]
    here += [k.hex() for k in block_keys(GOLDEN_TOKENS, block_size=4, namespace=space)]
    here += [k.hex() for k in fold_block_hashes(GOLDEN_HASHES, namespace=space)]
    seeds = {os.environ.get("PYTHONHASHSEED"), "0"}
    seed = next(s for s in ("12345", "987654321") if s not in seeds)
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, hash_name], env=env, capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.split() == here


def test_partial_tail_gives_no_key() -> None:
    space = ns()
    assert block_keys([1, 2, 3], block_size=4, namespace=space) == []
    full = block_keys(list(range(8)), block_size=4, namespace=space)
    assert block_keys(list(range(11)), block_size=4, namespace=space) == full
    assert len(block_keys(list(range(12)), block_size=4, namespace=space)) == 3


_FIELD_CHANGES = {
    "model_id": "other/model",
    "revision": "r2",
    "lora_id": "adapter-a",
    "dtype": "float16",
    "kv_quant": "fp8",
    "kv_layout": "fused",
    "block_size": 8,
    "tp_rank": 1,
    "tp_size": 2,
    "pp_rank": 1,
    "pp_size": 2,
    "config_fingerprint": "rope=yarn",
    "format_version": 2,
    "hash": "blake2b",
    "tenant_salt": b"tenant-a",
}


def test_every_namespace_field_changes_the_digest() -> None:
    init_fields = [f.name for f in dataclasses.fields(Namespace) if f.init]
    assert sorted(init_fields) == sorted(_FIELD_CHANGES), "a new Namespace field needs a case here"
    base = Namespace(model_id="m", tp_size=4, pp_size=4)
    digests = {base.digest}
    for name, value in _FIELD_CHANGES.items():
        changed = dataclasses.replace(base, **{name: value})
        assert changed.digest != base.digest, name
        digests.add(changed.digest)
    assert len(digests) == len(_FIELD_CHANGES) + 1


def test_equal_namespaces_have_equal_digests() -> None:
    assert ns().digest == ns().digest
    assert ns(tenant_salt=b"x").digest == ns(tenant_salt="x").digest
    assert ns(tenant_salt=b"x").digest != ns(tenant_salt=b"y").digest


def test_tenant_salt_is_never_shown() -> None:
    secret = "s3cr3t-salt-value"
    for salt in (secret, secret.encode()):
        space = ns(tenant_salt=salt)
        shown = repr(space) + str(space) + repr(space.to_dict()) + str(space.to_dict())
        assert secret not in shown
        assert secret.encode().hex() not in shown
        assert space.to_dict()["tenant_salt"] is True
    assert ns().to_dict()["tenant_salt"] is False


def test_from_dict_round_trip() -> None:
    space = ns(lora_id="a", tp_rank=1, tp_size=2, hash="blake2b", tenant_salt=b"\x00\xffsalt")
    again = Namespace.from_dict(space.to_dict_with_secrets())
    assert again == space and again.digest == space.digest
    plain = ns(lora_id="b")
    data = plain.to_dict()
    del data["tenant_salt"]
    assert Namespace.from_dict(data).digest == plain.digest


def test_from_dict_rejects_unknown_fields_and_salt_flags() -> None:
    with pytest.raises(ConfigError, match="colour"):
        Namespace.from_dict({"model_id": "m", "colour": "red"})
    with pytest.raises(ConfigError, match="tenant_salt"):
        Namespace.from_dict(ns(tenant_salt=b"x").to_dict())


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"model_id": ""}, "model_id"),
        ({"model_id": "m", "block_size": 0}, "block_size"),
        ({"model_id": "m", "tp_rank": 2, "tp_size": 2}, "tp_rank"),
        ({"model_id": "m", "hash": "md5"}, "hash"),
    ],
)
def test_bad_namespace_fields(fields: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Namespace(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("hash_name", ["sha256", "blake2b"])
def test_fold_block_hashes(hash_name: str) -> None:
    space = ns(hash=hash_name)
    ints = fold_block_hashes([1, 2, 2**70, -5], namespace=space)
    assert len(ints) == 4 and len(set(ints)) == 4
    assert all(len(k) == KEY_BYTES for k in ints)
    assert fold_block_hashes([1, 2], namespace=space) == ints[:2]
    # An int and the bytes of the same value are different inputs and give different keys.
    assert fold_block_hashes([b"\x01"], namespace=space) != fold_block_hashes([1], namespace=space)
    assert fold_block_hashes([1], namespace=ns(hash=hash_name, lora_id="x")) != ints[:1]
    with pytest.raises(InvalidKeyError, match=r"hashes\[1\]"):
        fold_block_hashes([1, "2"], namespace=space)  # type: ignore[list-item]
    with pytest.raises(InvalidKeyError, match=r"hashes\[0\]"):
        fold_block_hashes([True], namespace=space)


def test_parent_continuation_equals_one_shot() -> None:
    space = ns()
    tokens = list(range(100, 124))
    whole = block_keys(tokens, block_size=4, namespace=space)
    head = block_keys(tokens[:8], block_size=4, namespace=space)
    tail = block_keys(tokens[8:], block_size=4, namespace=space, parent=head[-1])
    assert head + tail == whole
    assert block_keys(tokens[8:], block_size=4, namespace=space) != tail


def test_extra_changes_keys_per_block() -> None:
    space = ns()
    tokens = list(range(8))
    plain = block_keys(tokens, block_size=4, namespace=space)
    salted = block_keys(tokens, block_size=4, namespace=space, extra=b"image-hash")
    per_block = block_keys(tokens, block_size=4, namespace=space, extra=[None, b"image-hash"])
    assert salted[0] != plain[0] and salted[1] != plain[1]
    assert per_block[0] == plain[0] and per_block[1] != plain[1]
    with pytest.raises(InvalidKeyError, match="extra"):
        block_keys(tokens, block_size=4, namespace=space, extra=[b"x"])


def test_chaining_makes_keys_depend_on_the_prefix() -> None:
    space = ns()
    a = block_keys([1, 2, 3, 4, 5, 6, 7, 8], block_size=4, namespace=space)
    b = block_keys([9, 2, 3, 4, 5, 6, 7, 8], block_size=4, namespace=space)
    assert a[0] != b[0] and a[1] != b[1]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"token_ids": [0, 1, 2, 2**32]}, "token_ids"),
        ({"token_ids": [0, -1, 2, 3]}, "token_ids"),
        ({"token_ids": [0, 1, 2, 3], "block_size": 0}, "block_size"),
        ({"token_ids": [0, 1, 2, 3], "block_size": -4}, "block_size"),
        ({"token_ids": [0, 1, 2, 3], "parent": b"\x00" * 31}, "parent"),
        ({"token_ids": [0, 1, 2, 3], "block_size": True}, "block_size"),
        # The namespace was built for engine blocks of 4 tokens: keys cut at 6 or 2 would be wrong.
        ({"token_ids": list(range(16)), "block_size": 6}, r"block_size: 6 .*namespace.block_size 4"),
        ({"token_ids": list(range(16)), "block_size": 2}, r"namespace.block_size 4"),
    ],
)
def test_bad_inputs_raise_invalid_key_error(kwargs: dict[str, object], match: str) -> None:
    args = {"block_size": 4, "namespace": ns(), **kwargs}
    with pytest.raises(InvalidKeyError, match=match):
        block_keys(**args)  # type: ignore[arg-type]
    assert issubclass(InvalidKeyError, ValueError)


def test_a_key_may_span_several_engine_blocks_of_the_namespace() -> None:
    """``namespace.block_size`` is the engine's block: keys of two engine blocks are accepted,
    cut every 8 tokens, and differ from keys cut every 4."""
    two = block_keys(list(range(16)), block_size=8, namespace=ns())
    one = block_keys(list(range(16)), block_size=4, namespace=ns())
    assert len(two) == 2 and len(one) == 4
    assert not set(two) & set(one)


def test_check_keys() -> None:
    good = [b"\x00" * 32, b"\x01" * 32]
    check_keys(good)
    with pytest.raises(InvalidKeyError, match=r"keys\[1\].*31"):
        check_keys([good[0], b"\x00" * 31])
    with pytest.raises(InvalidKeyError, match=r"keys\[0\].*str"):
        check_keys(["x" * 32])  # type: ignore[list-item]
    with pytest.raises(InvalidKeyError, match="single"):
        check_keys(b"\x00" * 32)


class _LenRaises:
    def __len__(self) -> int:
        raise ValueError("no length")


class _BytesSub(bytes):
    pass


@pytest.mark.parametrize(
    ("keys", "match"),
    [
        ([b"\x00" * 32, _LenRaises()], r"keys\[1\]: expected bytes, got _LenRaises"),
        ([b"\x00" * 32, 5], r"keys\[1\]: expected bytes, got int"),
        ([b"\x00" * 33, b"\x00" * 32], r"keys\[0\]: expected 32 bytes, got 33"),
        ([b"\x00" * 32, _BytesSub(b"\x00" * 32)], r"keys\[1\]: expected bytes, got _BytesSub"),
        ([b"\x00" * 32, bytearray(32)], r"keys\[1\]: expected bytes, got bytearray"),
        ([b"\x00" * 31, "x" * 32], r"keys\[0\]: expected 32 bytes, got 31"),
    ],
)
def test_check_keys_names_the_first_bad_key_whatever_it_is(keys: list[object], match: str) -> None:
    """The fast check (one set of types and lengths) lets through exactly the lists of 32-byte
    ``bytes``; anything else, even a key whose length raises, is named by the loop."""
    with pytest.raises(InvalidKeyError, match=match):
        check_keys(keys)  # type: ignore[arg-type]
    check_keys([b"\x00" * 32] * 3)
    check_keys([])


@pytest.mark.parametrize(
    ("key", "match"),
    [
        (_LenRaises(), r"keys\[0\]: expected bytes, got _LenRaises"),
        (5, r"keys\[0\]: expected bytes, got int"),
        (b"\x00" * 33, r"keys\[0\]: expected 32 bytes, got 33"),
        (b"\x00" * 31, r"keys\[0\]: expected 32 bytes, got 31"),
        (_BytesSub(b"\x00" * 32), r"keys\[0\]: expected bytes, got _BytesSub"),
        (bytearray(32), r"keys\[0\]: expected bytes, got bytearray"),
        ("x" * 32, r"keys\[0\]: expected bytes, got str"),
    ],
)
def test_a_one_key_job_is_checked_as_a_longer_one_is(key: object, match: str) -> None:
    """The one-key fast path lets through exactly a 32-byte ``bytes``, as the set does for a
    longer list: the same key refused alone and beside a good one, and by the same message."""
    with pytest.raises(InvalidKeyError, match=match):
        check_keys([key])  # type: ignore[list-item]
    with pytest.raises(InvalidKeyError, match=match.replace("0", "1", 1)):
        check_keys([b"\x00" * 32, key])  # type: ignore[list-item]
    check_keys([b"\x00" * 32])
    check_keys((b"\x01" * 32,))
