"""The native passes over records never touch a byte outside the buffers they are given, their
vector tails included: each source and destination here ends (or starts) right at a page that
cannot be read or written, so a load or store past it kills the process. The passes run in a
child process, so such a fault fails the test instead of the run; the child also checks the
results against the general path (``cryptography``'s GMAC, ``xxhash``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtier.records import mac, xxcopy

_GUARDED = """
import ctypes, mmap
PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None)
_keep = []
def guarded(n, front):
    # n bytes whose last byte (front: first byte) touches a PROT_NONE page
    pages = (n + PAGE - 1) // PAGE + 2
    mm = mmap.mmap(-1, pages * PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    at = base if front else base + (pages - 1) * PAGE
    assert _libc.mprotect(ctypes.c_void_p(at), PAGE, 0) == 0
    _keep.append(mm)
    start = PAGE if front else (pages - 1) * PAGE - n
    return memoryview(mm)[start:start + n]
"""

_GMAC = _GUARDED + """
import os
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from kvtier.records.mac import gmac_copy
bad = []
for n in [*range(0, 1100), 4095, 4096, 4097, 65536 + 8, 65536 + 9]:
    for plen in (56, 0, 3):
        for front in (False, True):
            key, prefix, data = os.urandom(32), os.urandom(plen), os.urandom(n)
            src, dst = guarded(n, front), guarded(n, front)
            src[:] = data
            enc = Cipher(algorithms.AES(key), modes.GCM(bytes(12))).encryptor()
            enc.authenticate_additional_data(prefix + data)
            enc.finalize()
            if gmac_copy(key, prefix, src, dst) != enc.tag or gmac_copy(key, prefix, src) != enc.tag or bytes(dst) != data:
                bad.append((n, plen, front))
            _keep.clear()
print("bad", bad)
"""

_READ = _GUARDED + """
import os, struct, tempfile, xxhash
from kvtier.records import xxcopy
path = os.path.join(tempfile.mkdtemp(), "r")
bad = []
for n in [*range(0, 600, 7), 4095, 4096, 4097, 65537]:
    head, key, payload = os.urandom(24), os.urandom(32), os.urandom(n)
    with open(path, "wb") as f:
        f.write(head + struct.pack("<Q", xxhash.xxh3_64(head + key + payload).intdigest()) + payload)
    for piece in (0, 64, 100, 4096):
        for front in (False, True):
            stored, row = guarded(32, front), guarded(n, front)
            fd = os.open(path, os.O_RDONLY)
            try:
                if xxcopy.xxh3_read_check_native(fd, head, key, stored, row, piece) != 0 or bytes(row) != payload:
                    bad.append((n, piece, front))
            finally:
                os.close(fd)
            _keep.clear()
        src, dst = guarded(n, piece % 2 == 0), guarded(n, piece % 2 == 1)
        src[:] = payload
        if xxcopy.xxh3_copy_native(head + key, src, dst) != xxhash.xxh3_64(head + key + payload).intdigest() or bytes(dst) != payload:
            bad.append((n, "copy", piece))
        _keep.clear()
print("bad", bad)
"""


def _run(code: str) -> None:
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, f"the child died ({child.returncode}): {child.stderr[-2000:]}"
    assert child.stdout.strip() == "bad []", child.stdout


@pytest.mark.skipif(mac.gmac_copy is None, reason="the native AES-GMAC pass is not built, or this CPU has no path for it")
def test_the_gmac_pass_stays_inside_its_buffers() -> None:
    _run(_GMAC)


@pytest.mark.skipif(xxcopy.xxh3_read_check_native is None, reason="kvtier.records._xxcopy not built")
def test_the_read_check_and_the_copy_stay_inside_their_buffers() -> None:
    _run(_READ)
