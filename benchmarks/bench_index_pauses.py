"""The longest store call as a key index fills from empty: one JSON object.

    python benchmarks/bench_index_pauses.py [--keys N] [--rounds N] [--batch N]
        [--index disk|memory|both] [--old PATH]

An index (``KeyIndex``) is filled with ``--keys`` synthetic keys, ``--batch`` new keys a call
(``KeyIndex.assign(keys, READY)``, what a store's completion does), and each call is timed by the
thread's CPU (another process holding the core is not counted). ``disk``: a persistent tier's
index (the filter, two slots a key); ``memory``: a memory tier's (eight slots a key and the
ready-key table). Reported per arm, as medians over rounds with their ranges:

* ``longest_ms``: the longest call of all;
* ``longest_no_dict_resize_ms``: the longest call in which the ``dict``'s own table did not
  grow (``dict.__sizeof__`` unchanged): the index's own pauses, the filter's growth and the
  ready-key table's (``longest_no_dict_resize_at``: the keys held after it);
* ``dict_resize_ms``: the longest call in which it did (CPython copies its entries), and
  ``median_us``: the median call, ``total_ms``: all calls.

``--old PATH``: the ``_probe`` extension of another build (a copy of its ``.so``), loaded under
its own file name beside this build's; each round then fills an index of each build, their order
reversed every round, so that both arms see the same machine. ``loadavg`` is printed at the end.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import time
from typing import Any

READY = 1


def _load(path: str) -> Any:
    """The ``KeyIndex`` type of the extension at ``path`` (loaded apart from the installed one)."""
    spec = importlib.util.spec_from_file_location("kvtier.manager._probe", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--old: {path} is not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.KeyIndex


def fill(index_type: Any, keys: list[bytes], batch: int, memory: bool) -> dict[str, float]:
    """Fill a new index of ``index_type`` with ``keys``, ``batch`` a call; the calls' figures."""
    index = index_type()
    if memory:
        index.keep_ready()
    calls: list[int] = []
    longest = longest_plain = resize = plain_at = 0
    clock, size = time.thread_time_ns, dict.__sizeof__
    parts = [keys[i : i + batch] for i in range(0, len(keys), batch)]
    gc.disable()
    try:
        for part in parts:
            table = size(index)
            t = clock()
            index.assign(part, READY)
            spent = clock() - t
            calls.append(spent)
            longest = max(longest, spent)
            if size(index) == table:
                if spent > longest_plain:
                    longest_plain, plain_at = spent, len(index)
            else:
                resize = max(resize, spent)
    finally:
        gc.enable()
    assert len(index) == len(keys)
    return {
        "longest_ms": longest / 1e6,
        "longest_no_dict_resize_ms": longest_plain / 1e6,
        "longest_no_dict_resize_at": plain_at,
        "dict_resize_ms": resize / 1e6,
        "median_us": statistics.median(calls) / 1e3,
        "total_ms": sum(calls) / 1e6,
    }


def _summary(runs: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field in runs[0]:
        values = [r[field] for r in runs]
        out[field] = round(statistics.median(values), 4)
        out[field + "_range"] = [round(min(values), 4), round(max(values), 4)]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--index", choices=["disk", "memory", "both"], default="both")
    ap.add_argument("--old", default=None, help="another build's _probe extension, to fill beside this one")
    args = ap.parse_args(argv)
    from kvtier.manager import _probe  # type: ignore[attr-defined]

    arms = {"new": _probe.KeyIndex}
    if args.old:
        arms["old"] = _load(args.old)
    seed = os.urandom(8)
    keys = [seed + i.to_bytes(24, "big") for i in range(args.keys)]
    kinds = ["disk", "memory"] if args.index == "both" else [args.index]
    runs: dict[str, list[dict[str, float]]] = {f"{kind}_{arm}": [] for kind in kinds for arm in arms}
    for r in range(args.rounds):
        for kind in kinds:
            order = list(arms) if r % 2 == 0 else list(arms)[::-1]
            for arm in order:
                runs[f"{kind}_{arm}"].append(fill(arms[arm], keys, args.batch, kind == "memory"))
                gc.collect()
    result: dict[str, Any] = {"keys": args.keys, "batch": args.batch, "rounds": args.rounds}
    result.update({name: _summary(values) for name, values in runs.items()})
    result["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
