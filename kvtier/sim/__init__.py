"""``kvtier.sim``: a reference paged-attention engine that drives the connector on CPU tensors.

See :mod:`kvtier.sim.engine` for the model and :mod:`kvtier.sim.workloads` for the workloads;
``kvtier sim`` runs it from the command line.
"""

from kvtier.sim.engine import BlockPool, SimConfig, SimReport, SimRequest, Simulator, kv_content, run_sim
from kvtier.sim.workloads import WORKLOADS, Session, Turn, make_workload

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
