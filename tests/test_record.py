"""The record format: golden bytes, header checks before allocation, bombs, versions, meta."""

from __future__ import annotations

import struct
import tracemalloc

import pytest
import torch
import zstandard

from kvtier.backend import BlockFormat
from kvtier.errors import ConfigError, CorruptBlockError
from kvtier.records.codec import NoneCodec, UnsupportedRecordError, resolve_codec
from kvtier.records.format import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    RECORD_VERSION,
    check_meta,
    decode_meta,
    decode_record,
    dtype_code,
    encode_meta,
    encode_record,
    parse_header,
    record_checksum,
)

KEY = bytes(range(32))
GOLDEN_RECORD = bytes.fromhex(
    "4b5654420100010010000000000000001000000000000000850900d371df32ef"
    "6b76746965722d676f6c64656e2d3136"
)
GOLDEN_META = bytes.fromhex(
    "4b56544d01f123ea7a85ae666f726d61745f76657273696f6e01ab626c6f636b5f627974657310a56474797065a862"
    "666c6f61743136b06e616d6573706163655f646967657374c420000102030405060708090a0b0c0d0e0f1011121314"
    "15161718191a1b1c1d1e1fa96e616d65737061636581a86d6f64656c5f6964a16d"
)
GOLDEN_FMT = BlockFormat(block_bytes=16, dtype="bfloat16", namespace_digest=KEY, namespace={"model_id": "m"})


def _record(key: bytes, raw: bytes, codec: object = None, dtype: str = "bfloat16") -> bytes:
    header, payload = encode_record(key, memoryview(raw), resolve_codec(codec), dtype_code(dtype))  # type: ignore[arg-type]
    return header + bytes(payload)


def _forge(key: bytes, codec_id: int, raw_length: int, payload: bytes, version: int = RECORD_VERSION) -> bytes:
    """A record with a valid checksum and whatever header fields an attacker likes."""
    head = HEADER.pack(MAGIC, version, codec_id, 1, 0, raw_length, len(payload), 0)[:24]
    return head + struct.pack("<Q", record_checksum(head, key, payload)) + payload


def test_golden_record_bytes() -> None:
    assert HEADER_SIZE == 32
    assert _record(KEY, b"kvtier-golden-16") == GOLDEN_RECORD
    out = bytearray(16)
    header = decode_record(KEY, GOLDEN_RECORD, memoryview(out))
    assert bytes(out) == b"kvtier-golden-16"
    assert (header.codec_id, header.dtype_code, header.raw_length, header.stored_length) == (0, 1, 16, 16)


def test_golden_meta_bytes() -> None:
    assert encode_meta(GOLDEN_FMT) == GOLDEN_META
    meta = decode_meta(GOLDEN_META)
    assert meta.namespace_digest == KEY and meta.namespace == {"model_id": "m"} and meta.block_bytes == 16
    check_meta(meta, GOLDEN_FMT, where="test")


def test_meta_mismatch_and_damage() -> None:
    meta = decode_meta(GOLDEN_META)
    with pytest.raises(ConfigError, match="namespace"):
        check_meta(meta, BlockFormat(block_bytes=16, dtype="bfloat16"), where="test")
    with pytest.raises(ConfigError, match="dtype"):
        check_meta(meta, BlockFormat(block_bytes=16, dtype="float16", namespace_digest=KEY), where="test")
    damaged = bytearray(GOLDEN_META)
    damaged[-1] ^= 1
    with pytest.raises(CorruptBlockError):
        decode_meta(bytes(damaged))
    newer = bytearray(GOLDEN_META)
    newer[4] = 99
    with pytest.raises(UnsupportedRecordError):
        decode_meta(bytes(newer))


def test_compressed_record_round_trips_and_is_smaller() -> None:
    raw = torch.linspace(-1, 1, 2048).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    record = _record(KEY, raw, "zstd-shuffle")
    assert len(record) < len(raw)
    out = bytearray(len(raw))
    assert decode_record(KEY, record, memoryview(out)).codec_id == 2
    assert bytes(out) == raw


def test_incompressible_block_falls_back_to_raw() -> None:
    raw = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)).numpy().tobytes()
    record = _record(KEY, raw, {"name": "zstd", "level": 19})
    assert len(record) == len(raw) + HEADER_SIZE
    assert parse_header(record, raw_length=4096).codec_id == NoneCodec.codec_id


@pytest.mark.parametrize(
    "mutate, error",
    [
        (lambda r: r[:20], "truncated"),
        (lambda r: r[:-1], "bytes"),
        (lambda r: b"XXXX" + r[4:], "magic"),
        (lambda r: r[:40] + bytes([r[40] ^ 1]) + r[41:], "checksum"),
        (lambda r: r[:29] + bytes([r[29] ^ 1]) + r[30:], "checksum"),
        (lambda r: r + b"\0", "bytes"),
    ],
)
def test_damaged_records_are_corrupt(mutate: object, error: str) -> None:
    with pytest.raises(CorruptBlockError, match=error):
        decode_record(KEY, mutate(GOLDEN_RECORD), memoryview(bytearray(16)))  # type: ignore[operator]


def test_wrong_key_fails_the_checksum() -> None:
    with pytest.raises(CorruptBlockError, match="checksum"):
        decode_record(bytes(32), GOLDEN_RECORD, memoryview(bytearray(16)))


def test_unknown_version_is_unsupported_and_never_parsed() -> None:
    record = bytearray(GOLDEN_RECORD)
    record[4] = RECORD_VERSION + 1
    record[8:16] = (1 << 62).to_bytes(8, "little")  # absurd lengths are not even looked at
    out = bytearray(b"\x55" * 16)
    with pytest.raises(UnsupportedRecordError):
        decode_record(KEY, bytes(record), memoryview(out))
    assert out == bytearray(b"\x55" * 16)


def test_header_lengths_are_checked_before_allocating() -> None:
    huge = _forge(KEY, 1, 1 << 40, b"\0" * 64)
    with pytest.raises(CorruptBlockError, match="raw bytes"):
        parse_header(huge, raw_length=4096)
    longer = _forge(KEY, 1, 4096, b"\0" * 5000)
    with pytest.raises(CorruptBlockError, match="stored bytes"):
        parse_header(longer, raw_length=4096)


@pytest.mark.parametrize("content_size", [True, False])
@pytest.mark.parametrize("codec_id", [1, 2])
def test_decompression_bomb_is_rejected_without_a_big_allocation(content_size: bool, codec_id: int) -> None:
    bomb = zstandard.ZstdCompressor(level=19, write_content_size=content_size)
    if content_size:
        payload = bomb.compress(bytes(64 << 20))
    else:
        cobj = bomb.compressobj()
        payload = cobj.compress(bytes(64 << 20)) + cobj.flush()
    assert len(payload) < 4096
    record = _forge(KEY, codec_id, 4096, payload)
    out = bytearray(4096)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptBlockError):
            decode_record(KEY, record, memoryview(out))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_unknown_codec_id_is_unsupported() -> None:
    record = _forge(KEY, 200, 16, b"\1" * 8)
    with pytest.raises(UnsupportedRecordError, match="codec id 200"):
        decode_record(KEY, record, memoryview(bytearray(16)))


# -- keyed records (MAC) ---------------------------------------------------------------------

SECRET = b"fleet-secret-0123456789abcdef"


def _keyed(key: bytes, raw: bytes, mac: object, codec: object = None) -> bytes:
    head, payload = encode_record(key, memoryview(raw), resolve_codec(codec), dtype_code("bfloat16"), mac)  # type: ignore[arg-type]
    return head + bytes(payload)


@pytest.mark.parametrize("codec", [None, {"name": "zstd", "level": 1}])
def test_keyed_record_round_trips_and_refuses_everything_else(codec: object) -> None:
    from kvtier.records.format import MAC_TAG_SIZE, RecordAuthError, RecordMac

    mac = RecordMac(SECRET)
    raw = bytes(4096)
    record = _keyed(KEY, raw, mac, codec)
    out = bytearray(4096)
    header = decode_record(KEY, record, memoryview(out), mac=mac)
    assert header.keyed and header.payload_offset == HEADER_SIZE + MAC_TAG_SIZE and bytes(out) == raw
    refused = 0
    # A forged record, well formed and with its checksum recomputed, carries no MAC.
    with pytest.raises(RecordAuthError):
        decode_record(KEY, _record(KEY, raw, codec), memoryview(out), mac=mac)
    refused += 1
    # The same bytes keyed with another secret, or under another key.
    with pytest.raises(RecordAuthError):
        decode_record(KEY, _keyed(KEY, raw, RecordMac(b"another-secret-0123456789")), memoryview(out), mac=mac)
    refused += 1
    with pytest.raises(RecordAuthError):
        decode_record(bytes(32), record, memoryview(out), mac=mac)
    refused += 1
    # One flipped payload bit, or the MAC flag cleared (and the checksum made valid).
    flipped = bytearray(record)
    flipped[-1] ^= 1
    with pytest.raises(RecordAuthError):
        decode_record(KEY, bytes(flipped), memoryview(out), mac=mac)
    refused += 1
    # A reader without the secret cannot check it: unsupported (a miss), never served.
    with pytest.raises(UnsupportedRecordError):
        decode_record(KEY, record, memoryview(out))
    refused += 1
    print(f"keyed records: 1 served, {refused} refused")
    assert refused == 5


def test_keyed_header_cannot_be_stripped() -> None:
    from kvtier.records.format import RecordAuthError, RecordMac

    mac = RecordMac(SECRET)
    record = bytearray(_keyed(KEY, b"x" * 16, mac))
    record[7] = 0  # clear FLAG_MAC: the tag now reads as payload, the lengths no longer match
    with pytest.raises(CorruptBlockError):
        decode_record(KEY, bytes(record), memoryview(bytearray(16)), mac=mac)
    with pytest.raises(RecordAuthError):
        decode_record(KEY, _forge(KEY, 0, 16, b"y" * 16), memoryview(bytearray(16)), mac=mac)


def test_mac_options_and_secret_never_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.records.format import RecordMac

    assert RecordMac.from_options() is None
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        RecordMac(b"short")
    with pytest.raises(ConfigError, match="not set"):
        RecordMac.from_options(mac_key_env="KV_TEST_UNSET_SECRET")
    with pytest.raises(ConfigError, match="not both"):
        RecordMac.from_options(mac_key=SECRET, mac_key_env="X")
    monkeypatch.setenv("KV_TEST_SECRET", SECRET.decode())
    from_env = RecordMac.from_options(mac_key_env="KV_TEST_SECRET")
    assert from_env is not None
    RecordMac(SECRET).verify(b"h", KEY, b"p", from_env.tag(b"h", KEY, b"p"))  # the same secret
    assert SECRET.decode() not in repr(from_env)
    from kvtier import registry

    for options in ({"mac_key": SECRET.decode()}, {"mac_key_env": "KV_TEST_SECRET"}):
        backend = registry.backends.get("lmdb")(capacity=1 << 20, path="/nonexistent-kvtier", **options)
        data = backend.to_dict()
        assert SECRET.decode() not in repr(data)
        if "mac_key" in options:
            with pytest.raises(ConfigError, match="not serialised"):
                type(backend).from_dict(data)
        else:
            assert type(backend).from_dict(data).mac is not None


# -- the MAC algorithms: AES-GMAC by default, keyed BLAKE3 and HMAC-SHA256 kept -----------------

#: A keyed record of ``b"kvtier-golden-16"`` under KEY and SECRET, as written with each MAC. The
#: HMAC-SHA256 bytes are those every keyed store held before BLAKE3 became the default, the BLAKE3
#: ones those of the stores keyed before AES-GMAC did. An AES-GMAC tag starts with a random salt;
#: this one was written with the salt 00 01 .. 0f.
GOLDEN_KEYED = {
    "aes-gmac": bytes.fromhex(
        "4b56544201000104100000000000000010000000000000000000000000000000000102030405060708090a0b0c0d0e0f"
        "7e8e5e0859908e852df36af2f8f961046b76746965722d676f6c64656e2d3136"
    ),
    "blake3": bytes.fromhex(
        "4b565442010001021000000000000000100000000000000000000000000000005bc1506a94814c8f4e8ecf1b479074b6"
        "651b8de1ba00a6118c5a4d10969c0a576b76746965722d676f6c64656e2d3136"
    ),
    "hmac-sha256": bytes.fromhex(
        "4b5654420100010110000000000000001000000000000000000000000000000088d2c53ea3928150d86ba24af5cf7121"
        "29c03f3d723924857975c1cf31a8d3f76b76746965722d676f6c64656e2d3136"
    ),
}
ALGORITHMS = ("aes-gmac", "blake3", "hmac-sha256")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_golden_keyed_record_bytes(algorithm: str) -> None:
    from kvtier.records.format import RecordMac

    mac = RecordMac(SECRET, algorithm)
    written = _keyed(KEY, b"kvtier-golden-16", mac)
    if algorithm == "aes-gmac":  # a fresh salt: the same record, another tag
        assert written[:32] == GOLDEN_KEYED[algorithm][:32] and written[32:64] != GOLDEN_KEYED[algorithm][32:64]
        assert written[64:] == GOLDEN_KEYED[algorithm][64:]
    else:
        assert written == GOLDEN_KEYED[algorithm]
    for record in (written, GOLDEN_KEYED[algorithm]):
        out = bytearray(16)
        assert decode_record(KEY, record, memoryview(out), mac=mac).flags == mac.flag
        assert bytes(out) == b"kvtier-golden-16"


def test_aes_gmac_tag_is_gcm_under_the_salts_key() -> None:
    """The construction, computed apart: key = HMAC-SHA256(HMAC-SHA256(secret, context), salt),
    tag = AES-256-GCM with a zero nonce, no plaintext and head + key + payload as associated data."""
    import hashlib
    import hmac

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from kvtier.records.format import RecordMac

    payload = bytes(range(256)) * 1024  # several update calls' worth
    for record in (GOLDEN_KEYED["aes-gmac"], _keyed(KEY, payload, RecordMac(SECRET, "aes-gmac"))):
        salt, tag = record[32:48], record[48:64]
        root = hmac.new(SECRET, b"kvtier record MAC key v1 aes-256-gmac", hashlib.sha256).digest()
        subkey = hmac.new(root, salt, hashlib.sha256).digest()
        assert AESGCM(subkey).encrypt(bytes(12), b"", record[:24] + KEY + record[64:]) == tag


def test_aes_gmac_salts_are_fresh_and_bound_to_the_tag() -> None:
    from kvtier.records.format import RecordAuthError, RecordMac

    mac = RecordMac(SECRET, "aes-gmac")
    raw = bytes(range(256)) * 64
    one, two = _keyed(KEY, raw, mac), _keyed(KEY, raw, mac)
    assert one[32:48] != two[32:48]  # a new salt, so a new key, for every record
    out = bytearray(len(raw))
    for record in (one, two):
        decode_record(KEY, record, memoryview(out), mac=mac)
    swapped_salt = one[:32] + two[32:48] + one[48:]
    flipped_tag = one[:52] + bytes([one[52] ^ 1]) + one[53:]
    flipped_payload = one[:-1] + bytes([one[-1] ^ 1])
    for bad in (swapped_salt, flipped_tag, flipped_payload):
        with pytest.raises(RecordAuthError):
            decode_record(KEY, bad, memoryview(out), mac=mac)


def test_aes_gmac_is_the_default_mac_and_reads_the_earlier_defaults_records() -> None:
    from kvtier.records.format import FLAG_MAC, FLAG_MAC_BLAKE3, FLAG_MAC_GMAC, RecordMac

    mac = RecordMac(SECRET)
    assert mac.algorithm == "aes-gmac" and mac.flag == FLAG_MAC_GMAC
    assert RecordMac.from_options(mac_key=SECRET).algorithm == "aes-gmac"  # type: ignore[union-attr]
    raw = bytes(range(256)) * 16
    out = bytearray(len(raw))
    for algorithm, flag in (("blake3", FLAG_MAC_BLAKE3), ("hmac-sha256", FLAG_MAC)):
        old = _keyed(KEY, raw, RecordMac(SECRET, algorithm))  # a record of a store keyed before
        assert old[7] == flag
        assert decode_record(KEY, old, memoryview(out), mac=mac).flags == flag and bytes(out) == raw
        # ... but only with the same secret.
        with pytest.raises(CorruptBlockError, match="MAC mismatch"):
            decode_record(KEY, old, memoryview(out), mac=RecordMac(b"another-secret-0123456789"))


@pytest.mark.parametrize(("reader", "writer"), [("hmac-sha256", "blake3"), ("hmac-sha256", "aes-gmac"), ("blake3", "aes-gmac")])
def test_a_mac_refuses_the_records_of_later_macs_as_unsupported(reader: str, writer: str) -> None:
    from kvtier.records.format import RecordMac

    new = _keyed(KEY, bytes(4096), RecordMac(SECRET, writer))
    with pytest.raises(UnsupportedRecordError, match="another MAC"):
        decode_record(KEY, new, memoryview(bytearray(4096)), mac=RecordMac(SECRET, reader))


def test_mac_algorithm_cannot_be_swapped_in_the_header() -> None:
    """The flags byte is under the tag: relabelling a record as another MAC's never verifies,
    and two MAC bits at once are unsupported."""
    from kvtier.records.format import MAC_ALGORITHMS, RecordAuthError, RecordMac

    mac = RecordMac(SECRET)  # reads all three
    for algorithm in ALGORITHMS:
        record = bytearray(_keyed(KEY, bytes(64), RecordMac(SECRET, algorithm)))
        for other, flag in MAC_ALGORITHMS.items():
            if other == algorithm:
                continue
            record[7] = flag
            with pytest.raises(RecordAuthError):
                decode_record(KEY, bytes(record), memoryview(bytearray(64)), mac=mac)
            record[7] = flag | MAC_ALGORITHMS[algorithm]
            with pytest.raises(UnsupportedRecordError):
                decode_record(KEY, bytes(record), memoryview(bytearray(64)), mac=mac)


@pytest.mark.parametrize("size", [4096, 4 << 20])  # the large one is hashed on several threads
def test_blake3_tag_is_the_same_on_one_thread_or_several(size: int) -> None:
    import blake3

    from kvtier.records.format import RecordMac

    mac = RecordMac(SECRET, "blake3")
    payload = bytes(range(256)) * (size // 256)
    head = b"h" * 24
    one = blake3.blake3(key=mac._blake3_key)
    one.update(head + KEY + payload)
    assert mac.tag(head, KEY, payload) == one.digest()
    record = _keyed(KEY, payload, mac)
    out = bytearray(size)
    decode_record(KEY, record, memoryview(out), mac=mac)
    assert bytes(out) == payload


def test_unknown_mac_algorithm_is_a_config_error_naming_it() -> None:
    from kvtier import registry
    from kvtier.records.format import RecordMac

    with pytest.raises(ConfigError, match=r"mac_algorithm.*'sha1'"):
        RecordMac(SECRET, "sha1")
    with pytest.raises(ConfigError, match="mac_algorithm"):
        registry.backends.get("lmdb")(capacity=1 << 20, path="/nonexistent-kvtier", mac_key=SECRET, mac_algorithm="md5")



def test_mac_algorithm_round_trips_through_to_dict(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier import registry

    monkeypatch.setenv("KV_TEST_SECRET", SECRET.decode())
    cls = registry.backends.get("lmdb")
    backend = cls(capacity=1 << 20, path="/nonexistent-kvtier", mac_key_env="KV_TEST_SECRET", mac_algorithm="hmac-sha256")
    data = backend.to_dict()
    assert data["mac_algorithm"] == "hmac-sha256"
    assert cls.from_dict(data).mac.algorithm == "hmac-sha256"
    assert cls(capacity=1 << 20, path="/nonexistent-kvtier", mac_key_env="KV_TEST_SECRET").to_dict()["mac_algorithm"] == "aes-gmac"
    assert "mac_algorithm" not in cls(capacity=1 << 20, path="/nonexistent-kvtier").to_dict()


def test_meta_record_names_the_mac_of_a_keyed_store() -> None:
    from kvtier.records.format import RecordMac

    assert encode_meta(GOLDEN_FMT, None) == GOLDEN_META  # an unkeyed store's meta is unchanged
    assert decode_meta(GOLDEN_META).mac is None
    refused = {("blake3", "hmac-sha256"), ("aes-gmac", "hmac-sha256"), ("aes-gmac", "blake3")}  # (store, tier)
    for algorithm in ALGORITHMS:
        mac = RecordMac(SECRET, algorithm)
        meta = decode_meta(encode_meta(GOLDEN_FMT, mac))
        assert meta.mac == algorithm
        check_meta(meta, GOLDEN_FMT, where="test", mac=mac)
        for other in ALGORITHMS:
            if (algorithm, other) in refused:  # the tier could read none of the store's records
                with pytest.raises(ConfigError, match=rf"keyed with {algorithm}.*mac_algorithm: {algorithm}"):
                    check_meta(meta, GOLDEN_FMT, where="test", mac=RecordMac(SECRET, other))
            else:  # the tier's own, or an earlier default's store: its records are read
                check_meta(meta, GOLDEN_FMT, where="test", mac=RecordMac(SECRET, other))
    # A store keyed before the meta record named its MAC opens with any.
    for algorithm in ALGORITHMS:
        check_meta(decode_meta(GOLDEN_META), GOLDEN_FMT, where="test", mac=RecordMac(SECRET, algorithm))
