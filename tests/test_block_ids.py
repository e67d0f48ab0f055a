"""Engine block ids handed to save/load: only integers, and errors that name the position."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvtier
from kvtier.errors import LayoutError
from kvtier.transfer.layout import KVLayout


def _layout() -> KVLayout:
    return KVLayout([torch.zeros(8, 4, 2, dtype=torch.bfloat16) for _ in range(2)])


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([0, 1.5], r"block_ids\[1\]: expected an integer block id, got 1.5"),
        ([True, 2], r"block_ids\[0\]: expected an integer block id, got True"),
        ([0, np.bool_(True)], r"block_ids\[1\]"),
        ([0, "3"], r"block_ids\[1\]"),
        ([0, torch.tensor(1.0)], r"block_ids\[1\]"),
    ],
)
def test_non_integer_block_ids_are_rejected(ids: list[object], match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        _layout().check_block_ids(ids, 2)  # type: ignore[arg-type]


def test_integer_like_block_ids_are_accepted() -> None:
    ids = [np.int64(3), torch.tensor(5), 7]
    assert _layout().check_block_ids(ids, 3) == [3, 5, 7]  # type: ignore[arg-type]
    assert _layout().check_block_ids(torch.tensor([1, 2]), 2) == [1, 2]  # type: ignore[arg-type]


@pytest.mark.parametrize("ids", [[3, 5, 7], (3, 5, 7), [3, np.int64(5), 7], range(3, 8, 2)])
def test_a_list_of_ints_checks_as_any_other_sequence_of_block_ids(ids: object) -> None:
    """The list of plain ints (checked without a call) against the other sequences (the
    general path): the same ids, as a new list the caller's later changes do not reach, and
    the same range check."""
    got = _layout().check_block_ids(ids, 3)  # type: ignore[arg-type]
    assert got == [3, 5, 7] and type(got) is list and got is not ids
    if isinstance(ids, list):
        ids[0] = 6
        assert got[0] == 3
    with pytest.raises(LayoutError, match=r"block_ids\[0\]: engine block id 9 is out of range"):
        _layout().check_block_ids([9, *list(ids)[1:]], 3)  # type: ignore[list-item]


async def test_save_with_a_float_block_id_changes_nothing() -> None:
    caches = [torch.randn(8, 4, 2).to(torch.bfloat16) for _ in range(2)]
    ns = kvtier.Namespace(model_id="ids", block_size=4)
    keys = kvtier.block_keys(list(range(8)), block_size=4, namespace=ns)
    async with kvtier.open({"tiers": [{"backend": "cpu", "capacity": "1MiB"}]}, kv_caches=caches, namespace=ns) as store:
        with pytest.raises(LayoutError, match=r"block_ids\[1\]"):
            await store.save(keys, [0, 1.5])  # type: ignore[list-item]
        assert await store.lookup(keys) == 0
