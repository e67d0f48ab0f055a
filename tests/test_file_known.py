"""The file tier's known-records view (``backends/file_known.py``) against a plain dict."""

from __future__ import annotations

import random

import numpy as np
import pytest
from kvtier.backends.file_known import KnownRecords

from kvtier.testing import make_key


def _unpacked(packed: np.ndarray) -> list[bytes]:
    data = packed.tobytes()
    return [data[i : i + 32] for i in range(0, len(data), 32)]


@pytest.mark.parametrize("uniform", [True, False])
def test_known_records_answer_as_a_dict_of_every_known_key(uniform: bool) -> None:
    rng = random.Random(7)
    listed = [make_key(i) for i in range(0, 400, 2)]
    rng.shuffle(listed)
    sizes = [4096 if uniform else rng.choice((4096, 8192)) for _ in listed]
    known, model = KnownRecords(), dict(zip(listed, sizes))
    known.adopt(listed, np.array(sizes, dtype=np.int64))
    assert len(known) == len(model)
    for _ in range(3000):
        key = make_key(rng.randrange(420))
        op = rng.randrange(3)
        if op == 0:
            assert known.get(key, -1) == model.get(key, -1)
        elif op == 1:
            size = rng.choice((4096, 12288))
            known.set(key, size)
            model[key] = size
        else:
            assert known.pop(key, 0) == model.pop(key, 0)
        assert len(known) == len(model)
    assert all(known.get(key, -1) == model.get(key, -1) for key in map(make_key, range(420)))
    known.clear()
    assert len(known) == 0 and known.get(listed[0], -1) == -1


def test_a_uniform_listing_holds_no_per_key_size_and_drops_keys_that_left() -> None:
    keys = [make_key(i) for i in range(100)]
    known = KnownRecords()
    known.adopt(keys, np.full(100, 4096, dtype=np.int64))
    assert known._fresh == {} and known._listed_size == 4096
    assert all(listed is key for listed, key in zip(known._listed.keys, sorted(keys)))  # the listing's objects
    for key in keys[:51]:
        assert known.pop(key) == 4096
    assert len(known._listed) == 49 and not known._gone  # rebuilt once half had left
    assert known.get(keys[0], -1) == -1 and known.get(keys[99]) == 4096


def test_keys_sharing_their_first_eight_bytes_are_sorted_as_bytes() -> None:
    from kvtier.backends.file_known import _sorted_keys

    rng = random.Random(3)
    digests = [rng.randbytes(32) for _ in range(200)]
    shared = [b"\x07" * 8 + rng.randbytes(24) for _ in range(50)]  # one prefix: the general sort
    for keys in (digests, digests + shared, digests + digests[:5]):
        assert _sorted_keys(keys) == sorted(set(keys))
    assert all(a is b for a, b in zip(_sorted_keys(digests), sorted(digests)))


@pytest.mark.parametrize("uniform", [True, False])
def test_known_stamps_follow_adopt_writes_touches_and_pops_as_a_dict_does(uniform: bool) -> None:
    """Each known key's stamp comes back from ``columns`` in key order, with its size, through
    the listing's rebuilds: a listed key's (the listing's, then its touches), and for a key
    written since the open the stamp its file has (asked of ``stamp_of``; a key whose file is
    not there is left out)."""
    rng = random.Random(11)
    listed = [make_key(i) for i in range(0, 400, 2)]
    rng.shuffle(listed)
    sizes = [4096 if uniform else rng.choice((4096, 8192)) for _ in listed]
    stamps = [rng.uniform(0, 1e6) for _ in listed]
    known = KnownRecords()
    known.adopt(listed, np.array(sizes, dtype=np.int64), np.array(stamps))
    model = {k: (n, s) for k, n, s in zip(listed, sizes, stamps)}
    files: dict[bytes, float] = {}  # the mtimes of the records written since the open
    for step in range(3000):
        key = make_key(rng.randrange(420))
        op = rng.randrange(3)
        if op == 0:
            stamp = rng.uniform(0, 2e6)
            known.touch(key, stamp)
            if key in files:
                files[key] = stamp  # the file's mtime: utime wrote it
            elif key in model:
                model[key] = (model[key][0], stamp)
        elif op == 1:
            size = rng.choice((4096, 12288))
            known.set(key, size)
            files[key] = float(step)
            model[key] = (size, -1.0)
        else:
            assert known.pop(key, 0) == model.pop(key, (0, 0))[0]
            files.pop(key, None)
    lost = rng.choice(sorted(files))  # written, and its file gone since
    del files[lost]
    packed, stored, stamped = known.columns(files.get)
    keys = _unpacked(packed)
    expected = sorted(k for k in model if k != lost)
    assert keys == expected
    assert stored.tolist() == [model[k][0] for k in keys]
    assert stamped.tolist() == [files[k] if k in files else model[k][1] for k in keys]
