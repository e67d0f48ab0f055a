"""``kvtier.sim``: a reference paged-attention engine that drives the connector on CPU tensors.

See :mod:`kvtier.sim.engine` for the model (its state in :mod:`kvtier.sim.state`, its content in
:mod:`kvtier.sim.content`, its shape and report in :mod:`kvtier.sim.config`) and
:mod:`kvtier.sim.workloads` for the workloads;
``kvtier sim`` runs it from the command line.
"""

from typing import TYPE_CHECKING

from kvtier._lazy import lazy_exports

if TYPE_CHECKING:
    from kvtier.sim.config import SimConfig, SimReport
    from kvtier.sim.content import kv_content
    from kvtier.sim.engine import Simulator, run_sim
    from kvtier.sim.state import BlockPool, SimRequest
    from kvtier.sim.workloads import WORKLOADS, Session, Turn, make_workload

# Imported on first use: the kvtier command registers `kvtier sim` without importing torch.
__getattr__, __dir__ = lazy_exports(__name__, {
    **dict.fromkeys(["BlockPool", "SimRequest"], "kvtier.sim.state"),
    **dict.fromkeys(["SimConfig", "SimReport"], "kvtier.sim.config"),
    "kv_content": "kvtier.sim.content",
    **dict.fromkeys(["Simulator", "run_sim"], "kvtier.sim.engine"),
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
