"""``kvtier config check`` and friends, run in-process: sizing from a model's config, paths with
``~``, a config file where an operator gives one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.config.sizing import ModelKV
from kvtier.tools.cli import main

LLAMA_8B = {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
            "torch_dtype": "bfloat16"}
MLA = {"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_attention_heads": 128,
       "torch_dtype": "bfloat16"}


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvtier.yaml"
    path.write_text(text)
    return path


def test_bytes_per_token_follow_the_documented_formula() -> None:
    llama = ModelKV.from_dict(LLAMA_8B)
    assert llama.bytes_per_token == 32 * 2 * 8 * 128 * 2  # layers × 2 × KV heads × head size × dtype
    assert llama.tokens_held(1 << 30, ranks=1) == llama.tokens_held(1 << 30, ranks=8) == 8192
    mla = ModelKV.from_dict(MLA)
    assert mla.bytes_per_token == 61 * (512 + 64) * 2
    assert mla.tokens_held(8 << 30, ranks=8) == (1 << 30) // mla.bytes_per_token  # a copy per rank
    assert mla.tokens_held(8 << 30, ranks=8, whole=True) == (8 << 30) // mla.bytes_per_token
    assert ModelKV.from_dict(LLAMA_8B, kv_dtype="fp8").bytes_per_token == llama.bytes_per_token // 2


def test_config_check_with_a_model_prints_tokens_per_gib_per_tier(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "config.json"
    model.write_text(json.dumps(LLAMA_8B))
    cfg = _config(tmp_path, f"tiers:\n  - {{backend: cpu, capacity: 1GiB}}\n  - {{backend: lmdb, path: {tmp_path}/db, capacity: 4GiB}}\n")
    assert main(["config", "check", str(cfg), "--model", str(model), "--tp", "2", "--no-deploy-check"]) == 0
    out = capsys.readouterr().out
    assert "32 layers × 2 (K, V) × 8 KV heads × 128 head size × 2 B (bfloat16) = 128.0KiB of KV per token" in out
    assert "a block of 16 tokens: 2.0MiB, 1.0MiB per rank at TP=2" in out
    rows = [line.split() for line in out.splitlines()]
    assert ["0", "cpu", "1.0GiB", "8,192", "8,192"] in rows
    assert ["1", "lmdb", "4.0GiB", "32,768", "8,192"] in rows
    assert main(["config", "check", str(cfg), "--model", str(tmp_path), "--no-deploy-check", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["bytes_per_token"] == 131072 and data["model"]["block_bytes"] == 2 << 20


def test_a_model_config_without_its_layers_is_an_error_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "config.json"
    model.write_text(json.dumps({"hidden_size": 4096}))
    cfg = _config(tmp_path, "tiers:\n  - {backend: cpu, capacity: 1GiB}\n")
    assert main(["config", "check", str(cfg), "--model", str(model), "--no-deploy-check"]) == 1
    assert "num_hidden_layers is None; expected a positive integer" in capsys.readouterr().err


def _lmdb_tier(path: Path, blocks: int) -> None:
    import asyncio

    from kvtier import registry
    from kvtier.backend import BlockFormat
    from kvtier.testing import make_key, random_block

    backend = registry.backends.get("lmdb")(capacity="16MiB", path=str(path), sync_mode="fast")
    fmt = BlockFormat(block_bytes=4096, dtype="bfloat16", namespace_digest=b"\1" * 32, namespace={"model_id": "ranks"})

    async def fill() -> None:
        await backend.open(fmt)
        await backend.write([make_key(i) for i in range(blocks)], [random_block(4096, i) for i in range(blocks)])
        await backend.aclose()

    asyncio.run(fill())


def test_inspect_and_verify_walk_the_per_rank_folders_of_an_engines_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import lmdb

    root = tmp_path / "kv"  # the path in a vLLM config at TP=2
    _lmdb_tier(root / "r0-of-2", 3)
    _lmdb_tier(root / "r1-of-2", 5)
    assert main(["inspect", str(root), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(Path(t["path"]).name, t["blocks"]) for t in data["tiers"]] == [("r0-of-2", 3), ("r1-of-2", 5)]
    assert main(["inspect", str(root)]) == 0
    out = capsys.readouterr().out
    assert str(root / "r0-of-2") in out and str(root / "r1-of-2") in out
    env = lmdb.open(str(root / "r1-of-2"), max_dbs=3, subdir=True)
    with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
        key, value = next(iter(txn.cursor()))
        txn.put(key, bytes(value[:-1]) + bytes([value[-1] ^ 0xFF]))
    env.close()
    assert main(["verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert f"{root / 'r0-of-2'}: checked 3 records, 0 bad" in out and f"{root / 'r1-of-2'}: checked 5 records, 1 bad" in out
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    assert main(["verify", str(tmp_path / "empty")]) == 1
    assert "r<rank>-of-<world>" in capsys.readouterr().err


def test_clear_deletes_a_configs_tier_folders_and_nothing_else(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "kv"
    _lmdb_tier(root / "r0-of-2", 2)
    _lmdb_tier(root / "r1-of-2", 2)
    (root / "notes.txt").write_text("keep me")
    cfg = _config(tmp_path, f"tiers:\n  - {{backend: cpu, capacity: 1GiB}}\n  - {{backend: lmdb, path: {root}, capacity: 1GiB}}\n")
    assert main(["clear", "--config", str(cfg)]) == 1  # no terminal to ask on, no --yes: nothing deleted
    assert "not deleting without --yes" in capsys.readouterr().err
    assert (root / "r0-of-2").is_dir()
    with pytest.raises(SystemExit):
        main(["clear", str(cfg)])  # the file goes after --config
    capsys.readouterr()
    assert main(["clear", "--config", str(cfg), "--tier", "5", "--yes"]) == 1
    assert "--tier: 5 is not a tier of this config (it has tiers 0 to 1)" in capsys.readouterr().err
    assert main(["clear", "--config", str(cfg), "--yes"]) == 0
    out = capsys.readouterr().out
    assert "tiers[0] (cpu): a memory tier" in out and f"folder {root / 'r1-of-2'}" in out
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt"]
    assert main(["clear", "--config", str(cfg), "--tier", "1", "--yes"]) == 0
    assert "nothing to delete" in capsys.readouterr().out


def test_clear_deletes_a_redis_tiers_keys_under_its_prefixes_only(
    redis_server: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import redis

    url = redis_server.url  # type: ignore[attr-defined]
    client = redis.Redis.from_url(url)
    client.set("clr36:0123456789abcdef:k1", b"x")
    client.set("clr36.r1-of-2:0123456789abcdef:k2", b"x")
    client.set("clr36other:k3", b"x")
    cfg = _config(tmp_path, f"tiers:\n  - {{backend: redis, url: '{url}', prefix: clr36, capacity: 64MiB}}\n")
    assert main(["clear", "--config", str(cfg), "--yes"]) == 0
    assert "2 redis" in capsys.readouterr().out
    assert client.exists("clr36:0123456789abcdef:k1", "clr36.r1-of-2:0123456789abcdef:k2") == 0
    assert client.get("clr36other:k3") == b"x"
    client.delete("clr36other:k3")
    client.close()


def test_config_show_and_cache_clear_take_a_config_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = _config(tmp_path, "tiers:\n  - {backend: lmdb, path: ~/kv, capacity: 1GiB}\n")
    assert main(["config", "show", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert f"path: {tmp_path / 'home' / 'kv'}" in out and "write: through" in out
    assert main(["cache", "clear", str(cfg)]) == 1
    assert f"kvtier clear --config {cfg}" in capsys.readouterr().err


def test_a_warning_repeated_back_to_back_is_shown_once(capsys: pytest.CaptureFixture[str]) -> None:
    """Two instances of a Redis tier (kvtier sim's emptying pass, then its store) both report the
    same server down: the operator reads it once; news in between shows the repeat again."""
    import logging

    from kvtier.tools.cli import _WarningsToStderr

    handler = _WarningsToStderr()
    log = logging.getLogger("kvtier.test36")
    log.addHandler(handler)
    try:
        down = "redis: redis://127.0.0.1:1/0 unreachable (ConnectionError); stores fail and loads miss until it is back"
        log.warning(down)
        log.warning(down)
        log.warning("redis: redis://127.0.0.1:1/0 is back after 1.0 s")
        log.warning(down)
    finally:
        log.removeHandler(handler)
    err = capsys.readouterr().err
    assert err.count("unreachable") == 2 and err.count("is back after") == 1
