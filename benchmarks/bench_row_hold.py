"""The rows' hold's forms against the two calls in a ``try``/``finally``: one JSON object.

    python benchmarks/bench_row_hold.py [--quick] [--rounds N] [--holds N]

Each arm holds ``--holds`` times around the same small body, timed by the thread's CPU:

* ``raw`` (the baseline): ``rows_hold()``, ``try``, the body, ``finally: rows_let_go()``;
* ``with``: ``with rows_held:`` around the body;
* ``decorated``: the body as a function under ``holding_rows``, called;
* ``flagged``: the ``lmdb`` saves' form, a hold a callee may let go early: a one-item list as
  the flag, ``try``, the hold and its flag in one call (``rows_hold_flag``), ``finally``
  ``rows_let_go_flag``;
* ``flagged_split``: their form before, ``rows_hold()`` then ``try`` (an asynchronous exception
  between the two leaves the hold), ``finally`` a Python function that lets go once;
* ``flagged_object``: the same with an object of its own (``with``, ``let_go()``) for the flag.

Arms alternate within a round and their order reverses every round; each reports ns a hold
(median over rounds) and ``<arm>_ratio``, its time over ``raw``'s, median of the per-round
ratios, with the smallest and largest (``<arm>_spread``). ``native`` says whether the count is
the extension's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from kvtier.records import xxcopy
from kvtier.records.xxcopy import holding_rows, rows_held, rows_hold, rows_hold_flag, rows_let_go, rows_let_go_flag


def _let_go(held: list[bool]) -> None:
    if held[0]:
        held[0] = False
        rows_let_go()


class _Hold:
    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held = False

    def __enter__(self) -> _Hold:
        rows_hold()
        self.held = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.let_go()

    def let_go(self) -> None:
        if self.held:
            self.held = False
            rows_let_go()


def _arms(holds: int) -> dict[str, Any]:
    box = [0]

    def raw() -> None:
        for _ in range(holds):
            rows_hold()
            try:
                box[0] += 1
            finally:
                rows_let_go()

    def with_() -> None:
        for _ in range(holds):
            with rows_held:
                box[0] += 1

    @holding_rows
    def body() -> None:
        box[0] += 1

    def decorated() -> None:
        for _ in range(holds):
            body()

    def flagged() -> None:
        for _ in range(holds):
            held = [False]
            try:
                rows_hold_flag(held)
                box[0] += 1
            finally:
                rows_let_go_flag(held)

    def flagged_split() -> None:
        for _ in range(holds):
            held = [True]
            rows_hold()
            try:
                box[0] += 1
            finally:
                _let_go(held)

    def flagged_object() -> None:
        for _ in range(holds):
            with _Hold() as hold:
                box[0] += 1
                hold.let_go()

    return {"raw": raw, "with": with_, "decorated": decorated, "flagged": flagged, "flagged_split": flagged_split, "flagged_object": flagged_object}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--holds", type=int, default=None)
    args = parser.parse_args()
    rounds = args.rounds or (5 if args.quick else 15)
    holds = args.holds or (50_000 if args.quick else 200_000)
    arms = _arms(holds)
    times: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.thread_time_ns()
            arms[name]()
            times[name].append((time.thread_time_ns() - start) / holds)
    out: dict[str, Any] = {"bench": "row_hold", "native": xxcopy.NATIVE, "rounds": rounds, "holds": holds}
    for name in names:
        ratios = [t / b for t, b in zip(times[name], times["raw"])]
        out[f"{name}_ns"] = round(statistics.median(times[name]), 1)
        if name != "raw":
            out[f"{name}_ratio"] = round(statistics.median(ratios), 3)
            out[f"{name}_spread"] = [round(min(ratios), 3), round(max(ratios), 3)]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
