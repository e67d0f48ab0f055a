"""An exception raised into a job at the first instruction after its rows' hold is taken (an
asynchronous one: a KeyboardInterrupt, ``PyThreadState_SetAsyncExc``, which the interpreter
raises between instructions) lets the hold go as the job ends. A hold taken as ``rows_hold()``
then ``try:`` left it taken there, and automatic collection off for the rest of the process;
the hold is now a ``with xxcopy.rows_held:``, whose exit is armed as its entry returns."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import pytest
import torch
from kvtier.backends import lmdb_lone, lmdb_one, lmdb_plain, lmdb_tier, lmdb_writes
from test_pool_rows_tiers import SIZE, _opened, _saved

from kvtier.pool_rows import PoolRows
from kvtier.records import xxcopy
from kvtier.records.rowhold import holding_rows


class _Landed(Exception):
    """What the test raises into the job."""


def _raised_once_held(call: Callable[[], Any], code: CodeType) -> list[int]:
    """Run ``call``, raising :class:`_Landed` in the frame running ``code`` at its first
    instruction once the rows' hold is taken (automatic collection off); the offsets it was
    raised at."""
    raised: list[int] = []

    def each_instruction(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode" and not raised and not gc.isenabled():
            raised.append(frame.f_lasti)
            raise _Landed
        return each_instruction

    def calls(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code is code:
            frame.f_trace_opcodes = True
            return each_instruction
        return None

    sys.settrace(calls)
    try:
        call()
    except _Landed:
        pass
    finally:
        sys.settrace(None)
    return raised


@pytest.fixture
def collecting() -> Iterator[None]:
    gc.enable()
    try:
        yield
    finally:
        gc.enable()  # (for the tests after a failure here)


@pytest.fixture
def python_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lmdb tier's straight reads in their Python form (the holds under test are theirs)."""
    for name in ("one_read", "job_read", "straight_read"):
        monkeypatch.setattr(lmdb_plain, name, None)
    monkeypatch.setattr(xxcopy, "xxh3_read_job", None)
    monkeypatch.setattr(xxcopy, "xxh3_read_rows", None)


@pytest.mark.usefixtures("collecting")
def test_a_method_held_by_holding_rows_lets_the_hold_go() -> None:
    held = holding_rows(lambda: None)
    assert _raised_once_held(held, held.__code__)
    assert gc.isenabled(), "the hold was left taken"


@pytest.mark.usefixtures("collecting", "python_reads")
@pytest.mark.parametrize("job", [1, 3])
def test_a_straight_lmdb_read_lets_the_hold_go(tmp_path: Path, job: int) -> None:
    with _opened(tmp_path / "t", "lmdb") as backend:
        keys, _ = _saved(backend, job)
        rows = [torch.zeros(SIZE, dtype=torch.uint8) for _ in range(job)]
        code = (lmdb_one.StraightRead.read if job == 1 else lmdb_one.StraightRead.job).__code__
        assert _raised_once_held(lambda: backend.read_blocks(keys, rows), code)
        assert gc.isenabled(), "the hold was left taken"
        assert backend.read_blocks(keys, rows) == [True] * job  # and the tier reads on


@pytest.mark.usefixtures("collecting")
def test_a_general_lmdb_read_lets_the_hold_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lmdb_one, "STRAIGHT_READS", False)
    with _opened(tmp_path / "t", "lmdb") as backend:
        keys, _ = _saved(backend, 3)
        rows = [torch.zeros(SIZE, dtype=torch.uint8) for _ in range(3)]
        assert _raised_once_held(lambda: backend.read_blocks(keys, rows), lmdb_tier.LmdbBackend.read_blocks.__wrapped__.__code__)
        assert gc.isenabled(), "the hold was left taken"
        assert backend.read_blocks(keys, rows) == [True] * 3


@pytest.mark.usefixtures("collecting")
@pytest.mark.parametrize("job", [1, 3])
@pytest.mark.parametrize("rows_as", ["list", "pool"])
def test_a_lone_or_job_lmdb_save_lets_the_hold_go(tmp_path: Path, job: int, rows_as: str) -> None:
    """The lone and job saves let their hold go early by a flag: taken as ``rows_hold()`` then
    ``try:``, an exception landing between the two left it taken. Now the hold and its flag are
    one call (``rows_hold_flag``), the first line of the ``try``."""
    with _opened(tmp_path / "t", "lmdb") as backend:
        keys, _ = _saved(backend, job)
        pool = torch.full((job, SIZE), 5, dtype=torch.uint8)
        rows: Any = PoolRows(pool, range(job)) if rows_as == "pool" else list(pool)
        code = (lmdb_lone.LoneSave.save if job == 1 else lmdb_lone.LoneSave.save_job).__code__
        assert _raised_once_held(lambda: backend.write_blocks(keys, rows), code)
        assert gc.isenabled(), "the hold was left taken"
        assert None not in backend.write_blocks(keys, rows)  # and the tier saves on
        back = torch.zeros_like(pool)
        assert backend.read_blocks(keys, list(back)) == [True] * job and torch.equal(back, pool)


@pytest.mark.usefixtures("collecting")
def test_a_general_lmdb_save_lets_the_hold_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lmdb_lone, "LONE_SAVES", False)
    with _opened(tmp_path / "t", "lmdb") as backend:
        keys, _ = _saved(backend, 3)
        rows = [torch.full((SIZE,), 9, dtype=torch.uint8) for _ in range(3)]
        assert _raised_once_held(lambda: backend.write_blocks(keys, rows), lmdb_writes.LmdbWrites.write_blocks.__wrapped__.__code__)
        assert gc.isenabled(), "the hold was left taken"
        assert None not in backend.write_blocks(keys, rows)


@pytest.mark.usefixtures("collecting")
@pytest.mark.parametrize("form", ["native", "python"])
def test_a_flagged_hold_is_taken_and_let_go_once(form: str) -> None:
    if form == "native" and xxcopy.rows_hold_flag is xxcopy.rows_hold_flag_python:
        pytest.skip("built without the native hold")
    hold, let_go = (xxcopy.rows_hold_flag, xxcopy.rows_let_go_flag) if form == "native" else (xxcopy.rows_hold_flag_python, xxcopy.rows_let_go_flag_python)
    held = [False]
    hold(held)
    hold(held)  # (set already: no second hold)
    assert held == [True] and not gc.isenabled()
    let_go(held)
    assert held == [False] and gc.isenabled()
    let_go(held)  # (unset: none let go)
    assert gc.isenabled()
