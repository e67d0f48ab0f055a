"""What the saves' pool-grown tests (``tests/test_lmdb_save_pool_grown.py``,
``tests/test_file_save_pool_grown.py``) run in their children: the rows of a 64 MiB pool (its
memory mapped alone, unmapped when freed) holding block ``i`` in row ``i`` of the job, given as
one pool or as a list (``form``), saved twice under other keys so that the tier keeps their
views; and the read back once the job's save returned (``sizes``)."""

ROWS = r"""
import torch
from kvtier.pool_rows import PoolRows
from kvtier.testing import make_key, random_block
pool = torch.zeros(16384, 4096, dtype=torch.uint8)
numbers = range(16384 - job, 16384)
for i, n in enumerate(numbers):
    pool[n].copy_(random_block(4096, i, torch.uint8))
rows = PoolRows(pool, numbers) if form == "pool" else [pool[n] for n in numbers]
keys = [make_key(i) for i in range(job)]
for _ in range(2):
    b.write_blocks([make_key(1000 + i) for i in range(job)], rows)  # (the rows' views kept)
"""

#: ``right``: every block found holds its row's bytes; ``answered``: only a key whose size was
#: not ``None`` is found.
READ_BACK = r"""
out = torch.zeros(job, 4096, dtype=torch.uint8)
found = b.read_blocks(keys, list(out))
right = all(torch.equal(out[i], random_block(4096, i, torch.uint8)) for i in range(job) if found[i])
answered = all(f <= (s is not None) for f, s in zip(found, sizes))
"""
