"""An example kvtier plugin, shown in kvtier's docs/plugins.md and tested in kvtier's CI.

``DictBackend`` keeps records in a dict (a byte backend: the transfer engine reaches it through
the staging buffer), ``FifoPolicy`` evicts in insertion order, ``FlipCodec`` inverts every bit
(lossless and never smaller, so kvtier stores records raw: it only demonstrates registration).
"""

from kvtier_dict_backend.backend import DictBackend
from kvtier_dict_backend.codec import FlipCodec
from kvtier_dict_backend.policy import FifoPolicy

__all__ = ["DictBackend", "FifoPolicy", "FlipCodec"]
