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

It drives kvtier's engine-agnostic connector (:mod:`kvtier.connector`): a
:class:`~kvtier.connector.SchedulerConnector` with ``ConnectorConfig(step_loop=False)`` and a
:class:`~kvtier.connector.WorkerConnector`, both in the engine's own thread, as a synchronous
engine (``docs/integrating.md``, "Engines without a step loop"). This engine has no scheduler
step the connector could follow: a prefix match must be complete when ``search_prefix_match``
returns, blocks are allocated inside ``can_store_request_tokens`` without a report, a finished
request's blocks are freed at once, and an idle engine does not schedule. So:

* **Prefix match** (scheduler, a new request): the engine first matches what it still holds in
  memory. If the blocks right after that are being stored by a connector job (typically the
  previous turn of this conversation, finished a moment ago), ``pending_prefix_stores`` names
  the jobs and the adapter waits for them (``WorkerConnector.wait_for``): a store is far
  cheaper to wait for than a prefill to redo, and the hit no longer depends on thread timing.
  Then ``get_num_new_matched_tokens`` offers the following blocks (never the whole prompt: at
  least one token is always prefilled, as the engine requires); the adapter allocates engine
  blocks for them (only if the whole prompt then fits), ``update_state_after_alloc`` queues the
  load, ``build_immediate_meta`` + ``WorkerConnector.run_now`` run it at once, and
  ``update_connector_output`` reports how many tokens are valid. The loaded blocks' content
  hashes are registered with the engine so its own bookkeeping stays consistent, and the
  longer prefix is reported.
* **Finish** (the request's last step, before the engine frees its blocks):
  ``request_finished`` with the request's computed tokens -- ``position_offset`` of them, so
  the final sampled token, whose slot is never written, is excluded -- then
  ``build_immediate_meta`` builds the finish walk's stores at once (every full block not yet
  stored, including the block completed in the finishing step, which the engine itself never
  hashes) and ``run_now`` submits them to kvtier's worker thread.
* **Cancellation**: the engine drops cancelled requests in ``clear_cancelled_requests`` without
  calling ``finish_request``; the adapter ends them in the connector there (nothing of a
  cancelled request is stored), so no connector state is left behind.
* **Fence before reuse**, by reference count: before ``run_now`` submits a store, the adapter
  takes one extra reference on each block of ``meta.stores`` in the engine's block ledger, so
  the engine cannot hand it to another request; the reference is dropped (and the block
  returned to the engine's pool) when ``update_connector_output`` lists it in ``unfenced``
  (the store has read it; its tier writes may still run), which the adapter polls at each
  scheduling step. If the engine ever finds no room while blocks are fenced, the adapter waits
  until the stores have read them and lets the scheduler try again, so a slow tier never
  starves the engine.
* A full or failing tier, a corrupt record or a failed load is a miss: the engine recomputes.
  Nothing kvtier does raises into the engine's loop (errors are logged and counted).

What stays in the adapter, because it is the engine's side of the contract and not the
connector's: allocating the engine blocks a load fills and adopting them into the request's
block table and the engine's ledger (the connector never allocates engine memory), and the
reference counts of the fence (the connector says which blocks to pin and when to unpin them;
only the engine's ledger can hold them). Every lookup, load, store, the finish walk and the
fence's bookkeeping go through the connector.

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
* ``Scheduler``: ``active_requests``, ``finish_request``, ``clear_cancelled_requests`` and
  ``schedule_batch`` (wrapped per instance);
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
from kvtier.connector import ConnectorUpdate, SchedulerConnector, StepMetadata, WorkerConnector, WorkerOutput
from kvtier.errors import ConfigError, KVTierError
from kvtier.integrations._sync import run_sync
from kvtier.keys import Namespace
from kvtier.store import KVStore
from kvtier.transfer.layout import KVLayout

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


def _check_processor(processor: Any) -> None:
    """Refuse an engine set-up the adapter cannot serve, naming the setting to change."""
    cache = processor.cache
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


def _load_config(config: Any) -> StoreConfig:
    if isinstance(config, Mapping):
        return load_config(config)
    from kvtier import config as config_module

    loader = getattr(config_module, "load_config_file", None)
    if loader is None:
        raise ConfigError(f"config: expected a mapping, got {type(config).__name__}")
    return loader(config)


def _cache_view(cache: Any, alloc: Any) -> torch.Tensor:
    """The engine's cache tensor as ``[block, layer, key|value, token, kv_head, head_dim]``."""
    raw = cache.cache_tensor
    rows = raw.numel() // alloc.bytes_per_block
    shape = (rows, alloc.pages_per_block, 2, alloc.tokens_per_page, alloc.num_key_value_heads, alloc.head_dim)
    try:
        return raw[: rows * alloc.bytes_per_block].view(alloc.cache_dtype).view(shape)
    except RuntimeError as exc:
        raise ConfigError(
            f"the engine's cache layout is not the one this adapter knows (transformers {TESTED_VERSION} is)"
        ) from exc


def _namespace(
    processor: Any,
    kv_cache: torch.Tensor,
    page_size: int,
    model_id: str | None,
    revision: str,
    namespace: Namespace | None,
) -> Namespace:
    """The caller's namespace (checked against the page size), or one derived from the model."""
    if namespace is not None:
        if namespace.block_size != page_size:
            raise ConfigError(f"namespace.block_size: {namespace.block_size} != the engine's page_size {page_size}")
        return namespace
    model_config = processor.config
    name = model_id or getattr(model_config, "_name_or_path", "") or ""
    if not name:
        raise ConfigError(
            "model_id: name the model and its weights (e.g. 'org/model@revision'); the model config "
            "has no name_or_path, and a key must never match blocks of other weights"
        )
    return Namespace(
        model_id=name,
        revision=revision,
        dtype=str(kv_cache.dtype).removeprefix("torch."),
        kv_layout=KVLayout(kv_cache).fingerprint(),
        block_size=page_size,
        config_fingerprint=_config_fingerprint(model_config),
    )


@dataclass(frozen=True, slots=True)
class _RequestView:
    """One engine request as the connector reads it (:class:`kvtier.connector.Request`), taken
    at the moment of the call: this engine has no step at which the connector reads it again."""

    request_id: str
    token_ids: Sequence[int]
    num_computed_tokens: int
    block_ids: Sequence[int]


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
        _check_processor(processor)
        self.allocator = cache.cache_allocators["full_attention"]
        self.page_size = int(self.allocator.tokens_per_page)
        cfg = config if isinstance(config, StoreConfig) else _load_config(config)
        if cfg.engine_blocks_per_block != 1:
            raise ConfigError(
                "engine_blocks_per_block: the transformers adapter stores one engine block per record; "
                "choose ContinuousBatchingConfig(page_size=...) instead"
            )
        self.kv_cache = _cache_view(cache, self.allocator)
        self.namespace = namespace = _namespace(processor, self.kv_cache, self.page_size, model_id, revision, namespace)
        self.engine_prefix_cache = engine_prefix_cache
        self.transformers_version = tf.__version__
        self.store = KVStore(cfg, kv_caches=[self.kv_cache], namespace=namespace)
        run_sync(self.store.start())
        self.connector = SchedulerConnector.from_store(self.store, block_size=self.page_size, step_loop=False)
        self.worker = WorkerConnector.from_store(self.store)
        self.counters: dict[str, int] = {
            "lookups": 0,
            "prompt_tokens": 0,
            "engine_hit_tokens": 0,
            "kvtier_hit_tokens": 0,
            "blocks_loaded": 0,
            "load_failures": 0,
            "fence_waits": 0,
            "errors": 0,
        }
        self.matches: OrderedDict[str, PrefixMatch] = OrderedDict()
        self._pinned: set[int] = set()  # engine blocks holding one fence reference of ours
        self._fence = True  # tests turn it off to show the race it prevents
        self._closed = False
        self._install()

    # -- hooks -----------------------------------------------------------------------------
    def _install(self) -> None:
        cache, sched = self.cache, self.scheduler
        self._orig = {
            "search_prefix_match": cache.search_prefix_match,
            "reset": cache.reset,
            "finish_request": sched.finish_request,
            "clear_cancelled_requests": sched.clear_cancelled_requests,
            "schedule_batch": sched.schedule_batch,
        }
        cache.search_prefix_match = self._search_prefix_match
        cache.reset = self._reset
        sched.finish_request = self._finish_request
        sched.clear_cancelled_requests = self._clear_cancelled_requests
        sched.schedule_batch = self._schedule_batch

    def _uninstall(self) -> None:
        for name in ("search_prefix_match", "reset"):
            self.cache.__dict__.pop(name, None)
        for name in ("finish_request", "clear_cancelled_requests", "schedule_batch"):
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
        alloc, pool, sched = self.allocator, self.cache.pool, self.connector
        page = self.page_size
        have = engine_tokens // page
        table = list(alloc.block_table.get(request_id, ()))[:have]
        view = _RequestView(request_id, prompt_ids, engine_tokens, table)
        pending = sched.pending_prefix_stores(view, engine_tokens)
        if pending:
            self._apply(self.worker.wait_for(pending))
        external, _ = sched.get_num_new_matched_tokens(view, engine_tokens)
        if not external:
            return 0
        count = external // page  # engine_tokens is whole pages: the load starts on a block boundary
        # Load only if the whole prompt then fits: half a prefix that starves the request helps no one.
        idx, per_sector = alloc.index, alloc.blocks_per_sector
        free = pool.count_free_blocks(idx)
        if free + pool.num_free_sectors * per_sector < math.ceil(len(prompt_ids) / page) - have:
            sched.update_state_after_alloc(view, table, 0)  # drops the offer
            return 0
        for _ in range(max(0, math.ceil((count - free) / per_sector))):
            pool.allocate_sector(idx)
        blocks = pool.get_free_blocks(idx, count)
        ok = 0
        try:
            sched.update_state_after_alloc(view, table + blocks, external)
            update = self._run(sched.build_immediate_meta())
            valid = update.loaded.get(request_id, engine_tokens)
            ok = max(0, min(count, (valid - engine_tokens) // page))
            if ok < count:
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

    def _clear_cancelled_requests(self) -> Any:
        # The engine drops cancelled requests here without finish_request: end them in the
        # connector too (their K/V is not stored), or their state would stay behind.
        cancelled = self._orig["clear_cancelled_requests"]()
        if not self._closed:
            for state in cancelled:
                try:
                    self._store_finished(state.request_id, cancelled=True)
                except Exception as exc:
                    self.counters["errors"] += 1
                    log.warning("kvtier cleanup of cancelled %s failed: %s", state.request_id, exc, exc_info=True)
        return cancelled

    def _store_finished(self, request_id: str, *, cancelled: bool = False) -> None:
        table = list(self.allocator.block_table.get(request_id, ()))
        state = None if cancelled else self.scheduler.active_requests.get(request_id)
        tokens: list[int] = []
        computed = 0
        if state is not None and state.status == self._finished_status and state.error is None:
            # Only the slots the engine wrote: the final sampled token's slot never is.
            tokens = list(state.initial_tokens) + list(state.generated_tokens)
            computed = min(int(state.position_offset), len(table) * self.page_size, len(tokens) - 1)
        # An errored or cancelled request reports nothing computed: its state is just dropped.
        view = _RequestView(request_id, tokens, max(0, computed), table)
        delay_free, _ = self.connector.request_finished(view, table)
        if delay_free:  # pragma: no cover - loads are waited for at the match, never in flight here
            log.warning("kvtier: request %s finished with a load in flight", request_id)
        meta = self.connector.build_immediate_meta()
        if not meta.empty:
            self._run(meta)

    def _schedule_batch(self, token_budget: int, cache_budget: int) -> Any:
        self._poll()
        out = self._orig["schedule_batch"](token_budget, cache_budget)
        if out[0] is None and self._pinned:
            # No room, and fenced blocks are part of why: wait until the stores have read them
            # (not for their tier writes: a slow disk never holds the engine) and try again.
            self.counters["fence_waits"] += 1
            self._poll(wait=True, device_only=True)
            out = self._orig["schedule_batch"](token_budget, cache_budget)
        return out

    def _reset(self) -> None:
        self._poll(wait=True)
        self._orig["reset"]()

    # -- connector plumbing ----------------------------------------------------------------
    def _run(self, meta: StepMetadata) -> ConnectorUpdate:
        """Fence ``meta``'s stores, run it at once on the worker side, apply the output."""
        if self._fence:
            ledger = self.allocator.ledger
            for job in meta.stores:
                for block in job.block_ids:
                    if block not in self._pinned:
                        ledger.acquire(block)
                        self._pinned.add(block)
        return self._apply(self.worker.run_now(meta))

    def _apply(self, output: WorkerOutput) -> ConnectorUpdate:
        """Hand the worker's output to the scheduler side; unpin the blocks it unfenced."""
        update = self.connector.update_connector_output(output)
        if update.unfenced and self._pinned:
            alloc = self.allocator
            back = []
            for block in update.unfenced:
                if block in self._pinned:
                    self._pinned.discard(block)
                    if alloc.ledger.release(block):
                        back.append(block)
            if back:
                self.cache.pool.free_blocks(alloc.index, back)
        return update

    def _poll(self, wait: bool = False, device_only: bool = False) -> None:
        """Apply finished jobs and drop the fences of stores done reading (engine thread, or
        after it stopped)."""
        if self._closed or self.store.transfers is None:
            return
        self._apply(self.worker.get_finished(block=wait, device_only=device_only))

    # -- public ----------------------------------------------------------------------------
    def flush(self) -> None:
        """Wait for every store in flight and apply it. Call it only while the engine's loop is
        not running (before ``start``, after ``stop``): the engine's ledger is not thread-safe."""
        if not self._closed:
            self.worker.flush()
        self._poll(wait=True)

    def stats(self) -> dict[str, Any]:
        """Adapter counters plus the store's statistics."""
        data: dict[str, Any] = dict(self.counters)
        k = self.connector.counters
        data["blocks_stored"] = k["stored_blocks"]
        data["store_jobs"] = k["store_jobs"]
        data["store_rejected"] = k["store_rejected_blocks"]
        data["store_failures"] = k["store_failed_blocks"]
        data["connector"] = dict(k)
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
