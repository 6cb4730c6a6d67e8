"""A discrete-event simulator of engine instances serving multi-turn sessions, driven by the policy classes.

Owns nothing itself; re-exports ``cost`` (the cost model and its fit), ``engine`` (the event loop and the
simulated instances), ``kvcache`` (block caches and the shared store), ``cluster`` (the simulated
``list_instances()`` signals and moves), ``run`` (policies, arrivals, ``simulate``) and ``metrics``. Simulated
time only: no wall clock, threads or sleeping. See ``docs/simulator.md``.
"""

from tensorcast.sim.cluster import SimCluster
from tensorcast.sim.cost import (
    CostModel,
    DecodeSample,
    Fit,
    FitError,
    OverheadSample,
    PrefillSample,
    busy_overlap,
    fit,
    fit_overheads,
    fit_transfer,
    relative_errors,
)
from tensorcast.sim.engine import EventLoop, SimConfig, SimInstance, SimRequest
from tensorcast.sim.kvcache import BlockCache, SharedStore, extend_keys
from tensorcast.sim.metrics import MoveRecord, SimResult, TurnRecord
from tensorcast.sim.run import ClosedLoop, Policy, Replay, simulate

__all__ = [
    "BlockCache",
    "ClosedLoop",
    "CostModel",
    "DecodeSample",
    "EventLoop",
    "Fit",
    "FitError",
    "MoveRecord",
    "OverheadSample",
    "Policy",
    "PrefillSample",
    "Replay",
    "SharedStore",
    "SimCluster",
    "SimConfig",
    "SimInstance",
    "SimRequest",
    "SimResult",
    "TurnRecord",
    "busy_overlap",
    "extend_keys",
    "fit",
    "fit_overheads",
    "fit_transfer",
    "relative_errors",
    "simulate",
]
