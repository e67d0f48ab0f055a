"""The checks an ``lmdb`` tier's one-key straight read makes before its lookup, in one call each
(``lmdb_plain.host_view``, ``lmdb_plain.same_size``): the native form (``backends/_rowguard.c``)
answers as the Python one, for every kind of row and every state of the file. Through the tier,
``test_lmdb_one_read.py`` runs each of its cases with both forms."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier.backends import lmdb_plain
from refcheck import runs_without_leaks

SIZE = 4096
SHAPE = torch.Size([SIZE])

native = pytest.mark.skipif(not lmdb_plain.NATIVE_GUARD, reason="built without the native row guard")


class _Sub(torch.Tensor):
    pass


def _rows() -> dict[str, Any]:
    base = torch.zeros(SIZE + 64, dtype=torch.uint8)
    return {
        "a seen row": torch.zeros(SIZE, dtype=torch.uint8),
        "a row not seen": torch.zeros(SIZE, dtype=torch.uint8),
        "a row cut at an offset, seen": base[32 : 32 + SIZE],
        "int8": torch.zeros(SIZE, dtype=torch.int8),
        "float16 of the same bytes": torch.zeros(SIZE // 2, dtype=torch.float16),
        "a short row": torch.zeros(SIZE - 1, dtype=torch.uint8),
        "a long row": torch.zeros(SIZE + 1, dtype=torch.uint8),
        "empty": torch.zeros(0, dtype=torch.uint8),
        "zero-dimensional": torch.zeros((), dtype=torch.uint8),
        "two-dimensional": torch.zeros((1, SIZE), dtype=torch.uint8),
        "strided": torch.zeros((SIZE, 2), dtype=torch.uint8)[:, 1],
        "on the meta device": torch.empty(SIZE, dtype=torch.uint8, device="meta"),
        "a tensor subclass": torch.zeros(SIZE, dtype=torch.uint8).as_subclass(_Sub),
        "a numpy array": torch.zeros(SIZE, dtype=torch.uint8).numpy(),
        "bytes": bytes(SIZE),
        "None": None,
    }


_SEEN = ("a seen row", "a row cut at an offset, seen", "int8", "strided", "a tensor subclass")


@native
@pytest.mark.parametrize("what", list(_rows()))
def test_host_view_answers_as_its_python_form(what: str) -> None:
    rows = _rows()
    row = rows[what]
    views: dict[int, memoryview] = {}
    for name in _SEEN:  # addresses in the views (some of rows that are refused before the lookup)
        seen = rows[name]
        views[seen.data_ptr()] = memoryview(bytearray(SIZE))
    if what in _SEEN:
        row = rows[what]
    native_view = lmdb_plain._rowguard.host_view(row, torch.Tensor, torch.uint8, SHAPE, views)  # type: ignore[union-attr]
    python_view = lmdb_plain.host_view_python(row, torch.Tensor, torch.uint8, SHAPE, views)
    assert native_view is python_view
    expected = views[row.data_ptr()] if what in ("a seen row", "a row cut at an offset, seen") else None
    assert native_view is expected, what


@native
def test_host_view_refuses_views_that_are_not_a_dict_by_name() -> None:
    row = torch.zeros(SIZE, dtype=torch.uint8)
    with pytest.raises(TypeError, match="views: expected a dict"):
        lmdb_plain._rowguard.host_view(row, torch.Tensor, torch.uint8, SHAPE, [])  # type: ignore[union-attr]
    with pytest.raises(TypeError, match="takes 5 arguments"):
        lmdb_plain._rowguard.host_view(row, torch.Tensor, torch.uint8, SHAPE)  # type: ignore[union-attr]


@native
@pytest.mark.parametrize("call", ["one_read", "job_read", "straight_read"])
def test_the_straight_reads_refuse_bad_arguments_by_name(call: str) -> None:
    read = getattr(lmdb_plain._rowguard, call)
    with pytest.raises(TypeError, match=rf"^{call}\(parts, .* takes 7 arguments, got 3$"):
        read(1, 2, 3)
    with pytest.raises(TypeError, match="parts: expected a tuple of"):
        read(*(1,) * 7)
    if call != "straight_read":  # (straight_read hands its arguments on to these two)
        with pytest.raises(TypeError, match="must be real number"):
            read(*((None,) * 21, None, None, None, None, "warm", None))
        with pytest.raises(TypeError, match="jobs must be a list and marks a dict"):
            read(*((None,) * 21, None, None, None, None, 1.0, None))


@native
def test_host_view_passes_on_an_error_a_row_raises_as_the_python_form_does() -> None:
    class Broken(torch.Tensor):
        @property
        def shape(self) -> Any:  # type: ignore[override]
            raise RuntimeError("no shape here")

    row = torch.zeros(SIZE, dtype=torch.uint8).as_subclass(Broken)
    for form in (lmdb_plain._rowguard.host_view, lmdb_plain.host_view_python):  # type: ignore[union-attr]
        with pytest.raises(RuntimeError, match="no shape here"):
            form(row, Broken, torch.uint8, SHAPE, {})


@native
def test_host_view_asks_a_subclass_of_its_own_ndim_its_shape_as_the_python_form_does() -> None:
    class Flat(torch.Tensor):
        @property
        def ndim(self) -> int:  # type: ignore[override]
            return 1

    row = torch.zeros((1, SIZE), dtype=torch.uint8).as_subclass(Flat)
    views = {row.data_ptr(): memoryview(bytearray(SIZE))}
    for form in (lmdb_plain._rowguard.host_view, lmdb_plain.host_view_python):  # type: ignore[union-attr]
        assert form(row, Flat, torch.uint8, SHAPE, views) is None  # its shape, (1, SIZE), is not a row's
    flat = torch.zeros(SIZE, dtype=torch.uint8).as_subclass(Flat)
    views = {flat.data_ptr(): memoryview(bytearray(SIZE))}
    for form in (lmdb_plain._rowguard.host_view, lmdb_plain.host_view_python):  # type: ignore[union-attr]
        assert form(flat, Flat, torch.uint8, SHAPE, views) is views[flat.data_ptr()]


@native
def test_same_size_answers_as_its_python_form(tmp_path: Path) -> None:
    path = tmp_path / "data"
    path.write_bytes(bytes(8192))
    fd = os.open(path, os.O_RDONLY)
    forms = (lmdb_plain._rowguard.same_size, lmdb_plain.same_size_python)  # type: ignore[union-attr]
    try:
        answers = {}
        for state in ("as seen", "grown", "cut short"):
            if state == "grown":
                with open(path, "ab") as f:
                    f.write(bytes(4096))
            elif state == "cut short":
                os.truncate(path, 4096)
            answers[state] = [[form(fd, seen) for seen in (0, 4096, 8192, 12288)] for form in forms]
        answers["no descriptor"] = [[form(-1, seen) for seen in (0, 8192)] for form in forms]
    finally:
        os.close(fd)
    answers["a closed descriptor"] = [[form(fd, seen) for seen in (0, 4096)] for form in forms]
    for state, (by_native, by_python) in answers.items():
        assert by_native == by_python, state
    assert answers["as seen"][0] == [False, False, True, False]
    assert answers["grown"][0] == [False, False, False, True]
    assert answers["cut short"][0] == [False, True, False, False]
    assert answers["no descriptor"][0] == [False, False]


@native
@pytest.mark.parametrize("what", list(_rows()))
def test_row_views_take_a_job_as_with_the_python_form(what: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``RowViews.of`` (a save's and a read's rows, checked and viewed in one loop) asks
    ``host_view`` first for each row: with either form, a job of a seen row, a row to be seen,
    and the row under test gives the same views (the same objects for rows seen before) or
    ``None``, or raises the same error, and keeps the same rows."""
    from kvtier.keys import KEY_BYTES

    outcomes = []
    for form in (lmdb_plain._rowguard.host_view, lmdb_plain.host_view_python):  # type: ignore[union-attr]
        monkeypatch.setattr(lmdb_plain, "host_view", form)
        lmdb_plain._VIEWS.pop(SIZE + 1, None)  # a row size of its own: no other test's views
        rows = _rows()
        views = lmdb_plain.RowViews(SIZE + 1)
        views.size, views.shape = SIZE, SHAPE  # (the test's rows are SIZE bytes)
        seen, fresh = rows["a seen row"], rows["a row not seen"]
        first = views.of([bytes(KEY_BYTES)], [seen])
        assert first is not None
        job = [seen, fresh, rows[what]]
        try:
            got: Any = views.of([bytes(KEY_BYTES)] * 3, job)
        except Exception as exc:  # (a row without tensor attributes)
            got = type(exc)
        if isinstance(got, list):
            assert got[0] is first[0]
            got = [bytes(v) == bytes(SIZE) and len(v) == SIZE for v in got]
        outcomes.append((got, len(views.views), fresh.data_ptr() in views.views))
        lmdb_plain._VIEWS.pop(SIZE + 1, None)
    assert outcomes[0] == outcomes[1]
    taken = ("a seen row", "a row not seen", "a row cut at an offset, seen", "a tensor subclass")
    expected = [True] * 3 if what in taken else AttributeError if what in ("bytes", "None") else None
    assert outcomes[0][0] == expected


class _Key(bytes):
    pass


@native
@pytest.mark.parametrize("what", list(_rows()))
def test_one_row_answers_as_its_python_form(what: str, tmp_path: Path) -> None:
    """``one_row``: the key's check, then ``host_view``, then ``same_size``, in one call, with
    each kind of key, each kind of row and each state of the file, as the Python form."""
    path = tmp_path / "data"
    path.write_bytes(bytes(8192))
    rows = _rows()
    views = {rows[name].data_ptr(): memoryview(bytearray(SIZE)) for name in _SEEN}
    keys = {"a key": bytes(32), "a short key": bytes(31), "a str key": "k" * 32, "a bytes subclass": _Key(bytes(32)), "a bytearray": bytearray(32)}
    fd = os.open(path, os.O_RDONLY)
    forms = (lmdb_plain._rowguard.one_row, lmdb_plain.one_row_python)  # type: ignore[union-attr]
    try:
        for key_name, key in keys.items():
            for seen, fd_given in ((8192, fd), (4096, fd), (8192, -1)):
                got = [form(key, 32, rows[what], torch.Tensor, torch.uint8, SHAPE, views, fd_given, seen) for form in forms]
                assert got[0] is got[1], (key_name, seen, fd_given)
                good = key_name == "a key" and what in ("a seen row", "a row cut at an offset, seen")
                sound = seen == 8192 and fd_given >= 0
                assert got[0] is (views[rows[what].data_ptr()] if good and sound else False if good else None)
    finally:
        os.close(fd)


@native
def test_the_native_calls_keep_no_reference_and_no_memory(tmp_path: Path) -> None:
    """Every outcome of the three calls (a view, None at each check, False, an error), many
    times: the rows, the views and their dict, the key and the shape keep their references."""
    path = tmp_path / "data"
    path.write_bytes(bytes(8192))
    rows = _rows()
    seen, fresh, wrong = rows["a seen row"], rows["a row not seen"], rows["int8"]
    view = memoryview(bytearray(SIZE))
    views = {seen.data_ptr(): view}
    key = bytes(32)
    guard = lmdb_plain._rowguard  # type: ignore[union-attr]
    fd = os.open(path, os.O_RDONLY)
    try:

        def one_round() -> None:
            assert guard.host_view(seen, torch.Tensor, torch.uint8, SHAPE, views) is view
            assert guard.host_view(fresh, torch.Tensor, torch.uint8, SHAPE, views) is None
            assert guard.host_view(wrong, torch.Tensor, torch.uint8, SHAPE, views) is None
            assert guard.one_row(key, 32, seen, torch.Tensor, torch.uint8, SHAPE, views, fd, 8192) is view
            assert guard.one_row(key, 32, seen, torch.Tensor, torch.uint8, SHAPE, views, fd, 4096) is False
            assert guard.one_row(key, 31, seen, torch.Tensor, torch.uint8, SHAPE, views, fd, 8192) is None
            assert guard.one_row(key, 32, fresh, torch.Tensor, torch.uint8, SHAPE, views, fd, 8192) is None
            assert guard.same_size(fd, 8192) is True
            try:
                guard.host_view(seen, torch.Tensor, torch.uint8, SHAPE, [])
            except TypeError:
                pass

        one_round()
        runs_without_leaks((seen, fresh, wrong, view, views, key, SHAPE), one_round, 20_000)
    finally:
        os.close(fd)


@native
@pytest.mark.parametrize("layout", ["joined", "split"])
def test_the_native_one_key_read_keeps_no_reference_and_no_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    """``one_read`` through the tier, many times, at each outcome: a hit, a miss, a damaged
    record (handed to the general path), a row not seen (likewise): the key, the row, the
    environment and the parts keep their references, and the counters move as the reads did."""
    import asyncio

    from kvtier.backends import lmdb_entries, lmdb_one

    from kvtier import registry
    from kvtier.backend import BlockFormat
    from kvtier.records import xxcopy
    from kvtier.testing import make_key, random_block

    if layout == "split":
        monkeypatch.setattr(lmdb_entries, "JOIN_MAX", 0)
    backend = registry.backends.get("lmdb")(capacity=8 << 20, path=str(tmp_path / "store"), sync_mode="fast")
    try:
        asyncio.run(backend.open(BlockFormat(block_bytes=SIZE, dtype="uint8")))
        good, bad, absent = make_key(1), make_key(2), make_key(3)
        block = random_block(SIZE, 1)
        backend.write_blocks([good, bad], [block, random_block(SIZE, 2)])
        env = backend._env  # type: ignore[attr-defined]
        with env.begin(write=True) as txn:  # one payload bit flipped: the check fails
            value = bytearray(txn.get(bad, db=backend._blocks))  # type: ignore[attr-defined]
            value[-1] ^= 1
            txn.put(bad, bytes(value), db=backend._blocks)  # type: ignore[attr-defined]
        row, fresh = torch.zeros(SIZE, dtype=torch.uint8), torch.zeros(SIZE, dtype=torch.uint8)
        assert backend.read_blocks([good], [row]) == [True]  # the row's view made, the thread marked
        straight = backend._straight  # type: ignore[attr-defined]
        parts, clock = straight.native_parts, lmdb_one.perf_counter
        straight.views.pop(fresh.data_ptr(), None)  # (the views are the process's: an earlier row's may sit at its address)

        def read(key: bytes, into: torch.Tensor) -> Any:
            return lmdb_plain.one_read(parts, env, key, into, clock, lmdb_one.COLD_GET_S, xxcopy.xxh3_check_copy)  # type: ignore[misc]

        def one_round() -> None:
            row.zero_()
            assert read(good, row) == [True] and torch.equal(row, block)
            assert read(absent, row) == [False]
            assert read(bad, row) is None
            assert read(good, fresh) is None

        one_round()
        before = backend.stats()
        view = straight.views[row.data_ptr()]
        runs_without_leaks((good, bad, absent, row, fresh, env, parts, straight.views, view), one_round, 5_000)
        after = backend.stats()
        assert after["blocks_read"] - before["blocks_read"] == 5_000 and after["read_misses"] - before["read_misses"] == 5_000
        assert after["bytes_read"] - before["bytes_read"] == 5_000 * SIZE and not backend._reader.temperature.jobs  # type: ignore[attr-defined]
    finally:
        asyncio.run(backend.aclose())
