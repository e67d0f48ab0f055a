"""A manager's ``touch`` for one tier without stamps, made once per manager as a closure (as
:mod:`.store_calls` makes the common store's calls).

An engine touches the blocks of every request it schedules, a few to a few dozen keys a call.
For one tier that keeps no stamps (not persistent), the policy orders exactly the tier's ready
keys, so its ``touch_held`` is the whole call: it finds every key there (which validates them:
each was checked when it was stored) and moves them, or changes nothing and says so. In front of
it the method of the class spent about a third of a microsecond per call on the interpreter: the
closed flag and the policy read as attributes, the lock entered by ``with`` (a special-method
lookup and a three-argument ``__exit__``, twice an ``acquire`` and ``release``), a tuple of the
accepted sequence types built per call. The closure binds the policy's ``touch_held`` and the
lock's two methods once. Anything else (several tiers, stamps, a collection that is not a list
or tuple, a key not held, an unhashable key, a closed manager) goes to the manager's method,
which gives the same answer: tests compare the two (``tests/test_manager_fast_paths.py``).

Where the extension ``kvtier.manager._probe`` is built and the policy is exactly
:class:`~kvtier.manager.policies.LRUPolicy`, ``touch`` is its ``HeldTouch``: the same call in C
for a list or tuple of exact ``bytes`` keys all held (the lock's two methods and the ordered
dict's ``move_to_end`` called from C, no interpreter loop per key), anything else handed to the
closure. Tests compare the three (``tests/test_touch_native.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from kvtier.manager.lookups import NATIVE, native_module
from kvtier.manager.policies import EvictionPolicy, LRUPolicy

__all__ = ["TouchCall", "touch_call"]

TouchFn = Callable[[Sequence[bytes]], None]


def _held_by_none(keys: Sequence[bytes]) -> bool:
    """The policy's ``touch_held`` once the manager is closed: every call goes to the general
    method, which raises :class:`~kvtier.errors.ClosedError`."""
    return False


class TouchCall:
    """The closure's handles: ``touch`` (the manager's ``touch``) and ``close`` (every later
    call goes to the general method)."""

    __slots__ = ("close", "touch")

    def __init__(self, touch: TouchFn, close: Callable[[], None]) -> None:
        self.touch = touch
        self.close = close


def touch_call(
    lock: threading.Lock, policy: EvictionPolicy | None, general: TouchFn, *, native: bool = NATIVE
) -> TouchCall:
    """``touch`` of a manager whose only tier keeps no stamps and is ordered by ``policy`` (see the
    module doc); ``None`` (several tiers, or stamps) gives ``general`` itself. ``lock`` is the
    manager's lock, ``general`` its method; ``native`` (the default where the extension is
    built): an exact ``LRUPolicy``'s common call in C."""
    if policy is None:
        return TouchCall(general, lambda: None)
    held = policy.touch_held
    acquire, release = lock.acquire, lock.release

    def touch(keys: Sequence[bytes]) -> None:
        if type(keys) is list or type(keys) is tuple:
            acquire()
            try:
                if held(keys):
                    return
            except TypeError:  # an unhashable key: the general method names it
                pass
            finally:
                release()
        general(keys)

    def close() -> None:
        nonlocal held
        held = _held_by_none

    held_touch = getattr(native_module(), "HeldTouch", None) if native else None  # (None: built before it)
    if held_touch is not None and type(policy) is LRUPolicy:
        fast = held_touch(policy.ordered(), lock, touch)

        def close_both() -> None:
            fast.close()
            close()

        return TouchCall(fast, close_both)
    return TouchCall(touch, close)
