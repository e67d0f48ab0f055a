"""The kvtier exception hierarchy.

Every error kvtier raises derives from :class:`KVTierError` and also from the builtin that
matches its meaning, so ``except ValueError`` keeps working for callers that do not know us.
Errors are raised *before* any state changes. Running out of capacity is not an error: it is a
``None`` from ``prepare_store`` and a counter.
"""

from __future__ import annotations

__all__ = [
    "KVTierError",
    "ConfigError",
    "InvalidKeyError",
    "LayoutError",
    "BackendError",
    "DiskError",
    "CorruptBlockError",
    "LifecycleError",
    "ClosedError",
    "UnknownNameError",
    "MissingDependencyError",
    "PluginLoadError",
    "QuotaError",
]


class KVTierError(Exception):
    """Root of every kvtier error."""


class ConfigError(KVTierError, ValueError):
    """A configuration value is missing, malformed or impossible."""


class InvalidKeyError(KVTierError, ValueError):
    """A block key has the wrong type or length."""


class LayoutError(KVTierError, ValueError):
    """KV cache tensors, block ids or shapes do not match what the store expects."""


class BackendError(KVTierError, RuntimeError):
    """A backend failed to do its work; foreign errors are chained with ``raise ... from``."""


class DiskError(BackendError, OSError):
    """A disk-backed tier hit an I/O error (ENOSPC, EIO, a full LMDB map, ...)."""


class CorruptBlockError(KVTierError, ValueError):
    """A stored record failed its checksum or header checks. It is deleted and served as a miss."""


class LifecycleError(KVTierError, RuntimeError):
    """A call out of order: completing keys never prepared, unpinning keys never pinned, ..."""


class ClosedError(LifecycleError):
    """The store, tier or backend was used after ``aclose()``."""


class UnknownNameError(ConfigError, LookupError):
    """A backend, codec or policy name is not registered. The message lists the known names."""


class MissingDependencyError(KVTierError, ImportError):
    """An optional dependency is not installed. The message says what to install."""


class PluginLoadError(ConfigError):
    """A plugin's entry point failed to load: its module raised on import, or it names an object
    the module does not have. The message names the distribution and the entry point."""


class QuotaError(KVTierError, ValueError):
    """A tenant quota or a pin the tier cannot grant: a quota larger than the tier, quotas that
    reserve more than the tier holds, a pin over the tier's pin budget. Raised before anything
    changes."""
