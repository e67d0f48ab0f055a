"""kvtier: a tiered, persistent KV cache for LLM inference engines."""

from kvtier import _moved, _source_tree
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
from kvtier.keys import KEY_BYTES, Namespace, block_keys, fold_block_hashes
from kvtier.manager import TierManager
from kvtier.store import KVStore, open
from kvtier.transfer.layout import KVLayout

__version__ = "0.1.0"

_source_tree.install()  # from a checkout, kvtier.backends is the checkout's backends/ folder
_moved.install()  # the module paths of kvtier 0.2 keep working (kvtier.policies, kvtier.codec, ...)

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
