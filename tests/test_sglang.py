"""kvtier as SGLang HiCache's storage backend, built through SGLang's own factory.

The tests that need SGLang's interface skip, naming the reason in capitals, where the wheel is
not installed (``.ci/run`` installs it; see ``tests/sglang_env.py``). The config, namespace and
page-address checks run without it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang_env import build_backend, sglang_storage

from kvtier.errors import ConfigError, LayoutError, MissingDependencyError
from kvtier.integrations import sglang as kv_sglang
from kvtier.integrations.sglang.core import SglangStore
from kvtier.integrations.sglang.identity import SglangIdentity, page_namespace
from kvtier.integrations.sglang.pages import HostPages
from kvtier.integrations.sglang.testing import HostPool
from kvtier.keys import fold_block_hashes

TESTS = Path(__file__).resolve().parent
LAYOUTS = [("page_first", False), ("layer_first", False), ("page_first", True), ("layer_first", True)]
LAYOUT_IDS = ["mha-page_first", "mha-layer_first", "mla-page_first", "mla-layer_first"]


def lmdb(path: Path, **more: Any) -> dict[str, Any]:
    return kv_sglang.extra_config({"tiers": [{"backend": "lmdb", "path": str(path), "capacity": "64MiB"}], **more})


def hashes(n: int, tag: str = "a") -> list[str]:
    return [f"{tag}{i:063x}" for i in range(n)]


@pytest.fixture
def sgl() -> types.SimpleNamespace:
    return sglang_storage()


# -- without SGLang ------------------------------------------------------------------------------


def ident(**fields: Any) -> types.SimpleNamespace:
    base = {"model_name": "org/m", "tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "is_mla_model": False}
    return types.SimpleNamespace(**{**base, **fields})


def test_extra_config_selects_the_kvtier_class() -> None:
    extra = kv_sglang.extra_config("/etc/kvtier.yaml", prefetch_threshold=64)
    assert extra["module_path"] == "kvtier.integrations.sglang"
    assert extra["class_name"] == "KvtierHiCacheStorage"
    assert extra["interface_v1"] == 1
    assert extra["kvtier"] == "/etc/kvtier.yaml"
    assert extra["prefetch_threshold"] == 64


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"kvtier": {"tiers": [{"backend": "lmdb", "path": "/x", "capacity": "1GiB"}]}}, "interface_v1"),
        ({"interface_v1": 1}, r"extra-config\.kvtier: expected a kvtier store config"),
        ({"interface_v1": 1, "kvtier": {"tiers": [{"backend": "cpu", "capacity": "1GiB"}]}}, r"tiers\[0\]\.backend: 'cpu' is a memory tier"),
        ({"interface_v1": 1, "kvtier": {"tiers": [{"backend": "lmdb", "capacity": "lots"}]}}, r"tiers\[0\]\.capacity"),
        ({"interface_v1": 1, "kvtier": {"tiers": [{"backend": "lmdb", "path": "/x", "capacity": "1GiB"}],
                                        "namespace": {"tp_rank": 3}}}, r"namespace\.tp_rank: set from SGLang"),
    ],
    ids=["no-interface-v1", "no-kvtier-entry", "memory-tier", "bad-capacity", "namespace-tp-rank"],
)
def test_config_errors_name_the_setting(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SglangStore(ident(), extra)


def test_config_file_path_is_read_and_validated(tmp_path: Path) -> None:
    good = tmp_path / "kvtier.yaml"
    good.write_text(f"tiers:\n  - backend: lmdb\n    path: {tmp_path / 'db'}\n    capacity: 64MiB\n")
    store = SglangStore(ident(), {"interface_v1": 1, "kvtier": str(good)})
    assert store.settings.store.tiers[0].backend == "lmdb"
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers:\n  - backend: lmbd\n    capacity: 64MiB\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml.*tiers\[0\]\.backend.*unknown backend 'lmbd'"):
        SglangStore(ident(), {"interface_v1": 1, "kvtier": str(bad)})


def namespace(**fields: Any) -> Any:
    layout = fields.pop("layout", "page_first")
    return page_namespace(SglangIdentity.from_storage_config(ident(**fields)), dtype="bfloat16", page_size=64,
                          layout=layout, overrides={})


def test_mla_pages_share_keys_across_ranks_and_mha_pages_do_not() -> None:
    digest = lambda **f: namespace(**f).digest  # noqa: E731
    assert digest(is_mla_model=True, tp_rank=0, tp_size=4) == digest(is_mla_model=True, tp_rank=3, tp_size=4)
    assert digest(tp_rank=0, tp_size=4) != digest(tp_rank=3, tp_size=4)
    # Another layout, TP size, PP stage or model is another namespace: never the same keys.
    assert digest(layout="page_first") != digest(layout="layer_first")
    assert digest(is_mla_model=True, tp_size=2) != digest(is_mla_model=True, tp_size=4)
    assert digest(pp_rank=1, pp_size=2) != digest(pp_rank=0, pp_size=2)
    assert digest(is_mla_model=True) != digest(is_mla_model=False)
    assert digest(model_name="org/other") != digest()
    keys = fold_block_hashes([b"page-hash"], namespace=namespace())
    assert keys != fold_block_hashes([b"page-hash"], namespace=namespace(layout="layer_first"))


def test_namespace_needs_a_model_name() -> None:
    with pytest.raises(ConfigError, match=r"namespace\.model_id: SGLang passed no model name"):
        namespace(model_name=None)


class _InterleavedPool(HostPool):
    """K and V of a page side by side, pages apart: not one contiguous run per chunk."""

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        size = 16
        ptrs = []
        for i in indices.tolist()[:: self.page_size]:
            ptrs += [self.kv_buffer.data_ptr() + (i // self.page_size) * 2 * size, self.kv_buffer.data_ptr() + (i // self.page_size) * 2 * size + size]
        return ptrs, [size] * len(ptrs)


def test_pages_refuse_a_layout_whose_chunks_interleave() -> None:
    with pytest.raises(LayoutError, match=r"chunk 0 of a page is 16 bytes but pages are 32 bytes apart"):
        HostPages(_InterleavedPool())


class _StrayPool(HostPool):
    """Answers the attach probes correctly, then names an address outside the pool."""

    stray = False

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        ptrs, sizes = super().get_page_buffer_meta(indices)
        return ([p + (1 << 40) for p in ptrs] if self.stray else ptrs), sizes


@pytest.mark.parametrize(("layout", "mla"), LAYOUTS, ids=LAYOUT_IDS)
def test_page_ids_come_from_the_pools_addresses(layout: str, mla: bool) -> None:
    pool = HostPool(layout, mla=mla)
    pages = HostPages(pool)
    assert pages.page_ids(pool.indices([5, 0, 15])) == [5, 0, 15]
    assert pages.num_pages == 16
    assert [v.shape[0] for v in pages.views] == [16] * pages.chunks
    with pytest.raises(LayoutError, match="not whole pages"):
        pages.page_ids(torch.arange(3))


def test_an_address_outside_the_pool_fails_the_call_not_a_copy(tmp_path: Path) -> None:
    pool = _StrayPool()
    store = SglangStore(ident(), lmdb(tmp_path))
    store.attach(pool)
    try:
        assert store.write(hashes(2), pool.indices([0, 1])) == [True, True]
        pool.stray = True
        before = pool.kv_buffer.clone()
        assert store.read(hashes(2), pool.indices([2, 3])) == [False, False]
        assert store.write(hashes(2, "b"), pool.indices([2, 3])) == [False, False]
        assert torch.equal(pool.kv_buffer, before)
        assert store.counters["read_errors"] == 1 and store.counters["write_errors"] == 1
    finally:
        store.close()


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed")
def test_the_sglang_class_needs_sglang() -> None:
    with pytest.raises(MissingDependencyError, match="needs SGLang"):
        kv_sglang.KvtierHiCacheStorage  # noqa: B018


# -- through SGLang's factory --------------------------------------------------------------------


def test_sglangs_factory_builds_the_kvtier_backend(sgl: types.SimpleNamespace, tmp_path: Path) -> None:
    pool = HostPool()
    backend = build_backend(sgl, pool, lmdb(tmp_path))
    try:
        assert isinstance(backend, sgl.HiCacheStorage)
        assert type(backend) is kv_sglang.KvtierHiCacheStorage
        assert backend.get_stats() is None  # SGLang then uses its own empty StorageMetrics
        assert backend.kvtier_stats()["store"]["tiers"][0]["name"] == "lmdb"
    finally:
        backend.close()
    # each rank's environment lives in its own directory under the configured path
    assert (tmp_path / "page_first-tp0of1").is_dir()


TIER_SETS = {
    "lmdb": lambda p: [{"backend": "lmdb", "path": str(p / "db"), "capacity": "64MiB"}],
    "file": lambda p: [{"backend": "file", "path": str(p / "files"), "capacity": "64MiB"}],
    "compressed+lmdb": lambda p: [
        {"backend": "compressed", "capacity": "256KiB"},
        {"backend": "lmdb", "path": str(p / "db"), "capacity": "64MiB"},
    ],
}


@pytest.mark.parametrize("tiers", list(TIER_SETS))
@pytest.mark.parametrize(("layout", "mla"), LAYOUTS, ids=LAYOUT_IDS)
def test_pages_round_trip_byte_exact(sgl: types.SimpleNamespace, tmp_path: Path, layout: str, mla: bool, tiers: str) -> None:
    pool = HostPool(layout, mla=mla)
    backend = build_backend(sgl, pool, kv_sglang.extra_config({"tiers": TIER_SETS[tiers](tmp_path)}))
    try:
        keys = hashes(6)
        want = [pool.page(p) for p in (2, 3, 4, 5, 6, 7)]
        assert backend.batch_set_v1(keys, pool.indices([2, 3, 4, 5, 6, 7])) == [True] * 6
        pool.kv_buffer.zero_()  # SGLang reuses the pages at once: the records are copies
        targets = [15, 0, 9, 1, 14, 8]
        assert backend.batch_get_v1(keys, pool.indices(targets)) == [True] * 6
        for target, page in zip(targets, want):
            assert torch.equal(pool.page(target), page)
        # batch_exists is the leading run of stored pages
        assert backend.batch_exists(keys) == 6
        assert backend.batch_exists([*keys[:2], "f" * 64, *keys[3:]]) == 2
        assert backend.batch_exists(["e" * 64, *keys]) == 0
        assert backend.exists(keys[4]) and not backend.exists("e" * 64)
        # a load stops at the first page it does not hold: the rest is SGLang's to recompute
        assert backend.batch_get_v1([*keys[:2], "f" * 64, keys[3]], pool.indices([10, 11, 12, 13])) == [True, True, False, False]
    finally:
        backend.close()


def test_two_threads_store_and_load_at_once(sgl: types.SimpleNamespace, tmp_path: Path) -> None:
    pool = HostPool(pages=32)
    backend = build_backend(sgl, pool, lmdb(tmp_path))
    originals = {p: pool.page(p) for p in range(16)}
    seeded = hashes(4, "s")
    assert backend.batch_set_v1(seeded, pool.indices([0, 1, 2, 3])) == [True] * 4
    errors: list[str] = []

    def backup() -> None:  # SGLang's backup thread: new pages, batch after batch
        for round_ in range(12):
            pages = [4 + (round_ % 3) * 4 + i for i in range(4)]
            if backend.batch_set_v1(hashes(4, f"{round_:x}"), pool.indices(pages)) != [True] * 4:
                errors.append(f"store round {round_}")

    def prefetch() -> None:  # SGLang's prefetch thread: exists, then load into pages of its own
        for round_ in range(12):
            if backend.batch_exists(seeded) != 4:
                errors.append(f"exists round {round_}")
            targets = [16 + (round_ % 4) * 4 + i for i in range(4)]
            if backend.batch_get_v1(seeded, pool.indices(targets)) != [True] * 4:
                errors.append(f"load round {round_}")
            elif not all(torch.equal(pool.page(t), originals[p]) for t, p in zip(targets, range(4))):
                errors.append(f"wrong bytes in round {round_}")

    threads = [threading.Thread(target=backup), threading.Thread(target=prefetch)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors
        for round_ in range(12):  # every page the backup thread stored is there, byte-exact
            source = [4 + (round_ % 3) * 4 + i for i in range(4)]
            assert backend.batch_get_v1(hashes(4, f"{round_:x}"), pool.indices([28, 29, 30, 31])) == [True] * 4
            assert all(torch.equal(pool.page(28 + i), originals[p]) for i, p in enumerate(source))
        stats = backend.kvtier_stats()
        assert stats["write_calls"] == 13 and stats["read_calls"] == 24
        assert stats["read_errors"] == stats["write_errors"] == stats["exists_errors"] == 0
    finally:
        backend.close()


def test_other_pools_are_refused_and_the_kv_pool_serves_the_v2_calls(sgl: types.SimpleNamespace, tmp_path: Path) -> None:
    pool = HostPool()
    backend = build_backend(sgl, pool, lmdb(tmp_path))
    try:
        with pytest.raises(ConfigError, match="'mamba' pool of this model"):
            backend.register_mem_host_pool_v2(pool, "mamba")
        backend.register_mem_host_pool_v2(pool, "kv")
        keys = hashes(3)
        want = [pool.page(p) for p in (0, 1, 2)]
        stored = backend.batch_set_v2([sgl.PoolTransfer(name="kv", host_indices=pool.indices([0, 1, 2]), keys=keys)])
        assert stored == {"kv": [True, True, True]}
        found = backend.batch_exists_v2(keys)
        assert (found.kv_hit_pages, found.restorable_prefix_pages) == (3, [1, 2, 3])
        assert backend.batch_exists_v2(keys, [sgl.PoolTransfer(name="mamba", keys=keys[:1])]).kv_hit_pages == 0
        got = backend.batch_get_v2([sgl.PoolTransfer(name="kv", host_indices=pool.indices([5, 6, 7]), keys=keys),
                                    sgl.PoolTransfer(name="swa", host_indices=pool.indices([8]), keys=keys[:1])])
        assert got == {"kv": [True, True, True], "swa": [False]}
        assert all(torch.equal(pool.page(5 + i), w) for i, w in enumerate(want))
    finally:
        backend.close()


# -- faults: full answers, never an exception ----------------------------------------------------


def test_under_sglangs_failure_injector_every_call_answers_in_full(
    sgl: types.SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.5")
    pool = HostPool()
    backend = build_backend(sgl, pool, lmdb(tmp_path))
    try:
        assert isinstance(backend, sgl.FailureInjector)  # the factory wrapped kvtier's backend
        want = {p: pool.page(p) for p in range(8)}
        outcomes = set()
        for round_ in range(20):
            keys = hashes(4, f"{round_:x}")
            stored = backend.batch_set_v1(keys, pool.indices([0, 1, 2, 3]))
            assert isinstance(stored, list) and len(stored) == 4
            hits = backend.batch_exists(keys)
            assert isinstance(hits, int) and 0 <= hits <= 4
            loaded = backend.batch_get_v1(keys, pool.indices([8, 9, 10, 11]))
            assert isinstance(loaded, list) and len(loaded) == 4
            for i, ok in enumerate(loaded):
                if ok:  # a page reported loaded holds exactly the stored bytes
                    assert torch.equal(pool.page(8 + i), want[i])
            outcomes.add(all(loaded))
        assert outcomes == {True, False}  # both kinds of answer were exercised
    finally:
        backend.close()


def test_a_damaged_record_is_a_miss_and_a_counter(sgl: types.SimpleNamespace, tmp_path: Path) -> None:
    pool = HostPool()
    extra = kv_sglang.extra_config({"tiers": [{"backend": "file", "path": str(tmp_path), "capacity": "64MiB"}]})
    backend = build_backend(sgl, pool, extra)
    try:
        keys = hashes(3)
        assert backend.batch_set_v1(keys, pool.indices([0, 1, 2])) == [True] * 3
        record = next(p for p in tmp_path.rglob("*.kvb") if p.name.startswith(backend.kvtier.keys(keys[1:2])[0].hex()))
        raw = bytearray(record.read_bytes())
        raw[-5] ^= 0xFF
        record.write_bytes(bytes(raw))
        assert backend.batch_get_v1(keys, pool.indices([5, 6, 7])) == [True, False, False]
        assert backend.kvtier_stats()["store"]["backends"][0]["corrupt_records"] == 1
        assert backend.batch_exists(keys) == 1  # the damaged record is forgotten
    finally:
        backend.close()


def test_a_dead_redis_server_is_false_never_an_exception(sgl: types.SimpleNamespace, own_redis_server: Any) -> None:
    pool = HostPool()
    extra = kv_sglang.extra_config({"tiers": [{"backend": "redis", "url": own_redis_server.url, "capacity": "64MiB"}]})
    backend = build_backend(sgl, pool, extra)
    try:
        assert backend.batch_set_v1(hashes(2), pool.indices([0, 1])) == [True, True]
        own_redis_server.kill()
        assert backend.batch_set_v1(hashes(2, "b"), pool.indices([2, 3])) == [False, False]
        assert backend.batch_get_v1(hashes(2), pool.indices([4, 5])) == [False, False]
        assert isinstance(backend.batch_exists(hashes(2)), int)  # the local index answers
        stats = backend.kvtier_stats()
        assert stats["pages_write_failed"] == 2 and stats["pages_read_missed"] == 2
        assert stats["write_errors"] == stats["read_errors"] == 0  # faults of the tier, not of the call
    finally:
        backend.close()


def test_bad_calls_and_calls_after_close_answer_in_full(sgl: types.SimpleNamespace, tmp_path: Path) -> None:
    pool = HostPool()
    backend = build_backend(sgl, pool, lmdb(tmp_path))
    keys = hashes(2)
    assert backend.batch_set_v1(keys, pool.indices([0, 1])) == [True, True]
    assert backend.batch_get_v1(keys, torch.arange(5)) == [False, False]  # not whole pages
    assert backend.batch_set_v1(keys, pool.indices([0])) == [False, False]  # one page for two hashes
    assert backend.batch_get(keys, [None, None]) == [None, None]  # the copying calls are misses
    assert backend.set(keys[0], pool.page(0)) is False
    stats = backend.kvtier_stats()
    assert (stats["read_errors"], stats["write_errors"], stats["legacy_calls"]) == (1, 1, 2)
    backend.close()
    assert backend.batch_get_v1(keys, pool.indices([2, 3])) == [False, False]
    assert backend.batch_set_v1(keys, pool.indices([2, 3])) == [False, False]
    assert backend.batch_exists(keys) == 0
    assert backend.clear() is False
    backend.close()  # idempotent


class _YieldingCounts(dict):  # type: ignore[type-arg]
    """Counts whose every read lets other threads run first (as a loaded host may)."""

    def __getitem__(self, name: Any) -> Any:
        time.sleep(0)
        return super().__getitem__(name)


def _legacy_call(store: SglangStore, start: threading.Barrier) -> None:
    start.wait()
    store.note_legacy_call("get")


def test_the_first_copying_call_is_logged_once_when_both_threads_make_one_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SGLang's prefetch and backup threads call at once: each copying call is counted, and the
    warning that kvtier answers them as misses is logged once, whichever thread came first."""
    for _ in range(20):
        store = SglangStore(ident(), lmdb(tmp_path))
        store.counters = _YieldingCounts(store.counters)
        start = threading.Barrier(8)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvtier.sglang"):
            threads = [threading.Thread(target=_legacy_call, args=(store, start)) for _ in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        assert store.stats()["legacy_calls"] == 8
        assert [r.getMessage() for r in caplog.records].count(
            "kvtier: SGLang called get; kvtier serves the zero-copy calls only (interface_v1)"
        ) == 1


def test_clear_forgets_and_deletes_every_record(sgl: types.SimpleNamespace, tmp_path: Path) -> None:
    pool = HostPool()
    backend = build_backend(sgl, pool, lmdb(tmp_path))
    try:
        assert backend.batch_set_v1(hashes(3), pool.indices([0, 1, 2])) == [True] * 3
        assert backend.clear() is True
        assert backend.batch_exists(hashes(3)) == 0
        assert backend.kvtier_stats()["store"]["tiers"][0]["blocks"] == 0
    finally:
        backend.close()
    reopened = build_backend(sgl, pool, lmdb(tmp_path))  # the records are gone from disk too
    try:
        assert reopened.batch_exists(hashes(3)) == 0
    finally:
        reopened.close()


# -- two processes -------------------------------------------------------------------------------


def child(spec: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, str(TESTS / "sglang_child.py"), json.dumps(spec)],
        capture_output=True, text=True, timeout=300, env=env, cwd=TESTS, check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def two_processes(extra: dict[str, Any]) -> None:
    spec = {"layout": "page_first", "mla": False, "tp_size": 1, "pages": 5, "seed": 7, "extra": extra}
    assert child({**spec, "mode": "write"}) == {"stored": [True] * 5}
    # a record written under another layout or TP size is never served
    fresh = child({**spec, "mode": "read", "variants": [{"layout": "layer_first"}, {"tp_size": 2}]})
    assert fresh.pop("variants") == [{"hits": 0, "loaded": [], "exact": []}] * 2
    assert fresh == {"hits": 5, "loaded": [True] * 5, "exact": [True] * 5}


def test_a_fresh_process_is_served_anothers_pages_through_lmdb(sgl: types.SimpleNamespace, tmp_path: Path) -> None:
    two_processes(lmdb(tmp_path))


def test_a_fresh_process_is_served_anothers_pages_through_redis(sgl: types.SimpleNamespace, redis_server: Any) -> None:
    prefix = f"sglang-{os.getpid()}"
    two_processes(kv_sglang.extra_config({"tiers": [
        {"backend": "redis", "url": redis_server.url, "prefix": prefix, "capacity": "64MiB"}]}))


def test_mla_pages_written_by_one_rank_serve_every_rank_through_redis(sgl: types.SimpleNamespace, redis_server: Any) -> None:
    extra = kv_sglang.extra_config({"tiers": [{"backend": "redis", "url": redis_server.url, "prefix": f"mla-{os.getpid()}",
                                               "capacity": "64MiB", "sync_interval_s": 0.05}]})
    writer_pool, reader_pool = HostPool(mla=True, seed=3), HostPool(mla=True, seed=4)
    writer = build_backend(sgl, writer_pool, extra, tp_rank=0, tp_size=2)
    reader = build_backend(sgl, reader_pool, extra, tp_rank=1, tp_size=2)
    try:
        keys = hashes(4, "m")
        want = [writer_pool.page(p) for p in range(4)]
        assert reader.batch_exists(keys) == 0
        assert writer.batch_set_v1(keys, writer_pool.indices([0, 1, 2, 3])) == [True] * 4  # SGLang's one MLA writer
        deadline = time.monotonic() + 30
        while reader.batch_exists(keys) < 4 and time.monotonic() < deadline:  # the sweep brings rank 0's pages
            time.sleep(0.05)
        assert reader.batch_exists(keys) == 4
        assert reader.batch_get_v1(keys, reader_pool.indices([8, 9, 10, 11])) == [True] * 4
        assert all(torch.equal(reader_pool.page(8 + i), w) for i, w in enumerate(want))
    finally:
        writer.close()
        reader.close()


def test_a_tiers_capacity_is_the_engines_over_all_its_ranks_as_in_vllm(sgl: types.SimpleNamespace, tmp_path: Path) -> None:
    """capacity: 64MiB at TP=4 reserves 64 MiB in all, 16 MiB per rank (not 64 MiB each)."""
    caps = {}
    for tp in (1, 4):
        backend = build_backend(sgl, HostPool(), lmdb(tmp_path / f"tp{tp}"), tp_rank=tp - 1, tp_size=tp)
        try:
            caps[tp] = backend.kvtier_stats()["store"]["tiers"][0]["capacity_bytes"]
        finally:
            backend.close()
    assert 0.95 < 4 * caps[4] / caps[1] < 1.05, caps


def test_with_mla_a_shared_tier_keeps_its_whole_capacity_and_the_others_are_split() -> None:
    from kvtier.config import load_config
    from kvtier.integrations.sglang.identity import engine_ranks, place_tiers, whole_copy_tiers

    store = load_config({"tiers": [{"backend": "lmdb", "path": "/x", "capacity": "8GiB"},
                                   {"backend": "redis", "url": "redis://127.0.0.1:1/0", "capacity": "64GiB"}]})
    for mla, want in ((True, [1 << 30, 64 << 30]), (False, [1 << 30, 8 << 30])):
        identity = SglangIdentity.from_storage_config(ident(tp_size=4, pp_size=2, is_mla_model=mla))
        placed = place_tiers(store, "d", ranks=engine_ranks(identity), whole=whole_copy_tiers(identity, store))
        assert [t.capacity for t in placed.tiers] == want
