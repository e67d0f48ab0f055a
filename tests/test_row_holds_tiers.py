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


_IMPORTS = "from kvtier.testing import make_key, random_block"
#: What each read form switches off, so that the file tier's read takes a path whose rows' views
#: are taken in Python: ``general``, the plain reads (the general read alone); ``no_job``, the
#: flat job's one native call (a job of one, then a flat job's checks and reads in one call, as
#: where that call is not built); ``no_rows``, that call and the flat rows' one (a job of one, then
#: the rows' views taken by ``RowViews.of`` and the reads of the plain records).
_FORMS = {
    "plain": "",
    "general": "from kvtier.backends import file_tier as _ft; _ft.PLAIN_READS = False",
    "no_job": "from kvtier.records import xxcopy as _xx; _xx.xxh3_read_job = None",
    "no_rows": "from kvtier.records import xxcopy as _xx; _xx.xxh3_read_job = _xx.xxh3_read_rows = None",
}


def _script(base: str, tier: str, layout: str, form: str) -> str:
    s = base.replace(_LAYOUT, f'more = {{"layout": "{layout}"}}')
    if tier == "compressed":
        s = s.replace(_OPEN, "backend = registry.backends.get(tier)(capacity=64 << 20)")
    if _FORMS[form]:
        s = s.replace(_IMPORTS, f"{_IMPORTS}\n{_FORMS[form]}")
    return s


_CASES = [
    (kind, tier, layout, form)
    for kind in ("read", "save")
    for tier, layout, form in (
        ("file", "sharded", "plain"), ("file", "flat", "general"), ("file", "flat", "plain"), ("file", "flat", "no_job"),
        ("file", "flat", "no_rows"), ("compressed", "flat", "plain"),
    )
    if not (form != "plain" and kind == "save")  # (read switches)
]


@pytest.mark.parametrize(("kind", "tier", "layout", "form"), _CASES)
@pytest.mark.parametrize("way", ["native", "one"])
def test_other_tiers_never_use_the_memory_a_row_moved_from(kind: str, tier: str, layout: str, form: str, way: str) -> None:
    script = _script(t._READ if kind == "read" else t._SAVE, tier, layout, form)
    child = subprocess.run([sys.executable, "-c", script, tier, way, "40"], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    mid, wrong = map(int, child.stdout.split())
    assert wrong == 0, f"{kind}: wrong data at {wrong} of {mid} points"
