"""``kvtier.sim``: a reference paged-attention engine that drives the connector on CPU tensors.

See :mod:`kvtier.sim.engine` for the model and :mod:`kvtier.sim.workloads` for the workloads;
``kvtier sim`` runs it from the command line.
"""

from typing import TYPE_CHECKING

from kvtier._lazy import lazy_exports

if TYPE_CHECKING:
    from kvtier.sim.engine import BlockPool, SimConfig, SimReport, SimRequest, Simulator, kv_content, run_sim
    from kvtier.sim.workloads import WORKLOADS, Session, Turn, make_workload

# Imported on first use: the kvtier command registers `kvtier sim` without importing torch.
__getattr__, __dir__ = lazy_exports(__name__, {
    **dict.fromkeys(["BlockPool", "SimConfig", "SimReport", "SimRequest", "Simulator", "kv_content", "run_sim"], "kvtier.sim.engine"),
    **dict.fromkeys(["WORKLOADS", "Session", "Turn", "make_workload"], "kvtier.sim.workloads"),
})

__all__ = [
    "WORKLOADS",
    "BlockPool",
    "Session",
    "SimConfig",
    "SimReport",
    "SimRequest",
    "Simulator",
    "Turn",
    "kv_content",
    "make_workload",
    "run_sim",
]
