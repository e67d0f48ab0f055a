"""The common store's two calls, made once per manager as closures (as :mod:`.lookups` makes
``lookup``).

An engine stores every block it computes: ``prepare_store`` and ``complete_store`` run once per
job, and for a job of a few blocks their cost is the interpreter's (calls, attribute lookups,
argument parsing), not the dictionaries'. Most jobs are the *common store*: new keys that fit in
the first tier's free room, no copy below (write-back, or one tier), no tenant, no admission
rule; completed whole, successfully. For those:

* ``prepare_store`` is :meth:`PlanBook.open_new <kvtier.manager.plan.PlanBook.open_new>`: one
  pass in C finds none of the keys held, one loop checks and reserves each key, and the plan is
  made without the builder;
* ``complete_store`` is :meth:`PlanBook.complete_new <kvtier.manager.plan.PlanBook.complete_new>`:
  the keys of one open plan that copies nothing below are taken out of the book in one pass and
  made ready in the first tier.

Anything else (a key held or repeated or malformed, no room, a tenant, ``keep_below``, a
failure, sizes, several plans, a closed manager) goes to the manager's general methods, which
give the same answers: tests compare the two (``tests/test_manager_store_paths.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from kvtier.manager.plan import PlanBook, StorePlan

__all__ = ["StoreCalls", "store_calls"]

PrepareFn = Callable[..., "StorePlan | None"]
CompleteFn = Callable[..., None]


class StoreCalls:
    """The closures' handles: ``prepare`` and ``complete`` (the manager's ``prepare_store`` and
    ``complete_store``) and ``close`` (every later call goes to the general methods, which
    raise :class:`~kvtier.errors.ClosedError`)."""

    __slots__ = ("close", "complete", "prepare")

    def __init__(self, prepare: PrepareFn, complete: CompleteFn, close: Callable[[], None]) -> None:
        self.prepare = prepare
        self.complete = complete
        self.close = close


def store_calls(
    book: PlanBook,
    lock: threading.Lock,
    counts: dict[str, int],
    ids: Iterator[int],
    now: Callable[[], float],
    general_prepare: PrepareFn,
    general_complete: CompleteFn,
) -> StoreCalls:
    """``prepare_store`` and ``complete_store`` over ``book`` (see the module doc): the common
    store here, anything else by ``general_prepare`` / ``general_complete``. ``ids`` numbers
    the plans (shared with the general path), ``now`` stamps what becomes ready."""
    open_ = True
    open_new, complete_new = book.open_new, book.complete_new

    def prepare_store(
        keys: Sequence[bytes], *, partial: bool = False, keep_below: Iterable[bytes] = (), tenant: str | None = None
    ) -> StorePlan | None:
        if tenant is None and not keep_below and open_:
            with lock:
                plan = open_new(ids, keys)
                if plan is not None:
                    counts["store_prepared"] += len(plan.keys)
                    return plan
        return general_prepare(keys, partial=partial, keep_below=keep_below, tenant=tenant)

    def complete_store(
        keys: Sequence[bytes],
        success: bool = True,
        *,
        sizes: Mapping[int, Mapping[bytes, int]] | None = None,
        failed: Mapping[int, Iterable[bytes]] | None = None,
    ) -> None:
        if success and not failed and not sizes and open_:
            with lock:
                done = complete_new(keys, now)
                if done:
                    counts["store_completed"] += done
                    return
        general_complete(keys, success, sizes=sizes, failed=failed)

    def close() -> None:
        nonlocal open_
        open_ = False

    return StoreCalls(prepare_store, complete_store, close)
