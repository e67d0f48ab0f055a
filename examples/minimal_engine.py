"""A minimal engine on kvtier's connector: three requests share a system prompt, finish, and are reused.

The engine has a paged KV cache, a block allocator, a step loop and a toy "model" that writes
K/V derived from each token's prefix; it keeps no prefix cache of its own, so every reused
token comes from kvtier. Run it with ``python examples/minimal_engine.py``. docs/integrating.md
explains each connector call; ``kvtier sim`` is the full reference engine.
"""

import asyncio
import tempfile
import zlib

import torch

import kvtier
from kvtier.connector import SchedulerConnector, SchedulerStep, StepMetadata, WorkerConnector

BLOCK = 16  # tokens per engine block
NUM_BLOCKS, LAYERS, WIDTH = 64, 2, 64  # the paged KV cache: [blocks, BLOCK, WIDTH] per layer
SYSTEM = list(range(1000, 1048))  # a 48-token system prompt every request starts with


def kv_of(tokens: list[int], layer: int) -> torch.Tensor:
    """The toy model: the K/V of the last token's slot depends on the whole prefix."""
    return torch.full((WIDTH,), zlib.crc32(repr((layer, tokens)).encode()) % 4093, dtype=torch.float32)


class Request:  # what kvtier.connector.Request reads
    def __init__(self, request_id: str, prompt: list[int], max_tokens: int = 4) -> None:
        self.request_id, self.token_ids, self.max_tokens = request_id, list(prompt), max_tokens
        self.prompt_len, self.num_computed_tokens, self.block_ids = len(prompt), 0, []


class Engine:
    def __init__(self, store: kvtier.KVStore, caches: list[torch.Tensor]) -> None:
        self.caches, self.free = caches, list(range(NUM_BLOCKS))
        self.scheduler = SchedulerConnector.from_store(store, block_size=BLOCK)  # scheduler process
        self.worker = WorkerConnector.from_store(store)  # each worker process, over its own store
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}
        self.finished: list[str] = []
        self.loaded_tokens: dict[str, int] = {}
        self.step_no = 0

    def allocate(self, req: Request, tokens: int, allocated: list[int]) -> None:
        while len(req.block_ids) * BLOCK < tokens:
            req.block_ids.append(self.free.pop(0))
            allocated.append(req.block_ids[-1])  # every block handed out, reported this step

    def step(self) -> None:
        self.step_no += 1
        scheduled: dict[str, int] = {}
        allocated: list[int] = []
        for req in list(self.waiting):  # admit: ask kvtier how much of the prompt it holds
            external, is_async = self.scheduler.get_num_new_matched_tokens(req, 0)
            if external is None:
                continue  # ask again next step
            self.waiting.remove(req)
            self.allocate(req, req.prompt_len, allocated)
            self.scheduler.update_state_after_alloc(req, req.block_ids, external if is_async else 0)
            if external and is_async:
                self.loading[req.request_id] = req  # parked until its load finishes
            else:
                self.running.append(req)
        for req in self.running:  # prefill what is left, or decode one token
            scheduled[req.request_id] = len(req.token_ids) - req.num_computed_tokens
            self.allocate(req, len(req.token_ids), allocated)
        meta = self.scheduler.build_connector_meta(
            SchedulerStep(self.step_no, scheduled, tuple(allocated), tuple(self.finished), ())
        )
        self.finished = []
        worker_meta = StepMetadata.from_bytes(meta.to_bytes())  # as if shipped to a worker process
        self.worker.handle_preemptions(worker_meta)
        self.worker.start_load_kv(worker_meta)
        done = self.forward(scheduled)
        update = self.scheduler.update_connector_output(self.worker.get_finished(block=True))
        for rid, valid in update.loaded.items():  # loaded requests resume from the first invalid token
            req = self.loading.pop(rid)
            req.num_computed_tokens = valid
            self.loaded_tokens[rid] = valid
            self.check(req, valid)
            self.running.append(req)
        for req in done:
            self.running.remove(req)
            delay_free, _ = self.scheduler.request_finished(req, req.block_ids)
            assert not delay_free  # only a request finished while loading keeps its blocks
            self.free.extend(req.block_ids)
            self.finished.append(req.request_id)

    def forward(self, scheduled: dict[str, int]) -> list[Request]:
        done = []
        for req in self.running:
            for p in range(req.num_computed_tokens, req.num_computed_tokens + scheduled[req.request_id]):
                for layer, cache in enumerate(self.caches):
                    cache[req.block_ids[p // BLOCK], p % BLOCK] = kv_of(req.token_ids[: p + 1], layer)
            req.num_computed_tokens += scheduled[req.request_id]
            req.token_ids.append(zlib.crc32(repr(req.token_ids).encode()) % 900 + 100)  # sample
            if len(req.token_ids) - req.prompt_len >= req.max_tokens:
                done.append(req)
        return done

    def check(self, req: Request, valid: int) -> None:
        for p in range(valid):  # every loaded slot holds what the model would have computed
            for layer, cache in enumerate(self.caches):
                assert torch.equal(cache[req.block_ids[p // BLOCK], p % BLOCK], kv_of(req.token_ids[: p + 1], layer))

    def run(self, *requests: Request) -> None:
        self.waiting.extend(requests)
        while self.waiting or self.running or self.loading or self.scheduler.has_pending_work():
            self.step()


async def main() -> None:
    caches = [torch.zeros(NUM_BLOCKS, BLOCK, WIDTH) for _ in range(LAYERS)]
    namespace = kvtier.Namespace(model_id="toy-model", dtype="float32", block_size=BLOCK)
    with tempfile.TemporaryDirectory() as tmp:
        config = {"tiers": [{"backend": "cpu", "capacity": "1MiB"},
                            {"backend": "lmdb", "path": f"{tmp}/lmdb", "capacity": "64MiB"}]}
        async with kvtier.open(config, kv_caches=caches, namespace=namespace) as store:
            engine = Engine(store, caches)
            a = Request("a", SYSTEM + list(range(1, 14)))  # 61 tokens, 65 with its answer
            engine.run(a)  # nothing stored yet: all computed; its full blocks are stored
            b, c = Request("b", [*SYSTEM, 7, 8, 9]), Request("c", [*SYSTEM, 6, 5, 4, 3, 2, 1])
            engine.run(b, c)  # both read the shared prefix from kvtier
            a2 = Request("a-turn-2", [*a.token_ids, 11, 12])  # the next turn reuses all of a
            engine.run(a2)
            for req in (b, c, a2):
                got = engine.loaded_tokens.get(req.request_id, 0)
                print(f"{req.request_id}: {got} of {req.prompt_len} prompt tokens loaded from kvtier")
            print("blocks held per tier:", {t["name"]: t["ready"] for t in store.stats()["tiers"]})


if __name__ == "__main__":
    asyncio.run(main())
