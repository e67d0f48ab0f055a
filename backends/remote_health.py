"""Up/down state of a remote tier's server, with exponential backoff: a dead server fails fast.

Every remote tier (``redis``, and any built on :mod:`kvtier.backends.remote_tier`) keeps one
:class:`Health` per server it talks to (a Redis Cluster one per primary). The data path and the
index sweeps share it:

* a call that could not reach the server calls :meth:`Health.failed`: the first failure of an
  outage logs one warning and counts an outage; each later one doubles the backoff (0.1 s to
  5 s);
* until the backoff runs out, :meth:`Health.allow` is ``False``: stores fail at once and loads
  miss with no network wait (counted in ``fast_failures``);
* the next call or sweep after the backoff tries again, and a success (:meth:`Health.succeeded`)
  ends the outage, logging its length.

Nothing here raises into the engine: a dead server is a counted, logged normal event.
:class:`Busy` is the other kind of failure: the tier's own back-pressure (no connection to spare),
which fails one share of a job and says nothing of the server's health.
"""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["BACKOFF_FIRST_S", "BACKOFF_MAX_S", "Busy", "Down", "Health"]

log = logging.getLogger("kvtier")

BACKOFF_FIRST_S = 0.1
BACKOFF_MAX_S = 5.0


class Down(Exception):
    """A server could not be reached; the caller fails the share and marks the server down.
    ``__cause__`` is the client library's own error."""


class Busy(Exception):
    """No connection (or slot) to spare within the wait: the tier's own load, not an outage."""


class Health:
    """Up/down state of one server (``where``, as logged: never a secret), with backoff."""

    def __init__(self, where: str, *, kind: str = "remote") -> None:
        self.where = where
        self.kind = kind
        self.down_since: float | None = None
        self._retry_at = 0.0
        self._backoff = BACKOFF_FIRST_S
        self._lock = threading.Lock()
        self.outages = 0
        self.connection_errors = 0
        self.fast_failures = 0

    @property
    def up(self) -> bool:
        return self.down_since is None

    def allow(self) -> bool:
        """Whether to touch the network now (up, or the backoff since the last failure ran out)."""
        return self.down_since is None or time.monotonic() >= self._retry_at

    def failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            self.connection_errors += 1
            if self.down_since is None:
                self.down_since = now
                self.outages += 1
                self._backoff = BACKOFF_FIRST_S
                log.warning(
                    "%s: %s unreachable (%s: %s); stores fail and loads miss until it is back",
                    self.kind, self.where, type(exc).__name__, exc,
                )
            else:
                self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
            self._retry_at = now + self._backoff

    def failed_fast(self, n: int) -> None:
        """Count ``n`` records failed with no network wait (from any thread: under the lock)."""
        with self._lock:
            self.fast_failures += n

    def succeeded(self) -> bool:
        """Mark up; ``True`` if this ended an outage."""
        if self.down_since is None:
            return False
        with self._lock:
            since, self.down_since = self.down_since, None
            self._backoff = BACKOFF_FIRST_S
        if since is not None:
            log.warning("%s: %s is back after %.1f s", self.kind, self.where, time.monotonic() - since)
            return True
        return False

    def stats(self) -> dict[str, int]:
        return {"outages": self.outages, "connection_errors": self.connection_errors, "fast_failures": self.fast_failures}
