"""Every public name imports from its documented path, and the paths of kvtier 0.2 still work.

The modules moved into layer packages (``kvtier.manager``, ``kvtier.transfer``,
``kvtier.records``, ``kvtier.config``, ``kvtier.tools``); an old path is the same module object
as its new one, so a plugin written against 0.2 keeps working unchanged.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys

import pytest

from kvtier import _moved

#: (documented module path, public names it must export)
PUBLIC: list[tuple[str, list[str]]] = [
    (
        "kvtier",
        ["open", "KVStore", "Namespace", "block_keys", "fold_block_hashes", "KVLayout", "TierManager", "KEY_BYTES",
         "KVTierError", "ConfigError", "BackendError", "CorruptBlockError", "LayoutError", "LifecycleError",
         "MissingDependencyError", "PluginLoadError", "UnknownNameError", "ClosedError", "DiskError",
         "InvalidKeyError", "__version__"],
    ),
    ("kvtier.errors", ["KVTierError", "ConfigError", "CorruptBlockError", "LifecycleError", "BackendError"]),
    ("kvtier.keys", ["Namespace", "block_keys", "fold_block_hashes", "KEY_BYTES"]),
    ("kvtier.units", ["parse_size", "format_size"]),
    ("kvtier.registry", ["backends", "codecs", "policies", "load_object"]),
    ("kvtier.backend", ["Backend", "MemoryBackend", "BlockFormat", "RecordInfo"]),
    ("kvtier.store", ["KVStore", "open"]),
    ("kvtier.metrics", []),
    ("kvtier.testing", ["BackendTests", "make_key", "random_block", "cached_pages", "evict_from_page_cache"]),
    ("kvtier.manager", ["TierManager", "TierSpec", "StorePlan", "LoadPlan", "Demotion", "KeyState", "KeyStatus",
                        "CacheEvent"]),
    ("kvtier.manager.policies", ["EvictionPolicy", "LRUPolicy", "ARCPolicy"]),
    ("kvtier.transfer", ["TransferEngine", "JobResult"]),
    ("kvtier.transfer.layout", ["KVLayout"]),
    ("kvtier.transfer.jobs", ["apply_result", "JobResult"]),
    ("kvtier.records.codec", ["Codec", "NoneCodec", "resolve_codec", "codec_for_id"]),
    ("kvtier.records.format", ["RecordMac", "encode_record", "decode_record", "parse_header", "StoreMeta"]),
    ("kvtier.records.checks", ["copy_and_check", "fill_and_check", "side_pool"]),
    ("kvtier.config", ["StoreConfig", "TierConfig", "load_config", "load_config_file", "default_config",
                       "build_backend"]),
    ("kvtier.config.deploy", ["check_deployment"]),
    ("kvtier.tools", ["inspect_tier", "verify_tier", "detect_tier", "TierReport", "VerifyReport"]),
    ("kvtier.tools.cli", ["main"]),
    ("kvtier.connector", ["SchedulerConnector", "WorkerConnector", "ConnectorConfig", "SchedulerStep",
                          "StepMetadata", "WorkerOutput", "Request", "LoadJob", "StoreJob", "JobReport",
                          "ConnectorUpdate", "ConnectorError", "FenceIndex", "DeleteLedger"]),
    ("kvtier.sim", []),
    ("kvtier.integrations.vllm", ["kv_transfer_config", "engine_stats", "MODULE_PATH"]),
    ("kvtier.integrations.transformers", ["attach", "TransformersKVTier", "PrefixMatch"]),
    ("kvtier.backends.memory", ["CpuBackend", "GpuBackend"]),
    ("kvtier.backends.lmdb_tier", ["LmdbBackend"]),
    ("kvtier.backends.file_tier", ["FileBackend"]),
    ("kvtier.backends.compressed", ["CompressedBackend"]),
    ("kvtier.backends.redis_tier", ["RedisBackend"]),
    ("kvtier.backends.codecs", ["ZstdCodec", "ZstdShuffleCodec"]),
    ("kvtier.backends.shared_index", ["SharedIndexView"]),
    ("kvtier.backends.remote_tier", ["RemoteRecordBackend", "ReadJob", "WriteJob", "Route", "SweepSkipped"]),
    ("kvtier.backends.remote_health", ["Health", "Down", "Busy"]),
    ("kvtier.backends.remote_secrets", ["Secret", "read_secret", "HIDDEN"]),
    ("kvtier.backends.remote_meta", ["MetaVerdict", "judge_meta", "meta_value"]),
    ("kvtier.backends.remote_shares", ["split_shares", "auto_job_connections", "run_all"]),
    ("kvtier.backends.feed_follower", ["TierFollower", "TierChange", "FollowedTier"]),
    ("kvtier.backends.change_feed", ["ChangeFeed", "FeedEntry", "FeedCursor", "FeedRead", "FeedOp"]),
    ("kvtier.backends.file_feed", ["FileFeed"]),
    ("kvtier.backends.redis_feed", ["RedisFeed"]),
]


@pytest.mark.parametrize(("path", "names"), PUBLIC, ids=[p for p, _ in PUBLIC])
def test_a_public_name_imports_from_its_documented_path(path: str, names: list[str]) -> None:
    module = importlib.import_module(path)
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, f"{path} lacks {missing}"


#: old path -> (new path, names a 0.2 user imported from it)
OLD_NAMES: dict[str, list[str]] = {
    "kvtier.policies": ["EvictionPolicy", "LRUPolicy", "ARCPolicy"],
    "kvtier.codec": ["Codec", "NoneCodec", "resolve_codec"],
    "kvtier.record": ["RecordMac", "encode_record", "decode_record"],
    "kvtier.record_jobs": ["copy_and_check"],
    "kvtier.layout": ["KVLayout"],
    "kvtier.jobs": ["apply_result"],
    "kvtier.deploy": ["check_deployment"],
    "kvtier.shared_index": ["SharedIndexView"],
    "kvtier.cli": ["main"],
    "kvtier.backends.redis_shares": ["split_shares", "auto_job_connections", "run_all"],
    "kvtier.backends.redis_meta": ["MetaVerdict", "judge_meta", "meta_value"],
}


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_an_old_path_is_the_module_at_its_new_path(old: str) -> None:
    new = importlib.import_module(_moved.MOVED[old])
    assert importlib.import_module(old) is new
    assert sys.modules[old] is new
    assert new.__name__ == _moved.MOVED[old]
    assert new.__spec__ is not None and new.__spec__.name == _moved.MOVED[old]  # not the alias's spec
    for name in OLD_NAMES.get(old, []):
        assert getattr(importlib.import_module(old), name) is getattr(new, name)


def test_an_old_submodule_path_maps_under_its_moved_package() -> None:
    assert importlib.import_module("kvtier.bench.plot") is importlib.import_module("kvtier.tools.bench.plot")
    assert _moved.new_path("kvtier.bench.scripts.bench_core") == "kvtier.tools.bench.scripts.bench_core"
    assert _moved.new_path("kvtier.store") is None
    assert _moved.new_path("kvtier.records") is None  # kvtier.record is moved, kvtier.records is not it
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("kvtier.no_such_module")


def test_old_import_statements_work_in_a_fresh_interpreter() -> None:
    code = (
        "from kvtier.policies import EvictionPolicy\n"
        "from kvtier.codec import Codec\n"
        "from kvtier.manager import TierManager\n"
        "from kvtier.transfer import TransferEngine\n"
        "from kvtier.config import load_config\n"
        "from kvtier.tools import verify_tier\n"
        "import kvtier.manager.policies as p\n"
        "assert EvictionPolicy is p.EvictionPolicy\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_every_entry_point_of_kvtier_loads() -> None:
    dist = importlib.metadata.distribution("kvtier")
    eps = [ep for ep in dist.entry_points if ep.group.startswith("kvtier") or ep.group == "console_scripts"]
    assert {ep.group for ep in eps} >= {"kvtier.backends", "kvtier.codecs", "kvtier.policies", "console_scripts"}
    for ep in eps:
        assert ep.load() is not None, ep
    (cli,) = [ep for ep in eps if ep.group == "console_scripts" and ep.name == "kvtier"]
    assert cli.value == "kvtier.tools.cli:main"


def test_import_kvtier_does_not_import_torch_until_a_name_needs_it() -> None:
    """``import kvtier`` (and ``kvtier --help``) took seconds importing torch; the names that need
    it are imported on first use, and are the same objects as at their modules."""
    import subprocess
    import sys

    probe = (
        "import sys, kvtier, kvtier.tools.cli, kvtier.sim.cli, kvtier.config\n"
        "print('torch' in sys.modules)\n"
        "from kvtier.store import KVStore, open as store_open\n"
        "print(kvtier.KVStore is KVStore and kvtier.open is store_open and 'Namespace' in dir(kvtier))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True"]
