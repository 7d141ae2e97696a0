"""One simulation run, end to end, summarised as plain data for the CLI."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvcore.sim._engine import Simulator
from kvcore.sim._workload import SimOptions
from kvcore.spec.types import OffloadConfig


@dataclass(frozen=True)
class SimReport:
    """What a run did: workload, hit rates, traffic, and how much was checked."""

    preset: str
    options: dict[str, Any]
    steps: int
    seconds: float
    requests_finished: int
    requests_aborted: int
    preemptions: int
    resets: int
    prompt_tokens: int
    offload_hit_tokens: int
    chunks_stored: int
    chunks_loaded: int
    chunks_evicted: int
    bytes_stored: int
    bytes_loaded: int
    deferrals: int
    failed_loads: int
    failed_stores: int
    loads_verified: int
    blocks_verified: int
    invariants_checked: dict[str, int] = field(default_factory=dict)

    @property
    def offload_hit_rate(self) -> float:
        return self.offload_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["offload_hit_rate"] = round(self.offload_hit_rate, 4)
        return out


def simulate(config: OffloadConfig, options: SimOptions, *, check: bool = True,
             device: str = "cpu") -> SimReport:
    """Run the workload until it settles; raises on any invariant or integrity failure."""
    start = time.perf_counter()
    sim = Simulator(config, options, check=check, device=device)
    counters = sim.run()
    stats = sim.scheduler.stats()
    mstats = sim.manager.stats()
    return SimReport(
        preset=config.name or "custom", options=asdict(sim.options), steps=counters.steps,
        seconds=round(time.perf_counter() - start, 3),
        requests_finished=counters.finished, requests_aborted=counters.aborted,
        preemptions=counters.preemptions, resets=counters.resets,
        prompt_tokens=counters.prompt_tokens, offload_hit_tokens=counters.loaded_tokens,
        chunks_stored=stats.chunks_stored, chunks_loaded=stats.chunks_loaded,
        chunks_evicted=mstats.evictions, bytes_stored=stats.bytes_stored,
        bytes_loaded=stats.bytes_loaded, deferrals=stats.deferrals,
        failed_loads=counters.failed_loads, failed_stores=counters.failed_stores,
        loads_verified=counters.loads_verified, blocks_verified=counters.blocks_verified,
        invariants_checked=dict(sorted({**sim.scheduler.checked, **sim.checked,
                                         **sim.manager.checked}.items())))
