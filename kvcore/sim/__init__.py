"""The engine simulator: real scheduler, manager and copies, deterministic from one seed.

``Simulator`` is also the worked example of wiring kvcore into an engine (docs/engine.md).
"""

from kvcore.sim._engine import IntegrityError, SimCounters, SimRequest, Simulator
from kvcore.sim._report import SimReport, simulate
from kvcore.sim._workload import SimOptions

__all__ = ["IntegrityError", "SimCounters", "SimOptions", "SimReport", "SimRequest",
           "Simulator", "simulate"]
