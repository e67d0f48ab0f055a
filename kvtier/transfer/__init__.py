"""The transfer layer: moving bytes between the engine's paged KV cache and the tiers.

It owns the KV layout (batched gather / scatter), cross-device staging, job records and their
phases, the worker threads and CUDA streams that run the manager's plans, and the close-time
flush. It never decides what is stored or evicted: that is the manager's, and it only reports
job results back through ``kvtier.transfer.jobs.apply_result``.
"""

from kvtier.transfer.engine import JobResult, TransferEngine

__all__ = ["TransferEngine", "JobResult"]
