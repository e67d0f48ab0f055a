"""The config layer: what an operator writes, and whether this machine can run it.

It owns the store config schema and its loading from dicts, files and the environment
(``loader``), the deployability checks (``deploy``) and the default cache directory
(``cache``). It builds backends through the plugin registry; it never runs a job or holds
key state.
"""

from kvtier.config.head_groups import HeadGroupsConfig
from kvtier.config.loader import (
    ENV_PREFIX,
    MetricsConfig,
    StoreConfig,
    TierConfig,
    apply_env,
    build_backend,
    default_config,
    load_config,
    load_config_file,
    read_config_file,
)

__all__ = [
    "ENV_PREFIX",
    "HeadGroupsConfig",
    "MetricsConfig",
    "StoreConfig",
    "TierConfig",
    "apply_env",
    "build_backend",
    "default_config",
    "load_config",
    "load_config_file",
    "read_config_file",
]
