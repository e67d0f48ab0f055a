"""kvtier: a tiered, persistent KV cache for LLM inference engines."""

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
from kvtier.layout import KVLayout
from kvtier.manager import TierManager
from kvtier.store import KVStore, open

__version__ = "0.1.0"

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
