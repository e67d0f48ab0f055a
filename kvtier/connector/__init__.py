"""The engine-facing connector: scheduler side, worker side, and the messages between them.

The scheduler side (:class:`SchedulerConnector`) owns the :class:`~kvtier.manager.TierManager`
and turns scheduler steps into load jobs, store jobs and ``jobs_to_flush``. The worker side
(:class:`WorkerConnector`) owns a :class:`~kvtier.transfer.TransferEngine` and executes them
against one worker's KV cache. They exchange :class:`StepMetadata` and :class:`WorkerOutput`,
both of which serialise to msgpack bytes, so the halves can live in different processes.
See ``docs/integrating.md`` for a step-by-step mapping of an engine onto these calls.
:class:`FenceIndex` (which unacknowledged store jobs read which engine blocks) and
:class:`DeleteLedger` (copies workers may hold that the manager released) are the scheduler
side's bookkeeping, usable on their own by other integrations.
"""

from kvtier.connector.fence import FenceIndex
from kvtier.connector.ledger import DeleteLedger
from kvtier.connector.scheduler import ConnectorConfig, SchedulerConnector
from kvtier.connector.types import (
    ConnectorError,
    ConnectorUpdate,
    JobReport,
    LoadJob,
    Request,
    SchedulerStep,
    StepMetadata,
    StoreJob,
    WorkerOutput,
)
from kvtier.connector.worker import WorkerConnector

__all__ = [
    "ConnectorConfig",
    "ConnectorError",
    "ConnectorUpdate",
    "DeleteLedger",
    "FenceIndex",
    "JobReport",
    "LoadJob",
    "Request",
    "SchedulerConnector",
    "SchedulerStep",
    "StepMetadata",
    "StoreJob",
    "WorkerConnector",
    "WorkerOutput",
]
