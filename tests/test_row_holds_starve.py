"""Jobs on several threads whose holds of automatic garbage collection (``xxcopy.rows_hold``)
overlap without a break: the process-wide count never reaches zero, so before, automatic
collection never ran while they went on and their cyclic garbage grew without bound (none of
the collections these tests count). Once holds have been continuous past the limit, a hold
from a thread that holds none waits, GIL released and for a bounded time, for the count to
drain, and runs the collection that was due before it holds. Run in a child: the test owns the
process's collector and threads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtier.records import xxcopy

#: Three threads each loop over a job: hold, make cyclic garbage, sleep with the GIL released
#: (a copy, a read), hold again inside (nested) and sleep, let go twice, again at once; each
#: job's hold overlaps another's. Prints the
#: collections seen while the jobs went on (not those after, once the threads end), the cyclic
#: objects made and those still alive near the end, whether collection is on after, and the
#: collections that started while a job held (its outer or a nested hold). A finalizer that
#: sleeps now and then makes a collection long, as a large one is.
_OVERLAP = r"""
import gc, sys, threading, time
from kvtier.records import xxcopy
native = sys.argv[1] == "native"
seconds = float(sys.argv[2])
hold, let_go = (xxcopy.rows_hold, xxcopy.rows_let_go) if native else (xxcopy.rows_hold_python, xxcopy.rows_let_go_python)
seen, inside, during = [], [0], [0]
def counted(phase, info):
    if phase == "start" and time.monotonic() < stop:
        seen.append(info["generation"])
        during[0] += inside[0] > 0  # a collection begun while a job's views are in use
gc.collect()
stop = time.monotonic() + seconds
gc.callbacks.append(counted)
alive = [0, 0]  # made, alive
class Node:
    def __init__(self):
        alive[0] += 1; alive[1] += 1
        self.other = None
    def __del__(self):
        alive[1] -= 1
        if alive[1] % 200 == 0:
            time.sleep(0.0001)  # a finalizer that lets other threads run: the collection is long
def job():
    while time.monotonic() < stop:
        hold()
        inside[0] += 1
        try:
            for _ in range(100):
                a, b = Node(), Node()
                a.other, b.other = b, a
            time.sleep(0.001)
            hold()  # nested (a tier's hold inside a job's): never waits, never collects
            try:
                time.sleep(0.001)
            finally:
                let_go()
        finally:
            inside[0] -= 1
            let_go()
threads = [threading.Thread(target=job) for _ in range(3)]
for t in threads:
    t.start()
time.sleep(max(0.0, stop - 0.1 - time.monotonic()))
late = list(alive)  # near the end, the jobs still going
for t in threads:
    t.join()
gc.callbacks.remove(counted)
print(len(seen), late[0], late[1], int(gc.isenabled()), during[0])
"""


@pytest.mark.parametrize("way", ["native", "python"])
def test_overlapping_holds_do_not_starve_automatic_collection(way: str) -> None:
    if way == "native" and not xxcopy.NATIVE:
        pytest.skip("built without the extension")
    child = subprocess.run([sys.executable, "-c", _OVERLAP, way, "3"], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    collections, made, alive, enabled, during = map(int, child.stdout.split())
    assert during == 0, f"{during} collections ran while a job held its rows' views"
    assert made > 20_000  # the jobs ran, and made garbage
    assert collections > 0, f"no automatic collection ran in 3 s of overlapping holds ({alive} of {made} cyclic objects alive)"
    assert alive < made // 2, f"{alive} of {made} cyclic objects still alive"
    assert enabled == 1
