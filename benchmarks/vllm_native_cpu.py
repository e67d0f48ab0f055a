"""vLLM's own offloading (``OffloadingConnector`` + ``CPUOffloadingSpec``'s manager) on the CPU
platform, for ``bench_vllm_e2e.py``'s ``native`` arm: a small CPU copier stands in for its
CUDA-only worker.

vLLM 0.32's ``CPUOffloadingSpec.get_worker`` refuses any platform but CUDA-alike and XPU. This
spec keeps everything else of it (the scheduler side, ``CPUOffloadingManager`` with its LRU
policy, ``cpu_bytes_to_use``) and returns :class:`CpuCopyWorker`, which copies a job's blocks
between the engine's pages and one host tensor per KV tensor with ``index_select`` /
``index_copy_`` on the calling thread, so a job is finished when it is submitted. It is a
benchmark stand-in, not vLLM's code: its figures are labelled ``native (CPU copier)``.

Use: ``kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
"kv_connector_extra_config": {"spec_name": "NativeCpuCopySpec", "spec_module_path":
"vllm_native_cpu", "cpu_bytes_to_use": N}}`` with this folder on ``PYTHONPATH``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec


class CpuCopyWorker(OffloadingWorker):
    """Synchronous block copies between vLLM's pages and host tensors (chunk ``c`` holds
    rows ``c * blocks_per_chunk ..`` of each)."""

    def __init__(self, kv_caches: Any, num_chunks: int, blocks_per_chunk: int) -> None:
        self.engine = [t.tensor.view(t.tensor.shape[0], -1) for t in kv_caches.tensors]
        self.host = [torch.empty((num_chunks * blocks_per_chunk, t.shape[1]), dtype=t.dtype) for t in self.engine]
        self.n = blocks_per_chunk
        self.done: list[TransferResult] = []

    def _rows(self, chunk_ids: Any, count: int, skip: int) -> torch.Tensor:
        per = torch.arange(self.n)
        rows = (torch.as_tensor(chunk_ids, dtype=torch.long)[:, None] * self.n + per).reshape(-1)
        return rows[skip : skip + count]

    def _copy(self, job_id: int, engine_ids: Any, chunk_ids: Any, store: bool, skip: int = 0) -> bool:
        t0 = time.perf_counter()
        blocks = torch.as_tensor(engine_ids, dtype=torch.long)
        rows = self._rows(chunk_ids, len(blocks), skip)
        nbytes = 0
        for engine, host in zip(self.engine, self.host):
            if store:
                host.index_copy_(0, rows, engine.index_select(0, blocks))
            else:
                engine.index_copy_(0, blocks, host.index_select(0, rows))
            nbytes += len(blocks) * engine.shape[1] * engine.element_size()
        self.done.append(TransferResult(job_id, True, nbytes, time.perf_counter() - t0))
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._copy(job_id, src_spec.block_ids, dst_spec.block_ids, store=True)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        indices = getattr(dst_spec, "block_indices", None)
        skip = int(indices[0]) % self.n if indices is not None and len(indices) else 0
        return self._copy(job_id, dst_spec.block_ids, src_spec.block_ids, store=False, skip=skip)

    def get_finished(self) -> list[TransferResult]:
        done, self.done = self.done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every job finished inside its submit


class NativeCpuCopySpec(CPUOffloadingSpec):
    """``CPUOffloadingSpec`` with :class:`CpuCopyWorker` as its worker on any platform."""

    def get_worker(self, kv_caches: Any) -> OffloadingWorker:
        if self._worker is None:
            self._worker = CpuCopyWorker(kv_caches, self.num_chunks, self.blocks_per_chunk)  # type: ignore[assignment]
        return self._worker  # type: ignore[return-value]
