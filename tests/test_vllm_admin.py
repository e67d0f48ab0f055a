"""The vLLM admin endpoint, below vLLM: real HTTP on a free localhost port, over the scheduler
side of two KV-cache groups and one or two ranks (``test_vllm_groups.GroupWorld``).

Prompts are hashed here as vLLM hashes a request (a chained hash per block, the cache salt in
the first block's extra keys); the test under real vLLM (``scripts/vllm_e2e_tenants.py``)
checks that the endpoint's keys are the ones a real request stores."""

from __future__ import annotations

import hashlib
import json
import re
import threading
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from test_vllm_groups import GROUPS, HANG_GUARD, GroupWorld, cpu, open_groups

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.admin import AdminServer, AdminSettings, admin_settings
from kvtier.integrations.vllm.admin_ops import AdminOps, offload_keys

TOKEN = "s3cret-admin-token-0123"
TOKENS_PER_HASH = 4


def vllm_like_hashes(token_ids: Sequence[int], cache_salt: str | None) -> list[bytes]:
    """One hash per full block of TOKENS_PER_HASH tokens, chained; the salt in the first."""
    out, parent = [], b"none-hash"
    for start in range(0, len(token_ids) - TOKENS_PER_HASH + 1, TOKENS_PER_HASH):
        extra = repr(("cache_salt", cache_salt)) if start == 0 and cache_salt else ""
        parent = hashlib.sha256(parent + repr(tuple(token_ids[start : start + TOKENS_PER_HASH])).encode() + extra.encode()).digest()
        out.append(parent)
    return out


def prompt(seed: int, blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * TOKENS_PER_HASH)]


class Admin:
    """The endpoint over a GroupWorld, and a client for it."""

    def __init__(self, w: GroupWorld, **settings: Any) -> None:
        self.w = w
        self.ops = AdminOps(w.side, vllm_like_hashes, [1] * len(GROUPS))
        self.server = AdminServer(AdminSettings(token=TOKEN, **settings), self.ops).start()
        host, port = self.server.address
        self.url = f"http://{host}:{port}"

    def call(self, method: str, path: str, body: Any = None, *, token: str | None = TOKEN) -> tuple[int, dict[str, Any]]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if token is not None:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=HANG_GUARD) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def store(self, tokens: list[int], salt: str | None = None, first_block: int = 0) -> list[bytes]:
        """What a request with ``tokens`` and ``salt`` stores: its chunks in both groups."""
        hashes = vllm_like_hashes(tokens, salt)
        keys = [k for g in GROUPS for k in offload_keys(hashes, g, 1)]
        n = len(hashes)
        prepared = self.w.side.prepare_store(keys, salt)
        assert prepared is not None
        chosen, plans = prepared
        ids = list(range(first_block, first_block + n)) * len(GROUPS)
        for r in self.w.workers:
            r.submit_store(1, plans, ids, [n] * len(GROUPS), [0] * len(GROUPS))
        self.w.deliver()
        self.w.side.complete_store(chosen)
        return chosen

    def step(self) -> int:
        """The connector's next step: the endpoint's deletes to the ledgers, then every rank runs
        the step's deletes (waited for). Returns the keys the ranks were told to delete."""
        self.ops.to_ledgers()
        deletes = self.w.side.take_deletes()
        for r in self.w.workers:
            r.submit_deletes(deletes)
            for side in r.sides:
                side._transfers.wait(list(side._jobs), timeout=HANG_GUARD)
                side._transfers.wait([j for j in side._transfers._jobs], timeout=HANG_GUARD)
        return sum(len(keys) for _, per in deletes for _, keys in per)

    def close(self) -> None:
        self.server.close()


@pytest.fixture(params=[1, 2], ids=["1rank", "2ranks"])
async def admin(request: Any) -> AsyncIterator[Admin]:
    w = await open_groups(request.param, [cpu(8, request.param)])
    a = Admin(w, wait_s=0.0)
    yield a
    a.close()
    await w.close()


# -- keys ---------------------------------------------------------------------------------
def test_offload_keys_take_each_chunk_s_last_block_hash_with_the_group_packed_after_it() -> None:
    hashes = [bytes([i]) * 32 for i in range(7)]
    # vLLM's update_offload_keys: islice(block_hashes, per_chunk - 1, None, per_chunk)
    assert offload_keys(hashes, 3, 2) == [hashes[1] + b"\0\0\0\3", hashes[3] + b"\0\0\0\3", hashes[5] + b"\0\0\0\3"]
    assert offload_keys(hashes, 0, 1) == [h + b"\0\0\0\0" for h in hashes]
    assert offload_keys(hashes[:1], 0, 2) == []  # no full chunk


# -- settings -----------------------------------------------------------------------------
def test_the_endpoint_is_off_unless_configured_and_refuses_settings_without_a_good_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert admin_settings({}) is None and admin_settings({"admin": None}) is None
    s = admin_settings({"admin": {"token": TOKEN}})
    assert s is not None and s.host == "127.0.0.1" and s.port == 0
    assert TOKEN not in repr(s)
    (tmp_path / "tok").write_text(TOKEN + "\n")
    s2 = admin_settings({"admin": {"token_file": str(tmp_path / "tok"), "port": 8199}})
    assert s2 is not None and s2.token == TOKEN and s2.port == 8199
    monkeypatch.setenv("KVTIER_TEST_ADMIN", TOKEN)
    s3 = admin_settings({"admin": {"token_env": "KVTIER_TEST_ADMIN"}})
    assert s3 is not None and s3.token == TOKEN
    bad = [
        ({"port": 1}, "exactly one of token"),
        ({"token": TOKEN, "token_env": "X"}, "exactly one of token"),
        ({"token": "short"}, "at least 16"),
        ({"token": TOKEN, "port": 70000}, r"admin\.port"),
        ({"token": TOKEN, "bind": "x"}, r"admin\.bind: unknown field"),
        ({"token_file": str(tmp_path / "none")}, r"admin\.token_file: cannot read"),
        ({"token_env": "KVTIER_TEST_UNSET_VAR"}, r"admin\.token_env"),
        ({"token": TOKEN, "wait_s": -1}, r"admin\.wait_s"),
    ]
    for raw, match in bad:
        with pytest.raises(ConfigError, match=match):
            admin_settings({"admin": raw})


# -- HTTP -----------------------------------------------------------------------------------
async def test_calls_without_the_token_or_to_unknown_routes_are_refused_and_change_nothing(admin: Admin) -> None:
    tokens = prompt(1, 3)
    admin.store(tokens, "chat")
    before = admin.ops.usage()
    for token in (None, "wrong-token-wrong-token", TOKEN + "x"):
        status, body = admin.call("POST", "/v1/delete", {"tenant": "chat"}, token=token)
        assert status == 401 and "Authorization" in body["error"]
    assert admin.call("GET", "/v1/nothing")[0] == 404
    assert admin.call("GET", "/v1/pin")[0] == 405
    assert admin.call("POST", "/v1/usage", {})[0] == 405
    assert admin.ops.usage() == before
    assert admin.call("POST", "/v1/lookup", {"token_ids": tokens, "cache_salt": "chat"})[1]["stored"] == 6


async def test_bad_input_gets_a_400_naming_the_field_and_changes_nothing(admin: Admin) -> None:
    tokens = prompt(1, 3)
    admin.store(tokens, "chat")
    before = admin.ops.usage()
    cases = [
        ({"token_ids": []}, "token_ids: expected a non-empty list"),
        ({"token_ids": [1, -2, 3, 4]}, r"token_ids\[1\]"),
        ({"token_ids": "1 2 3"}, "token_ids"),
        ({"token_ids": tokens, "cache_salt": 5}, "cache_salt"),
        ({"token_ids": tokens, "cache_salt": "a", "tenant": "b"}, "cache_salt / tenant"),
        ({"token_ids": tokens, "lora": "x"}, "lora: unknown field"),
        ({"token_ids": tokens, "cache_salt": "chat", "tier": "ssd"}, "no tier 'ssd'; the tiers are"),
    ]
    for body, match in cases:
        status, answer = admin.call("POST", "/v1/pin", body)
        assert status == 400, (body, answer)
        assert re.search(match, answer["error"]), (match, answer)
    status, answer = admin.call("POST", "/v1/delete", {})
    assert status == 400 and "token_ids" in answer["error"]
    status, answer = admin.call("POST", "/v1/delete", {"tenant": ""})
    assert status == 400 and "tenant" in answer["error"]
    req = urllib.request.Request(admin.url + "/v1/pin", data=b"{not json", method="POST")
    req.add_header("Authorization", f"Bearer {TOKEN}")
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=HANG_GUARD)
    assert exc.value.code == 400
    assert admin.ops.usage() == before
    assert admin.ops.pending.take() == []


async def test_before_the_ranks_open_their_tiers_calls_answer_503() -> None:
    w = await open_groups(1, [cpu(8, 1)])
    try:
        w.side.groups = []  # as before adopt(): the ranks have not described their tiers
        a = Admin(w)
        try:
            status, body = a.call("GET", "/v1/usage")
            assert status == 503 and "not opened its tiers" in body["error"]
        finally:
            a.close()
    finally:
        await w.close()


async def test_a_prompt_pinned_through_the_endpoint_survives_a_flood_on_every_rank(admin: Admin) -> None:
    system = prompt(1, 3)
    admin.store(system, "chat")
    status, body = admin.call("POST", "/v1/pin", {"token_ids": [*system, 7, 7], "cache_salt": "chat"})
    assert status == 200 and body == {"chunks": 6, "stored": 6, "pinned": 6, "noop": False}
    # the same tokens under another salt are other keys: nothing of them is stored
    status, other = admin.call("POST", "/v1/lookup", {"token_ids": system, "cache_salt": "batch"})
    assert other["stored"] == 0
    for i in range(6):  # a flood of unique prompts (8 chunks per group fit)
        admin.store(prompt(100 + i, 3), "batch", first_block=3)
    status, body = admin.call("POST", "/v1/lookup", {"token_ids": system, "cache_salt": "chat"})
    assert body["stored"] == 6 and body["pinned"]["cpu"] == 6
    for rank in range(admin.w.world):  # every rank still holds the pinned chunks' bytes
        for group in GROUPS:
            assert admin.w.records(rank, group) == 8
    usage = admin.call("GET", "/v1/usage")[1]["tiers"]["cpu"]
    assert usage["chat"]["pinned"] == 6 and usage["chat"]["blocks"] == 6 and usage["batch"]["evictions"] > 0
    # unpinned, the next flood evicts it
    status, body = admin.call("POST", "/v1/unpin", {"token_ids": system, "cache_salt": "chat"})
    assert body["unpinned"] == 6
    for i in range(6):
        admin.store(prompt(200 + i, 3), "batch", first_block=3)
    assert admin.call("POST", "/v1/lookup", {"token_ids": system, "cache_salt": "chat"})[1]["stored"] == 0


async def test_a_pin_over_the_budget_is_a_409_and_pins_nothing_in_any_group(admin: Admin) -> None:
    system = prompt(1, 3)
    admin.store(system, "chat")
    mgr1 = admin.w.side.groups[1].engine.manager
    assert mgr1 is not None
    mgr1.tenants.set_pin_budget("cpu", mgr1.tier_spec(0).block_reserve)  # one block of group 1
    status, body = admin.call("POST", "/v1/pin", {"token_ids": system, "cache_salt": "chat"})
    assert status == 409 and "budget" in body["error"]
    for group in admin.w.side.groups:
        assert group.engine.manager is not None and group.engine.manager.tenants.pinned("cpu") == []
    status, body = admin.call("POST", "/v1/pin", {"token_ids": system[:4], "cache_salt": "chat"})
    assert status == 200 and body["pinned"] == 2  # one chunk per group fits


async def test_a_deleted_prompt_is_a_miss_at_once_and_its_bytes_go_from_every_rank_with_the_next_step(admin: Admin) -> None:
    doc, chat = prompt(1, 3), prompt(2, 2)
    admin.store(doc, "chat")
    admin.store(chat, "chat", first_block=3)
    status, body = admin.call("POST", "/v1/delete", {"token_ids": doc, "cache_salt": "chat"})
    assert status == 200 and body == {"deleted": 6, "by_tier": {"cpu": 6}, "skipped": 0, "noop": False}
    assert admin.call("POST", "/v1/lookup", {"token_ids": doc, "cache_salt": "chat"})[1]["stored"] == 0
    for rank in range(admin.w.world):  # bytes still there until the step delivers the deletes
        assert admin.w.records(rank, 0) == 5
    assert admin.step() == 6
    for rank in range(admin.w.world):
        for group in GROUPS:
            assert admin.w.records(rank, group) == 2
    assert admin.call("POST", "/v1/lookup", {"token_ids": chat, "cache_salt": "chat"})[1]["stored"] == 4
    # a delete of what is not stored is a no-op, reported as such
    before = admin.ops.usage()
    status, body = admin.call("POST", "/v1/delete", {"token_ids": doc, "cache_salt": "chat"})
    assert status == 200 and body["noop"] is True and body["deleted"] == 0
    assert admin.ops.usage() == before and admin.step() == 0


async def test_a_tenant_deleted_through_the_endpoint_loses_all_its_blocks_and_no_other(admin: Admin) -> None:
    admin.store(prompt(1, 2), "chat")
    admin.store(prompt(2, 2), "batch", first_block=2)
    admin.store(prompt(3, 1), None, first_block=4)
    status, body = admin.call("POST", "/v1/delete", {"tenant": "batch"})
    assert status == 200 and body["deleted"] == 4
    usage = admin.call("GET", "/v1/usage")[1]["tiers"]["cpu"]
    assert usage["chat"]["blocks"] == 4 and usage["default"]["blocks"] == 2
    assert "batch" not in usage or usage["batch"]["blocks"] == 0
    admin.step()
    for rank in range(admin.w.world):
        assert admin.w.records(rank, 0) == 3
    status, body = admin.call("POST", "/v1/delete", {"tenant": "default"})
    assert body["deleted"] == 2
    status, body = admin.call("POST", "/v1/delete", {"tenant": "nobody"})
    assert status == 200 and body["noop"] is True


async def test_a_delete_never_frees_a_block_a_load_reads(admin: Admin) -> None:
    tokens = prompt(1, 2)
    admin.store(tokens, "chat")
    keys = [k for g in GROUPS for k in offload_keys(vllm_like_hashes(tokens, "chat"), g, 1)]
    loads = admin.w.side.prepare_load(keys)  # pinned by a load in flight
    status, body = admin.call("POST", "/v1/delete", {"token_ids": tokens, "cache_salt": "chat"})
    assert status == 200 and body["deleted"] == 0 and body["skipped"] == 4 and body["noop"] is False
    assert admin.step() == 0
    for r in admin.w.workers:
        r.submit_load(2, loads, [5, 6, 5, 6], [2, 2], [0, 0])
    admin.w.deliver()
    admin.w.side.complete_load(keys)
    status, body = admin.call("POST", "/v1/delete", {"token_ids": tokens, "cache_salt": "chat"})
    assert body["deleted"] == 4 and admin.step() == 4


def test_deletes_wait_for_the_step_thread_however_many_endpoint_threads_add_them() -> None:
    from kvtier.integrations.vllm.admin_ops import PendingDeletes

    pending = PendingDeletes()
    taken: list[tuple[int, int, list[bytes]]] = []

    def add(t: int) -> None:
        for i in range(500):
            pending.add(0, 0, [bytes([t, i % 256]) * 16])

    threads = [threading.Thread(target=add, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        taken += pending.take()
    taken += pending.take()
    assert len(taken) == 2000 and len(pending) == 0


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_the_endpoint_hashes_a_prompt_exactly_as_vllm_hashes_a_request(algo: str) -> None:
    """Under vLLM (skipped without it): the endpoint's hasher against a real vLLM Request's."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("VLLM IS NOT INSTALLED: the endpoint's hashes are checked against vLLM's in .ci/vllm")
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from kvtier.integrations.vllm.spec import vllm_prefix_hasher

    fn = get_hash_fn_by_name(algo)
    init_none_hash(fn)
    tokens = list(range(1000, 1000 + 32 * 5 + 7))
    for salt in (None, "chat"):
        request = Request("r", tokens, SamplingParams(max_tokens=1), None, cache_salt=salt, block_hasher=get_request_block_hasher(32, fn))
        assert vllm_prefix_hasher(algo, 32)(tokens, salt) == [bytes(h) for h in request.block_hashes]
    assert vllm_prefix_hasher(algo, 32)(tokens, "chat") != vllm_prefix_hasher(algo, 32)(tokens, None)


async def test_usage_per_tenant_is_served_to_prometheus_with_the_token_and_hashed_ids_on_request(admin: Admin) -> None:
    pytest.importorskip("prometheus_client", reason="PROMETHEUS_CLIENT NOT INSTALLED (the metrics extra)")
    admin.store(prompt(1, 3), "chat")

    def scrape(token: str | None = TOKEN) -> tuple[int, str]:
        req = urllib.request.Request(admin.url + "/metrics")
        if token is not None:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=HANG_GUARD) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    status, text = scrape()
    assert status == 200
    assert 'kvtier_tenant_blocks{store="e",tenant="chat",tier="cpu"} 6.0' in text
    assert 'kvtier_tenant_evictions_total{store="e",tenant="chat",tier="cpu"} 0.0' in text
    assert scrape(None)[0] == 401
    admin.ops.hash_ids = True
    status, text = scrape()
    assert status == 200 and "chat" not in text and 'tenant="t-' in text
