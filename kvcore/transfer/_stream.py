"""A seeded stand-in for the CUDA stream, so the engine's asynchronous path runs on CPU.

On CUDA the worker enqueues a job, records an event behind it and goes on; the job is
reported only when its event has completed, up to ``MAX_IN_FLIGHT`` jobs later. On a
machine without a GPU that path (the flight of events, their reuse, the order jobs
retire in) would never run, and the C path copies before ``submit``'s job is even
reported, so a result reported before its bytes land could not be seen. ``SimulatedStream``
has ``CudaCopier``'s interface over CPU tensors: ``copy`` validates at once, as the CUDA
library does before enqueueing, and queues the copy; the queue runs in stream order when
an event behind it is waited for, and a seeded number of steps further at each query, as
a GPU progressing on its own would. An event that is unknown or destroyed raises, as the
driver's error would; so does one recorded again while pending, which the driver allows
but which would report the earlier job when the later one's copy is done.

With ``faults`` > 0 the stand-in also fails copies on purpose, as a CUDA error raised
while the stream runs a copy would (an illegal address, an ECC error): a seeded share of
jobs fail there, half of them before any byte lands and half after every byte has. The
choice is a function of the seed and the job id alone (``injected_fault``), so a checker
knows which jobs the engine must report failed without asking the engine or the stream.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from typing import Any

from kvcore import _native
from kvcore._native import DescriptorTable, RegionTable

# Events one stand-in stream may hold; the engine uses MAX_IN_FLIGHT of them.
MAX_EVENTS = 64


# What ``injected_fault`` answers: no fault, a fault before the copy, one after it.
NO_FAULT, FAULT_BEFORE, FAULT_AFTER = 0, 1, 2


class StreamMisuse(RuntimeError):
    """The engine used an event as the CUDA driver would refuse (or silently get wrong)."""


class SimulatedFault(RuntimeError):
    """A copy the stand-in stream failed on purpose (``faults``), as a device error would."""


def injected_fault(seed: int, job_id: int, faults: float) -> int:
    """Whether the stand-in with ``seed`` and ``faults`` fails job ``job_id``'s copy, and
    when: NO_FAULT, FAULT_BEFORE (nothing copied) or FAULT_AFTER (every byte copied).

    Keyed by job, not by call order, so a checker can name the jobs that must fail from
    its own records, whatever order the engine enqueued them in.
    """
    if faults <= 0.0:
        return NO_FAULT
    draw = random.Random(f"fault:{seed}:{job_id}")
    if draw.random() >= faults:
        return NO_FAULT
    return FAULT_BEFORE if draw.random() < 0.5 else FAULT_AFTER


class SimulatedStream:
    """One stream of deferred CPU copies and the events recorded on it (one thread)."""

    def __init__(self, seed: int, faults: float = 0.0) -> None:
        self._seed = seed
        self._faults = faults
        self._rng = random.Random(f"stream:{seed}")
        self._ops: deque[int | Callable[[], None]] = deque()  # an event's id, or a copy
        self._live: set[int] = set()
        self._pending: set[int] = set()  # recorded, not yet passed
        # A deferred copy's failure waits for the next event recorded behind it, and is
        # raised by the first query or wait that finds that event passed (later copies
        # still run: a stand-in, not a sticky CUDA context).
        self._error: Exception | None = None
        self._failed: dict[int, Exception] = {}
        self._next_event = 1

    def copy(self, regions: RegionTable, descs: DescriptorTable, stream: int, *,
             method: int = 0, kernel_ctas: int = 0, **funnel: Any) -> None:
        """Validate now (KVCopyError, nothing queued); copy when the stream gets there."""
        _native.validate(regions, descs, **funnel)
        fault = injected_fault(self._seed, funnel.get("job_id", -1), self._faults)

        def run() -> None:
            if fault != FAULT_BEFORE:
                _native.copy(regions, descs, **funnel)
            if fault != NO_FAULT:
                when = "before" if fault == FAULT_BEFORE else "after"
                raise SimulatedFault(f"job {funnel.get('job_id')}: a device error injected "
                                     f"{when} the copy (simulate_faults)")
        self._ops.append(run)

    def event_create(self) -> int:
        if len(self._live) >= MAX_EVENTS:
            raise StreamMisuse(f"more than {MAX_EVENTS} events alive")
        event, self._next_event = self._next_event, self._next_event + 1
        self._live.add(event)
        return event

    def event_record(self, event: int, stream: int) -> None:
        self._known(event, "recording")
        if event in self._pending:
            raise StreamMisuse(f"event {event} recorded again before it completed: the "
                               "earlier job would be reported by the later one's copy")
        self._pending.add(event)
        self._ops.append(event)

    def event_done(self, event: int) -> bool:
        """Non-blocking; the stream first runs a seeded number of its queued steps."""
        self._known(event, "querying")
        self._run(self._rng.randrange(len(self._ops) + 1))
        return self._passed(event)

    def event_synchronize(self, event: int) -> None:
        """Run the queue up to ``event``: at most its length in steps (bounded, so a
        queue that does not advance is an error, not a hang)."""
        self._known(event, "waiting for")
        for _ in range(len(self._ops)):
            if event not in self._pending:
                break
            self._run(1)
        if event in self._pending:
            raise StreamMisuse(f"event {event} is still pending after its whole queue ran")
        self._passed(event)

    def event_destroy(self, event: int) -> None:
        """As ``cuEventDestroy``: allowed while recorded work is pending (the event goes
        when that work is done)."""
        self._known(event, "destroying")
        self._live.discard(event)

    def close(self) -> None:
        self._run(len(self._ops))

    def live_events(self) -> int:
        """Events created and not destroyed (0 once the engine has closed)."""
        return len(self._live)

    def _known(self, event: int, doing: str) -> None:
        if event not in self._live:
            raise StreamMisuse(f"{doing} event {event}, which is not alive")

    def _run(self, steps: int) -> None:
        for _ in range(min(steps, len(self._ops))):
            op = self._ops.popleft()
            if not isinstance(op, int):
                try:
                    op()
                except Exception as exc:  # surfaces at the event behind it, as on CUDA
                    self._error = self._error or exc
            else:
                event = op
                self._pending.discard(event)
                if self._error is not None:
                    self._failed[event], self._error = self._error, None

    def _passed(self, event: int) -> bool:
        """Whether the stream is past ``event``; a deferred copy's failure raises here."""
        if event in self._pending:
            return False
        error = self._failed.pop(event, None)
        if error is not None:
            raise error
        return True
