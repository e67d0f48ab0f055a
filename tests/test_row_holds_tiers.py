"""The rows' hold (xxcopy.rows_hold) on the file tier's reads (sharded layout, the Python flat read,
the general read) and saves, and on the compressed tier's reads and saves: a collection's
finalizer that moves a row whose view is taken must never make a read write its record into the
row's old memory, nor a save store the old memory's bytes under a sound checksum (without the
hold both happened: reads wrote where the row had been, saves stored the old memory's bytes)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests import test_row_holds as t

_OPEN = 'backend = registry.backends.get(tier)(capacity=64 << 20, path=tempfile.mkdtemp(), sync_mode="fast", **more)'
_LAYOUT = 'more = {"layout": "flat"} if tier == "file" else {}'


def _script(base: str, tier: str, layout: str, general: bool) -> str:
    s = base.replace(_LAYOUT, f'more = {{"layout": "{layout}"}}')
    if tier == "compressed":
        s = s.replace(_OPEN, "backend = registry.backends.get(tier)(capacity=64 << 20)")
    if general:
        s = s.replace("from kvtier.testing import make_key, random_block",
                      "from kvtier.testing import make_key, random_block\nfrom kvtier.backends import file_tier as _ft; _ft.PLAIN_READS = False")
    return s


_CASES = [
    (kind, tier, layout, general)
    for kind in ("read", "save")
    for tier, layout, general in (("file", "sharded", False), ("file", "flat", True), ("file", "flat", False), ("compressed", "flat", False))
    if not (general and kind == "save")  # PLAIN_READS is a read switch
]


@pytest.mark.parametrize(("kind", "tier", "layout", "general"), _CASES)
@pytest.mark.parametrize("way", ["native", "one"])
def test_other_tiers_never_use_the_memory_a_row_moved_from(kind: str, tier: str, layout: str, general: bool, way: str) -> None:
    script = _script(t._READ if kind == "read" else t._SAVE, tier, layout, general)
    child = subprocess.run([sys.executable, "-c", script, tier, way, "40"], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    mid, wrong = map(int, child.stdout.split())
    assert wrong == 0, f"{kind}: wrong data at {wrong} of {mid} points"
