"""A simulated cluster for tests: real roles in one event loop on a virtual clock, seeded faults, invariants
checked after every step (``docs/simulation.md``)."""

from tensorcast.testing.sim.checker import Checker, InvariantBroken, page_for
from tensorcast.testing.sim.cluster import SimCluster, SimSettings, SimWorker
from tensorcast.testing.sim.loop import SimulationStalled, VirtualClock, VirtualLoop
from tensorcast.testing.sim.scenario import Outcome, run_seed, settle, simulate

__all__ = ["Checker", "InvariantBroken", "Outcome", "SimCluster", "SimSettings", "SimWorker", "SimulationStalled",
           "VirtualClock", "VirtualLoop", "page_for", "run_seed", "settle", "simulate"]
