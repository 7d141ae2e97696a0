"""Plain data crossing the engine/scheduler seam: what each hook takes and returns.

No engine types: an engine adapts its own request and scheduler-output objects to these.
They live in the spec so the implementation and the reference model take and return the
very same values, and refinement compares them directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcore.spec.plans import TransferPlan
from kvcore.spec.types import Key


@dataclass(frozen=True)
class RequestInfo:
    """A new request: its prompt length and chained block hashes so far.

    ``block_hashes`` are at ``hash_block_tokens`` granularity and grow as tokens are
    generated (pass the new ones in ``ScheduledRequest.new_hashes``).
    ``max_offload_tokens`` caps what this request stores; ``skip_reading`` means it must
    not load from the CPU tier (it still stores).
    """

    request_id: str
    prompt_tokens: int
    block_hashes: tuple[bytes, ...] = ()
    max_offload_tokens: int | None = None
    skip_reading: bool = False


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's part of an engine step.

    ``new_block_ids`` holds, per group, the GPU block ids appended to its block table this
    step (0 = null block); when ``resumed`` the table is rebuilt from them (re-admission
    after preemption). ``computed_tokens`` is what existed before the step,
    ``scheduled_tokens`` what the step computes, ``num_tokens`` the request's real length
    (prompt plus accepted output; unverified draft tokens excluded).
    """

    request_id: str
    scheduled_tokens: int
    computed_tokens: int
    num_tokens: int
    new_block_ids: tuple[tuple[int, ...], ...] = ()
    new_hashes: tuple[bytes, ...] = ()
    resumed: bool = False


@dataclass(frozen=True)
class StepInput:
    """An engine step: scheduled requests, preempted ids, every GPU id allocated this step."""

    requests: tuple[ScheduledRequest, ...] = ()
    preempted: tuple[str, ...] = ()
    allocated_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class StepPlan:
    """What the workers do this step: loads, stores, and jobs to wait for first."""

    loads: tuple[TransferPlan, ...] = ()
    stores: tuple[TransferPlan, ...] = ()
    flush: tuple[int, ...] = ()


@dataclass(frozen=True)
class WorkerReport:
    """One worker's word on one job."""

    worker: int
    job_id: int
    success: bool = True
    bytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class LoadFailure:
    """A load that failed: the engine must recompute these blocks (per group)."""

    request_id: str
    job_id: int
    block_ids: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class OutputResult:
    """What ``worker_output`` settled: finished jobs, loads done, loads to recompute."""

    completed: tuple[int, ...] = ()
    finished_loads: tuple[str, ...] = ()
    failed_loads: tuple[LoadFailure, ...] = ()
    failed_stores: tuple[int, ...] = ()


@dataclass(frozen=True)
class KeyEvent:
    """A key stored in or removed from the CPU tier, with its group."""

    key: Key
    group: int
    removed: bool


@dataclass
class SchedulerStats:
    """Counters since construction (or the last reset of the stats)."""

    lookups: int = 0
    deferrals: int = 0
    hit_tokens: int = 0
    loads: int = 0
    stores: int = 0
    chunks_loaded: int = 0
    chunks_stored: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    failed_loads: int = 0
    failed_stores: int = 0
    store_skipped_no_room: int = 0
    extra: dict[str, int] = field(default_factory=dict)

