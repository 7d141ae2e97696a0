"""What crosses vLLM's process boundaries: the step's plan, and the workers' reports.

Both are plain dataclasses of kvcore's own (frozen, picklable) plan and report types, so
vLLM's serialisation carries them unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvcore.integrations.vllm import _compat as v
from kvcore.spec.errors import ArgumentTypeError
from kvcore.spec.hooks import WorkerReport
from kvcore.spec.plans import TransferPlan


@dataclass
class KvcoreConnectorMetadata(v.KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler -> workers for one step: loads, stores, and jobs to wait for first.

    ``flush`` holds the jobs whose source blocks were re-allocated or belong to preempted
    requests, plus every job a cache reset discarded: the workers wait for them before
    the forward pass writes any block.
    """

    loads: tuple[TransferPlan, ...] = ()
    stores: tuple[TransferPlan, ...] = ()
    flush: tuple[int, ...] = ()


@dataclass
class KvcoreWorkerMetadata(v.KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Workers -> scheduler: one ``WorkerReport`` (rank, job, success, bytes) per job.

    vLLM folds every rank's metadata with ``aggregate``; concatenating keeps each rank's
    word separate, so the scheduler settles a job only when all ranks reported it and
    fails it if any rank failed (summing counts, as upstream does, loses who failed).
    """

    reports: tuple[WorkerReport, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        # A list of reports is taken (the scheduler takes one); anything else is named
        # here, not by a concatenation failing when vLLM folds the ranks.
        reports = self.reports
        if not isinstance(reports, tuple | list) or any(
                type(r) is not WorkerReport for r in reports):
            raise ArgumentTypeError("KvcoreWorkerMetadata", "reports", reports,
                                    "a tuple of WorkerReport",
                                    "build each report with kvcore.WorkerReport")
        self.reports = tuple(reports)

    def aggregate(self, other: Any) -> KvcoreWorkerMetadata:
        if not isinstance(other, KvcoreWorkerMetadata):
            raise ArgumentTypeError("KvcoreWorkerMetadata.aggregate", "other", other,
                                    "KvcoreWorkerMetadata", "every rank must run "
                                    "KvcoreConnector (is another connector mixed in?)")
        return KvcoreWorkerMetadata(self.reports + other.reports)
