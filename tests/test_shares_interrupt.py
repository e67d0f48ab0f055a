"""``run_all`` returns only once every call has ended, even when the calling thread is
interrupted (Ctrl-C: ``KeyboardInterrupt``) while it waits for a pooled call: a share still
copying would go on writing into rows its caller already gave up (a close-time write-back from
an exit hook runs on the main thread). Run in a child process: the child interrupts itself."""

from __future__ import annotations

import subprocess
import sys

import pytest

_CHILD = r"""
import signal, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from kvtier.shares import run_all

# Python's own Ctrl-C handler, whatever this process inherited: a test run started in the
# background of a shell without job control (a CI job, nohup ... &) ignores SIGINT, and so
# would this child, never raising the interrupt the test is about.
signal.signal(signal.SIGINT, signal.default_int_handler)
main = threading.main_thread()
release, ended = threading.Event(), threading.Event()

def waiting_in_run_all():
    # the main thread's innermost frame is a wait of the threading module (in run_all's waits)
    frame = sys._current_frames().get(main.ident)
    return frame is not None and frame.f_code.co_name == "wait" and frame.f_code.co_filename.endswith("threading.py")

def pooled():
    while not waiting_in_run_all():
        time.sleep(0.001)
    signal.pthread_kill(main.ident, signal.SIGINT)
    release.wait(1.0)  # still copying when the interrupt lands
    ended.set()

pool = ThreadPoolExecutor(1)
if sys.argv[1] == "started":  # the pool's thread already runs: the interrupt lands in run_all's wait
    pool.submit(lambda: None).result()
try:
    run_all(pool, [lambda: None, pooled])
    print("no interrupt")
except KeyboardInterrupt:
    print("ended" if ended.is_set() else "still running")
release.set()
pool.shutdown()
"""


@pytest.mark.parametrize("pool", ["started", "fresh"])  # fresh: it lands in the submit's thread start
def test_an_interrupt_while_run_all_waits_returns_only_after_every_call_ended(pool: str) -> None:
    child = subprocess.run([sys.executable, "-c", _CHILD, pool], capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "ended", (child.stdout, child.stderr)
