"""A fork taken while another thread's job holds automatic garbage collection off
(``xxcopy.rows_hold``): the child has no such job, so it must not keep collection off. Run in a
child, which forks."""

from __future__ import annotations

import subprocess
import sys

import pytest

_CHILD = r"""
import gc, os, sys, threading
from kvtier.records import rowhold, xxcopy
native = sys.argv[1] == "native"
if not native:
    rowhold._NATIVE_HOLD = False
hold, let_go = (xxcopy.rows_hold, xxcopy.rows_let_go) if native else (xxcopy.rows_hold_python, xxcopy.rows_let_go_python)
held, done = threading.Event(), threading.Event()
def job():
    hold()  # a job's hold, across the fork
    held.set()
    done.wait()
    let_go()
worker = threading.Thread(target=job)
worker.start()
held.wait()
assert not gc.isenabled()
pid = os.fork()
if pid == 0:
    ok = gc.isenabled()
    hold(); off = not gc.isenabled(); let_go()
    os._exit(0 if ok and off and gc.isenabled() else 3)
_, status = os.waitpid(pid, 0)
done.set()
worker.join()
print(os.waitstatus_to_exitcode(status), gc.isenabled())
"""


@pytest.mark.parametrize("way", ["native", "python"])
def test_a_child_forked_during_a_jobs_hold_collects_again(way: str) -> None:
    child = subprocess.run([sys.executable, "-c", _CHILD, way], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split() == ["0", "True"], "the forked child kept automatic collection off (or the parent did after its job)"
