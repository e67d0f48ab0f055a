"""kvtier: a tiered, persistent KV cache for LLM inference engines.

The names that need torch (:class:`KVStore`, :func:`open`, :class:`TierManager`,
:class:`KVLayout`) are imported on first use, so ``import kvtier`` and the ``kvtier`` command's
quick answers (``--help``, ``config check``) do not pay for importing torch.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvtier import _moved, _source_tree
from kvtier._lazy import lazy_exports
from kvtier.errors import (
    BackendError,
    ClosedError,
    ConfigError,
    CorruptBlockError,
    DiskError,
    InvalidKeyError,
    KVTierError,
    LayoutError,
    LifecycleError,
    MissingDependencyError,
    PluginLoadError,
    UnknownNameError,
)

if TYPE_CHECKING:
    from kvtier.keys import KEY_BYTES, Namespace, block_keys, fold_block_hashes
    from kvtier.manager import TierManager
    from kvtier.store import KVStore, open
    from kvtier.transfer.layout import KVLayout

__version__ = "0.2.0"

# A library prints nothing unless the application configures logging: every kvtier.* logger
# propagates here, whichever module logs first (not only once the store module is imported).
logging.getLogger("kvtier").addHandler(logging.NullHandler())

_source_tree.install()  # from a checkout, kvtier.backends is the checkout's backends/ folder
_moved.install()  # the module paths of kvtier 0.2 keep working (kvtier.policies, kvtier.codec, ...)

#: public name -> the module it lives in, imported on first use
_LAZY = {
    "KEY_BYTES": "kvtier.keys",
    "Namespace": "kvtier.keys",
    "block_keys": "kvtier.keys",
    "fold_block_hashes": "kvtier.keys",
    "TierManager": "kvtier.manager",
    "KVStore": "kvtier.store",
    "open": "kvtier.store",
    "KVLayout": "kvtier.transfer.layout",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = [
    "KEY_BYTES",
    "BackendError",
    "ClosedError",
    "ConfigError",
    "CorruptBlockError",
    "DiskError",
    "InvalidKeyError",
    "KVLayout",
    "KVStore",
    "KVTierError",
    "LayoutError",
    "LifecycleError",
    "MissingDependencyError",
    "Namespace",
    "PluginLoadError",
    "TierManager",
    "UnknownNameError",
    "__version__",
    "block_keys",
    "fold_block_hashes",
    "open",
]
