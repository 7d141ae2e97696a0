"""What a job leaves behind: its TransferResult, and the worker's record of a started job.

Results are values the scheduler reads (success, bytes, seconds, why it failed); a
``_Flight`` is a job the worker has started and not reported yet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvcore.spec.errors import KVCopyError


@dataclass(frozen=True)
class TransferResult:
    """A finished job: success or failure, the payload bytes moved, and how long it took.

    A failed job reports ``bytes == 0`` and ``error`` says why; the scheduler must treat it
    as failed (a failed store removes its keys, a failed load is recomputed). Validation
    failures moved no byte at all; only a CUDA driver error after enqueueing began (its
    message says so) can leave some destination blocks written, which failure covers too.
    """

    job_id: int
    success: bool
    bytes: int
    seconds: float
    error: str | None = None


MAX_IN_FLIGHT = 8  # CUDA jobs enqueued on the stream before the worker waits for the oldest


def _failed(job_id: int, exc: Exception, start: float) -> TransferResult:
    """A failed result for an exception raised while checking, copying or waiting."""
    text = str(exc) if isinstance(exc, KVCopyError) else f"{type(exc).__name__}: {exc}"
    return TransferResult(job_id, False, 0, time.perf_counter() - start, text)


@dataclass(frozen=True)
class _Flight:
    """A started job: finished (``result``) or on the GPU until ``event`` completes."""

    job_id: int
    nbytes: int
    start: float
    event: int | None
    result: TransferResult | None
