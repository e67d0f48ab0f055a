"""Config files, validation messages, environment overrides and round trips."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import kvtier
from kvtier import registry
from kvtier.config import (
    MetricsConfig,
    StoreConfig,
    TierConfig,
    apply_env,
    build_backend,
    default_config,
    load_config,
    load_config_file,
)
from kvtier.errors import ConfigError


def need(reg: registry.Registry, name: str) -> None:
    if name not in reg.names():
        pytest.skip(f"{reg.kind} {name!r} is not registered in this checkout")


BASE = {"tiers": [{"backend": "cpu", "capacity": "1MiB"}]}


def error_of(config: dict, **kwargs: object) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config, **kwargs)  # type: ignore[arg-type]
    return str(info.value)


# -- files -----------------------------------------------------------------------------------


def test_yaml_and_toml_files_give_the_same_config(tmp_path: Path) -> None:
    yml = tmp_path / "c.yaml"
    yml.write_text("block_bytes: 64KiB\nwrite: through\npolicy: arc\ntiers:\n  - {backend: cpu, capacity: 1MiB, name: host}\n")
    toml = tmp_path / "c.toml"
    toml.write_text('block_bytes = "64KiB"\nwrite = "through"\npolicy = "arc"\n[[tiers]]\nbackend = "cpu"\ncapacity = "1MiB"\nname = "host"\n')
    a = load_config_file(yml, env=False)
    b = load_config_file(toml, env=False)
    assert a == b
    assert a.block_bytes == 65536 and a.tiers[0].capacity == 2**20 and a.write == "through"


def test_file_errors_name_the_file_and_the_field(tmp_path: Path) -> None:
    path = tmp_path / "store.yaml"
    path.write_text("tiers:\n  - {backend: cpu, capacity: 1MiB}\n  - {backend: cpu, capacity: 4 GiBs}\n")
    with pytest.raises(ConfigError) as info:
        load_config_file(path, env=False)
    message = str(info.value)
    assert str(path) in message and "tiers[1].capacity" in message and "byte size" in message


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config_file(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.toml"
    bad.write_text("tiers = [")
    with pytest.raises(ConfigError, match=r"bad\.toml: not valid TOML"):
        load_config_file(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match=r"scalar\.yaml: expected a mapping"):
        load_config_file(scalar)


def test_kvtier_open_accepts_a_file(tmp_path: Path) -> None:
    path = tmp_path / "store.yaml"
    path.write_text("block_bytes: 4096\ntiers:\n  - {backend: cpu, capacity: 64KiB}\n")

    async def run() -> int:
        async with kvtier.open(str(path)) as store:
            return store.backends[0].max_blocks

    assert asyncio.run(run()) == 16


# -- validation messages ---------------------------------------------------------------------


def test_unknown_top_level_key_lists_the_known_ones() -> None:
    message = error_of({**BASE, "polcy": "arc"})
    assert "polcy" in message and "unknown key" in message and "policy" in message


def test_unknown_metrics_key_is_reported_with_its_path() -> None:
    message = error_of({**BASE, "metrics": {"prot": 1}})
    assert "metrics: unknown key 'prot' — did you mean 'port'?" in message


def test_misspelt_tier_key_is_named_with_a_suggestion_not_reported_as_missing() -> None:
    message = error_of({"tiers": [{"backend": "cpu", "capacty": "1MiB"}]})
    assert message == "config: tiers[0]: unknown key 'capacty' — did you mean 'capacity'?"


def test_unknown_keys_at_every_level_and_option_errors_come_together() -> None:
    need(registry.backends, "lmdb")
    message = error_of(
        {
            "polcy": "lru",
            "namespace": {"model_id": "m", "revison": "3"},
            "tiers": [
                {"backend": "cpu", "capacty": "1MiB"},
                {"backend": "cpu", "capacity": "1MiB", "pin_memory": "sometimes"},
                {"backend": "lmdb", "capacity": "1GiB", "path": "/tmp/x", "sync_mod": "durable"},
            ],
        }
    )
    assert "5 problems" in message
    for part in (
        "unknown key 'polcy' — did you mean 'policy'?",
        "namespace: unknown key 'revison' — did you mean 'revision'?",
        "tiers[0]: unknown key 'capacty' — did you mean 'capacity'?",
        "tiers[2]: unknown key 'sync_mod' — did you mean 'sync_mode'?",
        # The backends still check their options in the same run.
        "tiers[1].pin_memory",
    ):
        assert part in message, part


def test_unknown_key_set_by_the_environment_names_the_variable() -> None:
    message = error_of(BASE, env={"KVTIER_TIERS__0__PIN_MEMROY": "false"})
    assert "unknown key 'pin_memroy' — did you mean 'pin_memory'? (set by KVTIER_TIERS__0__PIN_MEMROY)" in message


def test_cpu_option_list_does_not_offer_device() -> None:
    message = error_of({"tiers": [{"backend": "cpu", "capacity": "1MiB", "colour": "red"}]})
    assert "pin_memory" in message and "device" not in message
    # still accepted, for symmetry with the gpu backend
    assert load_config({"tiers": [{"backend": "cpu", "capacity": "1MiB", "device": "cpu"}]}).tiers[0].options()["device"] == "cpu"


def test_bad_size_string() -> None:
    message = error_of({"tiers": [{"backend": "cpu", "capacity": "lots"}]})
    assert message.startswith("config: tiers[0].capacity") and "'lots'" in message


def test_bad_block_bytes() -> None:
    assert "block_bytes" in error_of({**BASE, "block_bytes": "2 parsecs"})


def test_zero_capacity() -> None:
    assert "tiers[0].capacity" in error_of({"tiers": [{"backend": "cpu", "capacity": 0}]})


def test_capacity_below_one_block() -> None:
    message = error_of({"block_bytes": "2MiB", "tiers": [{"backend": "cpu", "capacity": "1MiB"}]})
    assert "tiers[0].capacity" in message and "below one block" in message
    # the block size may also come from the caller (kvtier config check --block-bytes)
    assert "below one block" in error_of(BASE, block_bytes="2MiB")


def test_unknown_backend_lists_known_backends() -> None:
    message = error_of({"tiers": [{"backend": "cpu", "capacity": "1MiB"}, {"backend": "floppy", "capacity": "1MiB"}]})
    assert "tiers[1].backend" in message and "'floppy'" in message and "cpu" in message and "gpu" in message


def test_unknown_policy_lists_known_policies() -> None:
    message = error_of({**BASE, "policy": "mru"})
    assert message.startswith("config: policy") and "lru" in message and "arc" in message
    message = error_of({"tiers": [{"backend": "cpu", "capacity": "1MiB", "policy": "mru"}]})
    assert "tiers[0].policy" in message


def test_unknown_codec_lists_known_codecs(tmp_path: Path) -> None:
    need(registry.backends, "lmdb")
    message = error_of({"tiers": [{"backend": "lmdb", "capacity": "1MiB", "path": str(tmp_path), "codec": "lzma"}]})
    assert "tiers[0].codec" in message and "'lzma'" in message and "none" in message


def test_missing_path_for_a_disk_backend() -> None:
    need(registry.backends, "lmdb")
    message = error_of({"tiers": [{"backend": "cpu", "capacity": "1MiB"}, {"backend": "lmdb", "capacity": "1GiB"}]})
    assert "tiers[1].path" in message


def test_unknown_backend_option_names_the_option_and_accepted_ones() -> None:
    message = error_of({"tiers": [{"backend": "cpu", "capacity": "1MiB", "colour": "red"}]})
    assert "tiers[0]: unknown key 'colour'" in message and "pin_memory" in message


def test_option_rejected_by_the_backend_names_the_option() -> None:
    message = error_of({"tiers": [{"backend": "cpu", "capacity": "1MiB", "pin_memory": "sometimes"}]})
    assert "tiers[0].pin_memory" in message


def test_bad_write_mode_and_missing_tiers() -> None:
    assert "write" in error_of({**BASE, "write": "around"})
    assert "tiers" in error_of({})
    assert "at least one tier" in error_of({"tiers": []})


def test_bad_namespace() -> None:
    assert "namespace" in error_of({**BASE, "namespace": {"model_id": "m", "tp_rank": 3, "tp_size": 2}})


def test_a_namespace_override_alone_takes_the_defaults_and_its_errors_name_the_field() -> None:
    message = error_of(BASE, env={"KVTIER_NAMESPACE__TP_RANK": "3"})
    assert "namespace.tp_rank (set by KVTIER_NAMESPACE__TP_RANK): expected 0 <= tp_rank < tp_size, got 3" in message
    assert "namespace.tp_size is 1 unless set" in message and "KVTIER_NAMESPACE__TP_SIZE" in message
    assert "__init__" not in message and "positional" not in message
    cfg = load_config(BASE, env={"KVTIER_NAMESPACE__TP_RANK": "3", "KVTIER_NAMESPACE__TP_SIZE": "4"})
    assert cfg.namespace == {"tp_rank": 3, "tp_size": 4}  # as given: an engine integration fills in its model
    assert cfg.namespace_fields() == {"model_id": "default", "tp_rank": 3, "tp_size": 4}
    store = kvtier.KVStore(load_config({**BASE, "block_bytes": 4096, "namespace": {"tp_size": 2, "tp_rank": 1}}))
    assert (store.namespace.model_id, store.namespace.tp_rank) == ("default", 1)


def test_a_namespace_without_a_model_names_the_field() -> None:
    from kvtier.keys import Namespace

    with pytest.raises(ConfigError, match=r"^namespace\.model_id: required setting is missing$"):
        Namespace.from_dict({"tp_rank": 0})


def test_all_problems_come_in_one_error() -> None:
    message = error_of({"polcy": 1, "tiers": [{"backend": "cpu", "capacity": "x"}]})
    assert "2 problems" in message and "polcy" in message and "tiers[0].capacity" in message


def test_build_backend_translates_errors_with_the_tier_index() -> None:
    tier = TierConfig(backend="cpu", capacity=2**20, colour="red")  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match=r"tiers\[3\]\.colour"):
        build_backend(tier, 3)


# -- environment -----------------------------------------------------------------------------


def test_environment_overrides() -> None:
    env = {"KVTIER_POLICY": "arc", "KVTIER_WRITE": "through", "KVTIER_TIERS__0__CAPACITY": "4GiB", "HOME": "/x"}
    cfg = load_config(BASE, env=env)
    assert (cfg.policy, cfg.write, cfg.tiers[0].capacity) == ("arc", "through", 4 * 2**30)


def test_environment_values_are_yaml_scalars_and_index_appends() -> None:
    env = {
        "KVTIER_TIERS__1__BACKEND": "cpu",
        "KVTIER_TIERS__1__CAPACITY": "2MiB",
        "KVTIER_TIERS__1__PIN_MEMORY": "false",
        "KVTIER_STAGING_BLOCKS": "8",
        "KVTIER_NAMESPACE__MODEL_ID": "m",
        "KVTIER_NAMESPACE__REVISION": '"0123"',
    }
    cfg = load_config(BASE, env=env)
    assert cfg.tiers[1].options()["pin_memory"] is False
    assert cfg.staging_blocks == 8
    assert cfg.namespace == {"model_id": "m", "revision": "0123"}


def test_environment_errors_name_the_variable(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("tiers:\n  - {backend: cpu, capacity: 1MiB}\n")
    with pytest.raises(ConfigError) as info:
        load_config_file(path, env={"KVTIER_TIERS__0__CAPACITY": "huge"})
    message = str(info.value)
    assert str(path) in message and "tiers[0].capacity" in message and "KVTIER_TIERS__0__CAPACITY" in message
    with pytest.raises(ConfigError, match="KVTIER_POLCY"):
        load_config(BASE, env={"KVTIER_POLCY": "arc"})
    with pytest.raises(ConfigError, match=r"KVTIER_TIERS__5__CAPACITY.*tiers\[5\]"):
        load_config(BASE, env={"KVTIER_TIERS__5__CAPACITY": "1GiB"})


def test_kvtier_config_variable_is_not_an_override() -> None:
    data, origins = apply_env(BASE, {"KVTIER_CONFIG": "/etc/kvtier.yaml"})
    assert data == BASE and origins == {}


def test_dicts_ignore_the_environment_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_POLICY", "arc")
    assert load_config(BASE).policy == "lru"
    assert load_config(BASE, env=True).policy == "arc"


# -- defaults and round trips ----------------------------------------------------------------


def test_default_config_is_cpu_then_lmdb_in_the_user_cache() -> None:
    from platformdirs import user_cache_dir

    data = default_config()
    assert [t["backend"] for t in data["tiers"]] == ["cpu", "lmdb"]
    assert data["tiers"][1]["path"].startswith(user_cache_dir("kvtier"))
    data["tiers"].clear()
    assert default_config()["tiers"], "default_config must return a fresh dict"
    need(registry.backends, "lmdb")
    assert load_config(default_config()).tiers[1].backend == "lmdb"


def test_store_config_round_trips() -> None:
    cfg = load_config(
        {
            "tiers": [{"backend": "cpu", "capacity": "1MiB", "name": "host", "policy": "arc"}],
            "write": "through",
            "block_bytes": "4KiB",
            "engine_blocks_per_block": 2,
            "namespace": {"model_id": "m", "tp_size": 2},
            "metrics": {"prometheus": True, "store_label": "a"},
        }
    )
    data = cfg.to_dict()
    assert data["tiers"][0]["capacity"] == 2**20
    again = load_config(data)
    assert again == cfg and again.to_dict() == data
    assert StoreConfig.from_dict(data) == cfg
    for tier in cfg.tiers:
        assert TierConfig.from_dict(tier.to_dict()) == tier
    assert MetricsConfig(**cfg.metrics.to_dict()) == cfg.metrics


def _backend_configs(tmp_path: Path) -> list[dict]:
    return [
        {"backend": "cpu", "capacity": "1MiB", "pin_memory": False},
        {"backend": "gpu", "capacity": "1MiB", "device": "cuda:1"},
        {"backend": "lmdb", "capacity": "1GiB", "path": str(tmp_path / "l"), "codec": "zstd", "sync_mode": "fast"},
        {"backend": "file", "capacity": "1GiB", "path": str(tmp_path / "f")},
        {"backend": "compressed", "capacity": "1GiB"},
    ]


@pytest.mark.parametrize("index", range(5))
def test_every_backend_round_trips(tmp_path: Path, index: int) -> None:
    data = _backend_configs(tmp_path)[index]
    need(registry.backends, data["backend"])
    tier = load_config({"tiers": [data]}).tiers[0]
    backend = build_backend(tier)
    dumped = backend.to_dict()
    assert dumped["backend"] == data["backend"] and dumped["capacity"] == tier.capacity
    again = type(backend).from_dict(dumped)
    assert again.to_dict() == dumped
    # a backend's to_dict() is itself a valid tier config
    assert build_backend(load_config({"tiers": [dumped]}).tiers[0]).to_dict() == dumped


@pytest.mark.parametrize(("name", "options"), [("none", {}), ("zstd", {"level": 5}), ("zstd-shuffle", {"level": 2})])
def test_every_codec_round_trips(name: str, options: dict) -> None:
    need(registry.codecs, name)
    cls = registry.codecs.get(name)
    codec = cls.from_dict({"name": name, **options})
    data = codec.to_dict()
    assert data["name"] == name and all(data[k] == v for k, v in options.items())
    assert cls.from_dict(data) == codec and cls.from_dict(data).to_dict() == data


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_every_policy_round_trips(name: str) -> None:
    cfg = load_config({**BASE, "policy": name})
    policy = registry.policies.get(cfg.policy)(capacity=4)
    assert policy.to_dict() == {"policy": name}
    assert load_config({**BASE, **policy.to_dict()}).policy == name


def test_admit_after_is_a_manager_option_not_a_backend_option() -> None:
    cfg = load_config({"tiers": [{"backend": "cpu", "capacity": "1MiB", "admit_after": 3}]})
    assert cfg.tiers[0].admit_after == 3 and "admit_after" not in cfg.tiers[0].options()
    assert load_config(cfg.to_dict()) == cfg
    assert "tiers[0].admit_after" in error_of({"tiers": [{"backend": "cpu", "capacity": "1MiB", "admit_after": 0}]})


def test_home_and_environment_variables_in_tier_paths_are_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.config import load_config

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KV_ROOT", str(tmp_path / "fast"))
    cfg = load_config({"tiers": [
        {"backend": "lmdb", "capacity": "64MiB", "path": "~/kvtier-cache"},
        {"backend": "file", "capacity": "64MiB", "path": "${KV_ROOT}/files/x"},
        {"backend": "file", "capacity": "64MiB", "path": "relative/files"},
    ]})
    paths = [t.options()["path"] for t in cfg.tiers]
    assert paths == [str(tmp_path / "home" / "kvtier-cache"), str(tmp_path / "fast" / "files" / "x"), "relative/files"]


def test_an_unset_variable_in_a_path_is_an_error_naming_the_tier_option(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from kvtier.config import load_config

    monkeypatch.delenv("KVTIER_TEST_UNSET_ROOT", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.path: environment variable \$KVTIER_TEST_UNSET_ROOT .* is not set"):
        load_config({"tiers": [{"backend": "lmdb", "capacity": "64MiB", "path": "$KVTIER_TEST_UNSET_ROOT/lmdb"}]})
    assert list(tmp_path.iterdir()) == []  # no folder named '$KVTIER_TEST_UNSET_ROOT'


def test_a_store_opened_with_a_home_path_creates_no_folder_named_tilde(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)

    async def go() -> None:
        async with kvtier.open({"block_bytes": 4096, "tiers": [{"backend": "lmdb", "capacity": "1MiB", "path": "~/kv"}]}):
            pass

    asyncio.run(go())
    assert list(work.iterdir()) == []
    assert (tmp_path / "home" / "kv").is_dir()
