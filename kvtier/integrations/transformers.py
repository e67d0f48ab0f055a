"""kvtier inside the continuous-batching engine of Hugging Face ``transformers``.

``transformers`` (tested with 5.24.0) serves many requests at once with
``ContinuousBatchingManager`` (also behind ``model.generate_batch``). Its KV cache is one flat
tensor cut into blocks of ``page_size`` tokens (every layer of a block together), each request
has a block table, and it keeps its own prefix cache: finished blocks stay in memory under a
content hash until memory runs short. This module puts kvtier behind that cache::

    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    kv = kvtier.integrations.transformers.attach(manager, {"tiers": [...]}, model_id="my-model@rev")
    manager.start()
    ...                                   # add_request / get_result as usual
    manager.stop(block=True)
    kv.close()

What it does, in the engine's own thread:

* **Prefix match** (scheduler, a new request): the engine first matches what it still holds in
  memory; kvtier then looks up the following blocks, allocates engine blocks for the run it
  holds, loads them (one transfer job, waited for), registers their content hashes with the
  engine so its own bookkeeping stays consistent, and reports the longer prefix. The match never
  covers the whole prompt: at least one token is always prefilled, as the engine requires.
* **Finish** (the request's last step, before the engine frees its blocks): every full block
  whose K/V has been computed -- ``position_offset`` tokens, so the final sampled token, whose
  slot is never written, is excluded -- is stored. This includes the block completed in the
  finishing step, which the engine itself never hashes.
* **Fence before reuse**: a store runs on kvtier's worker thread while the engine goes on. Each
  block it reads is held with one extra reference in the engine's block ledger, so the engine
  cannot hand it to another request until the store job has finished; the reference is dropped
  (and the block returned to the engine's pool) at the next scheduling step after the job
  finishes. If the engine ever finds no room while stores are in flight, the adapter waits for
  them and lets the scheduler try again, so a slow tier never starves the engine.
* A full or failing tier, a corrupt record or a failed load is a miss: the engine recomputes.
  Nothing kvtier does raises into the engine's loop (errors are logged and counted).

Why not :mod:`kvtier.connector`: its scheduler half expects what vLLM's scheduler provides.
``get_num_new_matched_tokens`` answers with asynchronous loads, so the request must be able to
wait for ``update_connector_output`` to report its tokens valid; ``SchedulerStep`` must list every
block id allocated in the step (the fence); ``request_finished`` may ask to delay the free; and
the engine keeps stepping while the connector ``has_pending_work``. This engine has none of it:
a prefix match must be complete when ``search_prefix_match`` returns (no "waiting for remote
KV" state), blocks are allocated inside ``can_store_request_tokens`` without a report (it
would take diffing every block table each step), a finished request's blocks are freed at
once, and an idle engine does not schedule -- so the connector's finish walk (built at the next
step, then deferred one more step) would not have stored a turn's last blocks when the next
turn looks them up. The adapter therefore makes the store's lifecycle calls itself (the
``lookup`` / ``prepare_*`` / ``finish_*`` calls the connector makes), loads synchronously at
the match, and fences by reference count instead of ``jobs_to_flush``.

Requirements: only full-attention layers (the engine disables prefix sharing otherwise),
``allow_block_sharing=True`` (the default; it is what makes the engine call the prefix match),
``use_async_batching`` off (the default off CUDA graphs), one process (no tensor parallelism
across processes), and a manager whose batch processor lives as long as the adapter (``stop``
with ``keep_for_next_session=True`` keeps it; a new processor is not hooked).

Private ``transformers`` internals this module relies on -- all of them, and only here:

* ``ContinuousBatchingManager.batch_processor`` (created by the public ``warmup()``) and
  ``ContinuousBatchProcessor.cache`` / ``.scheduler`` / ``.config`` / ``.use_async_batching`` /
  ``.distributed_helper``;
* ``PagedAttentionCache``: ``cache_tensor``, ``cache_allocators``, ``pool``, ``dtype``,
  ``use_prefix_sharing``, ``search_prefix_match``, ``evict_cached_blocks``, ``reset`` (the last
  three are wrapped per instance);
* ``FullAttentionCacheAllocator``: ``index``, ``tokens_per_page``, ``pages_per_block``,
  ``num_key_value_heads``, ``head_dim``, ``cache_dtype``, ``bytes_per_block``,
  ``blocks_per_sector``, ``block_table``, ``ledger`` -- and the block layout
  ``[layer, key|value, token, kv_head, head_dim]`` inside each block of ``cache_tensor``;
* ``BlockLedger``: ``acquire``, ``release``, ``register_new_hash``, ``block_to_hash``, and
  ``cache_allocators.cache_allocator.compute_block_hash``;
* ``CachePool``: ``count_free_blocks``, ``num_free_sectors``, ``allocate_sector``,
  ``get_free_blocks``, ``free_blocks``;
* ``Scheduler``: ``active_requests``, ``finish_request`` and ``schedule_batch`` (wrapped per
  instance);
* ``RequestState``: ``initial_tokens``, ``generated_tokens``, ``position_offset``, ``status``,
  ``error``, and ``RequestStatus.FINISHED``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.config import StoreConfig, load_config
from kvtier.errors import ConfigError, KVTierError
from kvtier.integrations._sync import run_sync
from kvtier.keys import Namespace, block_keys
from kvtier.layout import KVLayout
from kvtier.manager import KeyState
from kvtier.store import KVStore

__all__ = ["TESTED_VERSION", "PrefixMatch", "TransformersKVTier", "attach"]

log = logging.getLogger("kvtier.integrations.transformers")

#: The ``transformers`` release this adapter was written and tested against.
TESTED_VERSION = "5.24.0"

_HISTORY = 4096  # per-request match records kept for inspection


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError('kvtier.integrations.transformers needs transformers: pip install "kvtier[hf]"') from exc
    if transformers.__version__ != TESTED_VERSION:
        log.warning(
            "transformers %s is installed; this adapter was tested with %s and relies on private internals",
            transformers.__version__,
            TESTED_VERSION,
        )
    return transformers


def _config_fingerprint(model_config: Any) -> str:
    """A digest of the model config fields that change K/V bytes (architecture, RoPE, ...)."""
    data = model_config.to_dict() if hasattr(model_config, "to_dict") else dict(vars(model_config))
    public = {k: v for k, v in data.items() if not k.startswith("_") and k != "transformers_version"}
    raw = json.dumps(public, sort_keys=True, default=str).encode("utf-8")
    return hashlib.sha256(raw).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """How the prefix of one request was served: ``engine_tokens`` from the engine's own memory,
    ``kvtier_tokens`` loaded from kvtier (both multiples of the page size)."""

    request_id: str
    prompt_tokens: int
    engine_tokens: int
    kvtier_tokens: int


class TransformersKVTier:
    """kvtier hooked into one ``ContinuousBatchProcessor``. Build it with :func:`attach`."""

    def __init__(
        self,
        processor: Any,
        config: Mapping[str, Any] | StoreConfig | str,
        *,
        model_id: str | None = None,
        revision: str = "",
        namespace: Namespace | None = None,
        engine_prefix_cache: bool = True,
    ) -> None:
        tf = _import_transformers()
        from transformers.generation.continuous_batching.cache_allocators.cache_allocator import compute_block_hash
        from transformers.generation.continuous_batching.requests import RequestStatus

        self._compute_block_hash = compute_block_hash
        self._finished_status = RequestStatus.FINISHED
        self.processor = processor
        cache = processor.cache
        self.cache = cache
        self.scheduler = processor.scheduler
        if getattr(processor, "use_async_batching", False):
            raise ConfigError(
                "use_async_batching: kvtier needs it off (a finishing request's blocks must be computed when it "
                "finishes); set ContinuousBatchingConfig(use_async_batching=False)"
            )
        if list(cache.cache_allocators) != ["full_attention"]:
            raise ConfigError(
                f"kvtier supports models with only full-attention layers; this one has {list(cache.cache_allocators)}"
            )
        if not cache.use_prefix_sharing:
            raise ConfigError(
                "allow_block_sharing: kvtier needs the engine's prefix matching; set "
                "ContinuousBatchingConfig(allow_block_sharing=True)"
            )
        helper = getattr(processor, "distributed_helper", None)
        tp_size = int(getattr(helper, "tp_size", 1) or 1)
        if tp_size > 1:
            raise ConfigError("tensor parallelism: the transformers adapter supports one process per model only")
        self.allocator = cache.cache_allocators["full_attention"]
        alloc = self.allocator
        self.page_size = int(alloc.tokens_per_page)
        cfg = config if isinstance(config, StoreConfig) else self._load_config(config)
        if cfg.engine_blocks_per_block != 1:
            raise ConfigError(
                "engine_blocks_per_block: the transformers adapter stores one engine block per record; "
                "choose ContinuousBatchingConfig(page_size=...) instead"
            )
        self.kv_cache = self._cache_view()
        if namespace is None:
            model_config = processor.config
            name = model_id or getattr(model_config, "_name_or_path", "") or ""
            if not name:
                raise ConfigError(
                    "model_id: name the model and its weights (e.g. 'org/model@revision'); the model config "
                    "has no name_or_path, and a key must never match blocks of other weights"
                )
            namespace = Namespace(
                model_id=name,
                revision=revision,
                dtype=str(self.kv_cache.dtype).removeprefix("torch."),
                kv_layout=KVLayout(self.kv_cache).fingerprint(),
                block_size=self.page_size,
                config_fingerprint=_config_fingerprint(model_config),
            )
        elif namespace.block_size != self.page_size:
            raise ConfigError(
                f"namespace.block_size: {namespace.block_size} != the engine's page_size {self.page_size}"
            )
        self.namespace = namespace
        self.engine_prefix_cache = engine_prefix_cache
        self.transformers_version = tf.__version__
        self.store = KVStore(cfg, kv_caches=[self.kv_cache], namespace=namespace)
        run_sync(self.store.start())
        self.counters: dict[str, int] = {
            "lookups": 0,
            "prompt_tokens": 0,
            "engine_hit_tokens": 0,
            "kvtier_hit_tokens": 0,
            "blocks_loaded": 0,
            "load_failures": 0,
            "blocks_stored": 0,
            "store_jobs": 0,
            "store_rejected": 0,
            "store_failures": 0,
            "fence_waits": 0,
            "errors": 0,
        }
        self.matches: OrderedDict[str, PrefixMatch] = OrderedDict()
        self._stores: dict[int, tuple[Any, list[int]]] = {}  # job id -> (plan, fenced engine blocks)
        self._fence = True  # tests turn it off to show the race it prevents
        self._closed = False
        self._install()

    @staticmethod
    def _load_config(config: Any) -> StoreConfig:
        if isinstance(config, Mapping):
            return load_config(config)
        from kvtier import config as config_module

        loader = getattr(config_module, "load_config_file", None)
        if loader is None:
            raise ConfigError(f"config: expected a mapping, got {type(config).__name__}")
        return loader(config)

    def _cache_view(self) -> torch.Tensor:
        """The engine's cache tensor as ``[block, layer, key|value, token, kv_head, head_dim]``."""
        alloc = self.allocator
        raw = self.cache.cache_tensor
        rows = raw.numel() // alloc.bytes_per_block
        shape = (rows, alloc.pages_per_block, 2, alloc.tokens_per_page, alloc.num_key_value_heads, alloc.head_dim)
        try:
            return raw[: rows * alloc.bytes_per_block].view(alloc.cache_dtype).view(shape)
        except RuntimeError as exc:
            raise ConfigError(
                f"the engine's cache layout is not the one this adapter knows (transformers {TESTED_VERSION} is)"
            ) from exc

    # -- hooks -----------------------------------------------------------------------------
    def _install(self) -> None:
        cache, sched = self.cache, self.scheduler
        self._orig = {
            "search_prefix_match": cache.search_prefix_match,
            "reset": cache.reset,
            "finish_request": sched.finish_request,
            "schedule_batch": sched.schedule_batch,
        }
        cache.search_prefix_match = self._search_prefix_match
        cache.reset = self._reset
        sched.finish_request = self._finish_request
        sched.schedule_batch = self._schedule_batch

    def _uninstall(self) -> None:
        for name in ("search_prefix_match", "reset"):
            self.cache.__dict__.pop(name, None)
        for name in ("finish_request", "schedule_batch"):
            self.scheduler.__dict__.pop(name, None)

    def _search_prefix_match(self, request_id: str, prompt_ids: list[int]) -> int:
        self._poll()
        engine_tokens = self._orig["search_prefix_match"](request_id, prompt_ids) if self.engine_prefix_cache else 0
        extra = 0
        if not self._closed:
            try:
                extra = self._load_prefix(request_id, prompt_ids, engine_tokens)
            except Exception as exc:  # never into the engine's loop: the prefix is recomputed
                self.counters["errors"] += 1
                log.warning("kvtier prefix load for %s failed: %s", request_id, exc, exc_info=True)
        self.counters["lookups"] += 1
        self.counters["prompt_tokens"] += len(prompt_ids)
        self.counters["engine_hit_tokens"] += engine_tokens
        self.counters["kvtier_hit_tokens"] += extra
        self.matches[request_id] = PrefixMatch(request_id, len(prompt_ids), engine_tokens, extra)
        while len(self.matches) > _HISTORY:
            self.matches.popitem(last=False)
        return engine_tokens + extra

    def _load_prefix(self, request_id: str, prompt_ids: list[int], engine_tokens: int) -> int:
        alloc, pool, mgr = self.allocator, self.cache.pool, self.store.manager
        assert mgr is not None and self.store.transfers is not None
        page = self.page_size
        have = engine_tokens // page
        limit = (len(prompt_ids) - 1) // page  # keep >= 1 token to prefill
        if limit <= have:
            return 0
        keys = block_keys(prompt_ids[: limit * page], block_size=page, namespace=self.namespace)
        hits = mgr.lookup(keys)
        if hits < limit and self._stores and mgr.lookup_detail(keys[hits : hits + 1])[0].state == KeyState.PENDING:
            # The next block is being stored by one of our own jobs (typically the previous turn of
            # this conversation, finished a moment ago): a store is far cheaper to wait for than a
            # prefill to redo, and waiting makes the hit independent of thread timing.
            self._poll(wait=True)
            hits = mgr.lookup(keys)
        if hits <= have:
            return 0
        want = list(keys[have:hits])
        # Load only if the whole prompt then fits: half a prefix that starves the request helps no one.
        idx, per_sector = alloc.index, alloc.blocks_per_sector
        free = pool.count_free_blocks(idx)
        if free + pool.num_free_sectors * per_sector < math.ceil(len(prompt_ids) / page) - have:
            return 0
        for _ in range(max(0, math.ceil((len(want) - free) / per_sector))):
            pool.allocate_sector(idx)
        blocks = pool.get_free_blocks(idx, len(want))
        ok = 0
        try:
            plan = mgr.prepare_load(want)
            job = self.store.transfers.submit_load(plan, blocks)
            (result,) = self.store.transfers.wait([job])
            self.store.finish_load(plan, result)
            if result.error is None:
                missed = {plan.keys.index(k) for k in result.missed}
                ok = min(missed) if missed else len(want)
            if ok < len(want):
                self.counters["load_failures"] += 1
        finally:
            used = self._adopt(request_id, prompt_ids, have, blocks[:ok])
            pool.free_blocks(idx, [b for b in blocks if b not in used])
        self.counters["blocks_loaded"] += ok
        return ok * page

    def _adopt(self, request_id: str, prompt_ids: list[int], have: int, blocks: list[int]) -> set[int]:
        """Append loaded blocks to the request's table and register their hashes in the ledger,
        as the engine would for blocks it computed. Returns the loaded blocks kept."""
        alloc, page = self.allocator, self.page_size
        table = alloc.block_table.setdefault(request_id, [])
        del table[have:]
        ledger = alloc.ledger
        parent = ledger.block_to_hash.get(table[-1]) if table else None
        kept: set[int] = set()
        for i, block in enumerate(blocks):
            start = (have + i) * page
            digest = self._compute_block_hash(parent, prompt_ids[start : start + page])
            same = ledger.register_new_hash(block, digest)
            if same is None:
                table.append(block)
                kept.add(block)
            else:  # the engine holds these very tokens in a live block: share it, as its dedup does
                ledger.acquire(same)
                table.append(same)
            parent = digest
        return kept

    def _finish_request(self, request_id: str) -> None:
        if not self._closed:
            try:
                self._store_finished(request_id)
            except Exception as exc:
                self.counters["errors"] += 1
                log.warning("kvtier store for %s failed: %s", request_id, exc, exc_info=True)
        self._orig["finish_request"](request_id)
        if not self.engine_prefix_cache:
            self.cache.evict_cached_blocks()

    def _store_finished(self, request_id: str) -> None:
        state = self.scheduler.active_requests.get(request_id)
        if state is None or state.status != self._finished_status or state.error is not None:
            return
        table = self.allocator.block_table.get(request_id)
        if not table:
            return
        page = self.page_size
        computed = (list(state.initial_tokens) + list(state.generated_tokens))[: state.position_offset]
        full = min(len(computed) // page, len(table))
        if full == 0:
            return
        mgr = self.store.manager
        assert mgr is not None and self.store.transfers is not None
        keys = block_keys(computed[: full * page], block_size=page, namespace=self.namespace)
        plan = mgr.prepare_store(keys)
        if plan is None:
            self.counters["store_rejected"] += 1
            return
        if plan.empty:
            return
        ids = [table[p] for p in plan.positions]
        fenced = ids if self._fence else []
        for block in fenced:
            self.allocator.ledger.acquire(block)
        try:
            job = self.store.transfers.submit_store(plan, ids)
        except BaseException:
            self._release(fenced)
            mgr.complete_store(plan.keys, False)
            raise
        self._stores[job] = (plan, fenced)
        self.counters["store_jobs"] += 1

    def _schedule_batch(self, token_budget: int, cache_budget: int) -> Any:
        self._poll()
        out = self._orig["schedule_batch"](token_budget, cache_budget)
        if out[0] is None and self._stores:
            # No room, and fenced blocks are part of why: wait for the stores and try again.
            self.counters["fence_waits"] += 1
            self._poll(wait=True)
            out = self._orig["schedule_batch"](token_budget, cache_budget)
        return out

    def _reset(self) -> None:
        self._poll(wait=True)
        self._orig["reset"]()

    def _poll(self, wait: bool = False) -> None:
        """Apply finished store jobs and drop their fences (engine thread, or after it stopped)."""
        transfers = self.store.transfers
        if transfers is None or self._closed:
            return
        if wait and self._stores:
            transfers.wait(list(self._stores))
        for result in transfers.poll_finished():
            entry = self._stores.pop(result.job_id, None)
            if entry is None:
                continue  # a load, already applied where it was waited for
            plan, fenced = entry
            stored = self.store.finish_store(plan, result)
            self.counters["blocks_stored"] += stored
            if stored < len(plan.keys):
                self.counters["store_failures"] += 1
            self._release(fenced)

    def _release(self, blocks: Sequence[int]) -> None:
        alloc = self.allocator
        back = [b for b in blocks if alloc.ledger.release(b)]
        if back:
            self.cache.pool.free_blocks(alloc.index, back)

    # -- public ----------------------------------------------------------------------------
    def flush(self) -> None:
        """Wait for every store in flight and apply it. Call it only while the engine's loop is
        not running (before ``start``, after ``stop``): the engine's ledger is not thread-safe."""
        self._poll(wait=True)

    def stats(self) -> dict[str, Any]:
        """Adapter counters plus the store's statistics."""
        data: dict[str, Any] = dict(self.counters)
        prompt = data["prompt_tokens"]
        data["hit_rate"] = (data["engine_hit_tokens"] + data["kvtier_hit_tokens"]) / prompt if prompt else 0.0
        if not self._closed:
            data["store"] = self.store.stats()
        return data

    def close(self) -> None:
        """Flush stores, unhook the engine and close the store. Call after ``manager.stop()``."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._uninstall()
            self._closed = True
            run_sync(self.store.aclose())

    def __enter__(self) -> TransformersKVTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def attach(
    manager: Any,
    config: Mapping[str, Any] | StoreConfig | str,
    *,
    model_id: str | None = None,
    revision: str = "",
    namespace: Namespace | None = None,
    engine_prefix_cache: bool = True,
) -> TransformersKVTier:
    """Hook kvtier into ``manager`` (a ``ContinuousBatchingManager``) before ``manager.start()``.

    ``config`` is a kvtier store config (see ``docs/configuration.md``). ``model_id`` (and
    ``revision``) name the weights: keys must never match blocks computed by other weights, and
    the model config alone does not identify them; it defaults to the config's
    ``name_or_path``. ``namespace`` replaces the derived namespace entirely.
    ``engine_prefix_cache=False`` makes kvtier the only prefix cache: the engine's own matching is
    skipped and the blocks it would keep are returned to its pool when a request finishes.
    """
    if manager.batch_processor is None:
        manager.warmup()  # builds the batch processor and its paged cache (no compute off CUDA)
    if manager.batch_processor is None:  # pragma: no cover - defensive
        raise KVTierError("the manager has no batch processor after warmup()")
    return TransformersKVTier(
        manager.batch_processor,
        config,
        model_id=model_id,
        revision=revision,
        namespace=namespace,
        engine_prefix_cache=engine_prefix_cache,
    )
