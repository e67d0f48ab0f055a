"""Codecs: registry lookup, options, lossless round trips over KV dtypes, shuffle planes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import registry
from kvtier.errors import ConfigError, CorruptBlockError, UnknownNameError
from kvtier.records.codec import Codec, NoneCodec, codec_for_id, resolve_codec

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float8_e4m3fn": torch.float8_e4m3fn, "float32": torch.float32}


def _codec(name: str) -> Codec:
    return resolve_codec(name)


def test_codecs_are_found_through_the_registry() -> None:
    assert {"none", "zstd", "zstd-shuffle"} <= set(registry.codecs.names())
    assert registry.codecs.get("none") is NoneCodec
    ids = {registry.codecs.get(n).codec_id for n in ("none", "zstd", "zstd-shuffle")}
    assert ids == {0, 1, 2}
    assert codec_for_id(2).name == "zstd-shuffle"
    with pytest.raises(UnknownNameError, match="zstd"):
        resolve_codec("lz4-nope")


@pytest.mark.parametrize("spec", ["none", "zstd", {"name": "zstd", "level": 7, "threads": 2}, {"name": "zstd-shuffle", "level": -1}])
def test_to_dict_round_trip(spec: object) -> None:
    codec = resolve_codec(spec)  # type: ignore[arg-type]
    again = resolve_codec(codec.to_dict())
    assert again == codec and again.to_dict() == codec.to_dict()


@pytest.mark.parametrize("spec", [{"name": "zstd", "level": "fast"}, {"name": "zstd", "threads": -5}, {"name": "zstd", "colour": 1}, {"level": 3}, 42])
def test_bad_options_are_config_errors(spec: object) -> None:
    with pytest.raises(ConfigError):
        resolve_codec(spec)  # type: ignore[arg-type]


def _round_trip(codec: Codec, raw: np.ndarray, itemsize: int) -> np.ndarray:
    payload = codec.encode(memoryview(raw), itemsize)
    out = np.zeros_like(raw)
    codec.decode_into(memoryview(payload), memoryview(out), itemsize)
    return out


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["none", "zstd", "zstd-shuffle"]),
    dtype=st.sampled_from(sorted(DTYPES)),
    count=st.integers(min_value=1, max_value=3000),
    scale=st.floats(min_value=1e-3, max_value=1e3),
    seed=st.integers(min_value=0, max_value=2**31),
)
def test_lossless_over_kv_dtypes(name: str, dtype: str, count: int, scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    values = (torch.randn(count, generator=g) * scale).to(DTYPES[dtype])
    raw = values.view(torch.uint8).numpy()
    itemsize = values.element_size()
    assert np.array_equal(_round_trip(_codec(name), raw, itemsize), raw)


@settings(max_examples=40, deadline=None)
@given(data=st.binary(min_size=1, max_size=4000), itemsize=st.sampled_from([1, 2, 4, 8]))
def test_lossless_over_arbitrary_bytes(data: bytes, itemsize: int) -> None:
    raw = np.frombuffer(data, dtype=np.uint8).copy()
    for name in ("zstd", "zstd-shuffle"):
        assert np.array_equal(_round_trip(_codec(name), raw, itemsize), raw)


def test_shuffle_puts_high_bytes_in_their_own_plane() -> None:
    from kvtier.backends.codecs import shuffle_bytes, unshuffle_bytes

    words = np.array([0x1234, 0xABCD, 0x00FF], dtype=np.uint16)
    planes = shuffle_bytes(memoryview(words.view(np.uint8)), 2)
    assert planes.tolist() == [0x34, 0xCD, 0xFF, 0x12, 0xAB, 0x00]
    out = np.zeros(6, dtype=np.uint8)
    unshuffle_bytes(planes, memoryview(out), 2)
    assert out.view(np.uint16).tolist() == words.tolist()


def test_shuffle_compresses_kv_like_bf16_better() -> None:
    g = torch.Generator().manual_seed(0)
    scales = torch.logspace(-2, 0.5, 128)
    raw = (torch.randn(512, 128, generator=g) * scales).to(torch.bfloat16).view(-1).view(torch.uint8).numpy()
    plain = len(_codec("zstd").encode(memoryview(raw), 2))
    shuffled = len(_codec("zstd-shuffle").encode(memoryview(raw), 2))
    assert shuffled < plain < raw.size


def test_decode_rejects_wrong_sizes_and_garbage() -> None:
    raw = np.arange(4096, dtype=np.uint16).view(np.uint8)
    payload = _codec("zstd").encode(memoryview(raw), 2)
    with pytest.raises(CorruptBlockError):
        _codec("zstd").decode_into(memoryview(payload), memoryview(bytearray(raw.size - 2)), 2)
    with pytest.raises(CorruptBlockError):
        _codec("zstd").decode_into(memoryview(b"not a zstd frame"), memoryview(bytearray(16)), 2)
    with pytest.raises(CorruptBlockError):
        NoneCodec().decode_into(memoryview(b"abc"), memoryview(bytearray(4)), 1)
