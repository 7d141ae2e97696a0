"""Per-request state and the job table (with the fence index).

Keys are derived from the request's hashes when read (``GroupKeys``), never stored: a lookup of
a 128K-token DeepSeek-V4 prompt reads about 500 of its 50K keys, and the hashes are what
the request must keep anyway. Every index here is keyed by what a hook touches (a
request, a job, a GPU id), so a step costs O(new work and jobs in flight), never
O(context).
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

from kvcore._scan import stamp_ids, suffixed
from kvcore.spec.plans import JobKind, TransferPlan
from kvcore.spec.types import Key, OffloadConfig, make_key

# Hashes per frozen segment of a ``HashChain`` (a power of two: an index splits with a
# shift and a mask).
SEGMENT_BITS = 10
SEGMENT = 1 << SEGMENT_BITS


class HashChain:
    """One request's block hashes: append-only, in parts the garbage collector skips.

    A plain list of hashes is a container the cyclic collector walks on every full
    collection, one visit (and cache miss) per hash: the lists of 256 DeepSeek-V4
    requests of 32K tokens (2M hashes) made a full collection 127 ms instead of 85, and
    the youngest generation walked each admitted prompt's list again. Here the prompt's
    hashes are kept as the tuple they came in (``_base``: ``check_hashes`` hands one on),
    not copied; every ``SEGMENT`` hashes added later are frozen into a tuple. A tuple
    holding only ``bytes`` is untracked the first time the collector sees it, so what
    stays tracked is the chain, its short list of segments and the tail (under
    ``SEGMENT`` hashes). The prompt's tuple is the engine's own when it passed a tuple:
    slicing it into segments, as this did before, made a second reference to every
    hash (8 bytes a hash block, a fifth of kvcore's) and 32 more tuples of 1,024 for
    the collector's next pass after a 128K-token admission. A read is a method call
    (about 0.2 us, against 25 ns from a list): the store path reads a few keys a step
    that way; lookups read by ``strided``, one C-level slice per part.
    """

    __slots__ = ("_base", "_segments", "_tail", "size")

    def __init__(self, hashes: Sequence[bytes] = ()) -> None:
        self._base: tuple[bytes, ...] = ()
        self._segments: list[tuple[bytes, ...]] = []
        self._tail: list[bytes] = []
        # len(self), kept as an attribute: every scheduled request's checks and every key
        # read ask for it, and an attribute read costs no method call.
        self.size = 0
        self.extend(hashes)

    def extend(self, hashes: Sequence[bytes]) -> None:
        if not self.size and type(hashes) is tuple:
            # The first hashes, as a tuple (a prompt's): kept whole, no copy.
            self._base = hashes
            self.size = len(hashes)
            return
        self.size += len(hashes)
        tail = self._tail
        tail.extend(hashes)
        if len(tail) >= SEGMENT:
            whole = len(tail) - len(tail) % SEGMENT
            self._segments.extend(tuple(tail[at:at + SEGMENT])
                                  for at in range(0, whole, SEGMENT))
            del tail[:whole]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> bytes:
        """Hash ``index``, ``0 <= index < len(self)``. No negative indexes: kvcore never
        reads from the end (``GroupKeys`` resolves its own negatives first), and a branch
        nothing calls is a branch nothing checks."""
        if index < 0:
            raise IndexError(f"hash index {index} is negative")
        base = self._base
        if index < len(base):
            return base[index]
        index -= len(base)
        frozen = len(self._segments) << SEGMENT_BITS
        if index < frozen:
            return self._segments[index >> SEGMENT_BITS][index & (SEGMENT - 1)]
        return self._tail[index - frozen]

    def strided(self, start: int, stop: int, step: int) -> list[bytes]:
        """``hashes[start:stop:step]`` for ``0 <= start``, ``0 <= stop`` and ``step >= 1``."""
        stop = min(stop, self.size)
        base = self._base
        out: list[bytes] = []
        if start < len(base):
            end = min(stop, len(base))
            out.extend(base[start:end:step])
            start += -(-(end - start) // step) * step  # the first index >= end on the stride
        # The rest counts from the end of the base.
        at, stop = start - len(base), stop - len(base)
        segments = self._segments
        frozen = len(segments) << SEGMENT_BITS
        limit = min(stop, frozen)
        # One pass per segment the range meets, a for loop: bounded by its form. (``at``
        # is negative only when the range ended inside the base, and then >= limit.)
        segments_met = range(at >> SEGMENT_BITS, ((limit - 1) >> SEGMENT_BITS) + 1) \
            if at < limit else range(0)
        for index in segments_met:
            first = index << SEGMENT_BITS
            if at >= first + SEGMENT:
                continue  # a stride longer than a segment stepped over this one
            end = min(limit, first + SEGMENT)
            out.extend(segments[index][at - first:end - first:step])
            at += -(-(end - at) // step) * step
        if at < stop:
            out.extend(self._tail[at - frozen:stop - frozen:step])
        return out


class GroupKeys:
    """One group's chunk keys as a read-only sequence over the request's ``HashChain``.

    Chunk ``i`` of a group with ``hpc`` hashes per chunk ends at hash ``(i + 1) * hpc - 1``,
    and its key is that hash plus the group suffix (``make_key``); the chain only
    grows, so the length follows it and nothing is cached that could go stale. The
    hashes are ``bytes`` (``check_hashes`` admits no other type), so ``hash + suffix``
    is exactly ``make_key(hash, group)``.
    """

    __slots__ = ("_hashes", "_hpc", "_suffix")

    def __init__(self, hashes: HashChain, hashes_per_chunk: int, group: int) -> None:
        self._hashes = hashes
        self._hpc = hashes_per_chunk
        # make_key's encoding of the group, computed once (and range-checked by it).
        self._suffix = make_key(b"", group)

    def __len__(self) -> int:
        return self._hashes.size // self._hpc

    @property
    def suffix(self) -> bytes:
        """The group's bytes every key ends with (``make_key(b"", group)``)."""
        return self._suffix

    def chunk_hashes(self, lo: int, hi: int) -> list[bytes]:
        """The last hash of each chunk in ``[lo, hi)`` (``0 <= lo``): each chunk's key less
        the suffix, for a tier that takes one group's keys as hashes and the suffix
        (``CPUOffloadManager.lookup_hashes``), so no key object is made."""
        hpc = self._hpc
        hi = min(hi, self._hashes.size // hpc)
        if lo >= hi:
            return []
        return self._hashes.strided((lo + 1) * hpc - 1, hi * hpc, hpc)

    @overload
    def __getitem__(self, index: int) -> Key: ...

    @overload
    def __getitem__(self, index: slice) -> list[Key]: ...

    def __getitem__(self, index: int | slice) -> Key | list[Key]:
        hpc, hashes, suffix = self._hpc, self._hashes, self._suffix
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step < 1:
                return [hashes[(i + 1) * hpc - 1] + suffix for i in range(start, stop, step)]
            if start >= stop:
                return []
            # Chunk ends are every hpc-th hash: strided slices, no index arithmetic; the
            # keys are made in C (the hashes are exact bytes: ``check_hashes``).
            return suffixed(hashes.strided((start + 1) * hpc - 1, stop * hpc, hpc * step),
                            suffix)
        n = hashes.size // hpc
        at = index + n if index < 0 else index
        if not 0 <= at < n:
            raise IndexError(f"chunk {index} outside 0..{n - 1}")  # the index as passed
        return hashes[(at + 1) * hpc - 1] + suffix

    def __iter__(self) -> Iterator[Key]:
        yield from self[:]


# Block ids are below num_gpu_blocks <= 2**24 (``OffloadConfig`` refuses more), so a C int
# (4 bytes on every platform CPython supports) holds any of them.
ID_TYPECODE = "i"


class Placements:
    """The step each position of one window table was placed at, as runs.

    Positions are only ever appended, one step after another, so the steps never
    decrease along the table: run ``r`` covers positions ``starts[r]`` up to the next
    run's start (or the table's end) and all of them were placed at ``steps[r]``. A
    prefill's whole table is one run instead of one 8-byte stamp per position (at 128K
    DeepSeek-V4 tokens that was 13 of the 220 bytes each hash block cost); a decode step
    that appends a block adds one run (16 bytes).
    """

    __slots__ = ("starts", "steps")

    def __init__(self) -> None:
        self.starts: array[int] = array("q")
        self.steps: array[int] = array("q")

    def place(self, first: int, step: int) -> None:
        """Positions from ``first`` (the table's old length) on were placed at ``step``."""
        steps = self.steps
        if not steps or steps[-1] != step:
            self.starts.append(first)
            steps.append(step)


@dataclass
class RequestState:
    """What the scheduler remembers of one request between hooks."""

    request_id: str
    prompt_tokens: int
    max_offload_tokens: int | None
    skip_reading: bool
    hashes: HashChain
    keys: list[GroupKeys]
    # Block tables as 4-byte int arrays (``ID_TYPECODE``), not lists: 4 bytes a position
    # and nothing for the cyclic garbage collector to walk (lists of a 128K-token
    # request's 50K ids, times 256 requests, made each full collection 60 ms longer).
    tables: list[array[int]]
    cursors: list[int]
    jobs: set[int] = field(default_factory=set)
    finished: bool = False
    # (computed_tokens, hit) of the latest lookup that answered a number: the only load
    # after_alloc accepts. None after PENDING or once after_alloc consumed it.
    looked_up: tuple[int, int] | None = None
    # Per window-group table, the step that placed each position's id (never used for
    # FULL groups): the id is stale once it was allocated again at a later step
    # (``StaleWindows``).
    placed: list[Placements] = field(default_factory=list)

    def clear_tables(self) -> None:
        """Forget every block table (the engine resends them whole)."""
        n = len(self.tables)
        self.tables = [array(ID_TYPECODE) for _ in range(n)]
        self.placed = [Placements() for _ in range(n)]

    @classmethod
    def fresh(cls, cfg: OffloadConfig, request_id: str, prompt_tokens: int,
              max_offload_tokens: int | None, skip_reading: bool,
              hashes: HashChain) -> RequestState:
        """A new request's state; its keys read ``hashes`` (extend that chain in place)."""
        n = len(cfg.groups)
        keys = [GroupKeys(hashes, cfg.hashes_per_chunk(g), g) for g in range(n)]
        return cls(request_id, prompt_tokens, max_offload_tokens, skip_reading, hashes,
                   keys, [array(ID_TYPECODE) for _ in range(n)], [0] * n,
                   placed=[Placements() for _ in range(n)])


@dataclass
class Job:
    """A job in flight: its plan, reports so far, and the GPU ids it fences."""

    plan: TransferPlan
    reporters: set[int] = field(default_factory=set)
    failed: bool = False
    window_sources: frozenset[int] = frozenset()
    # Fenced when the request finishes: a store's FULL sources, a load's destinations.
    other_sources: frozenset[int] = frozenset()

    def settled(self, num_workers: int) -> bool:
        """Every worker has reported: each copies its own shard, so a job settled on
        fewer reports frees slots and serves keys whose bytes are still moving (J2)."""
        return len(self.reporters) == num_workers


class JobTable:
    """Jobs in flight, the GPU ids each store job fences, and the keys being loaded.

    The fence is kept per job (job -> the ids it reads), not per id: a prefill's store
    reads thousands of blocks, and registering then unregistering each of them cost more
    than the rest of its completion. The per-step question ("which jobs read any of the
    ids allocated now?") asks each job in flight once, with a C-level set test.
    """

    def __init__(self) -> None:
        self.jobs: dict[int, Job] = {}
        self.fenced: dict[int, frozenset[int]] = {}
        self.loading: dict[Key, int] = {}
        self.next_id = 1
        self.stale_below = 1

    def new_id(self) -> int:
        job_id = self.next_id
        self.next_id += 1
        return job_id

    def add(self, job: Job) -> None:
        self.jobs[job.plan.job_id] = job
        if job.plan.kind is JobKind.LOAD:
            for key in job.plan.keys:
                self.loading[key] = self.loading.get(key, 0) + 1
        self.fence_ids(job.plan.job_id, job.window_sources)

    def fence_ids(self, job_id: int, ids: frozenset[int]) -> None:
        """Register ``ids`` as read by ``job_id`` until it completes (F1)."""
        if not ids:
            return
        held = self.fenced.get(job_id)
        self.fenced[job_id] = ids if held is None else held | ids

    def remove(self, job_id: int) -> Job:
        job = self.jobs.pop(job_id)
        if job.plan.kind is JobKind.LOAD:
            for key in job.plan.keys:
                left = self.loading[key] - 1
                if left:
                    self.loading[key] = left
                else:
                    del self.loading[key]
        self.fenced.pop(job_id, None)
        return job

    def jobs_reading(self, ids: frozenset[int]) -> set[int]:
        """Store jobs whose fenced sources include any of ``ids``."""
        if not ids:
            return set()
        return {job_id for job_id, held in self.fenced.items() if not held.isdisjoint(ids)}

    def fenced_sources(self) -> dict[int, frozenset[int]]:
        """job -> fenced GPU ids (for the F1 check)."""
        return dict(self.fenced)

    def clear(self) -> None:
        self.jobs.clear()
        self.fenced.clear()
        self.loading.clear()
        self.stale_below = self.next_id


class StaleWindows:
    """Which window-table positions hold an id the engine freed and handed out again.

    A window or Mamba block id allocated at step ``s`` is stale in every table position
    that received it at an earlier step: that block now holds another request's KV, and
    storing it under the old key would poison the tier. Instead of an index from each id
    to the positions holding it (a dict entry and tuple per window block, about 400 bytes
    per hash block at 128K tokens, and a walk over it every step), each id keeps the step
    it was last allocated at, each position the step it was placed at, and a position is
    checked (and zeroed, once and for good) only when a store is about to read it. The
    answer is the same: staleness only ever goes from false to true.
    """

    __slots__ = ("allocated_at", "stamped", "step")

    def __init__(self, stamped: bool = True) -> None:
        """``stamped=False`` for a layout without window groups: no table is ever checked,
        so ids get no stamps (a resumed 128K-token Llama request hands out 16K ids, 0.5 ms
        of a step to stamp one by one)."""
        self.stamped = stamped
        self.step = 0
        # allocated_at[id]: the latest step ``id`` was in ``allocated_ids`` (0: never).
        # Ids are below ``num_gpu_blocks``; the array grows to the largest id seen.
        self.allocated_at: array[int] = array("q")

    def advance(self, allocated: frozenset[int]) -> None:
        """A new step whose ``allocated_ids`` (validated: 1..num_gpu_blocks-1) are these."""
        self.step += 1
        if not allocated or not self.stamped:
            return
        at = self.allocated_at
        top = max(allocated) + 1
        if top > len(at):
            at.frombytes(bytes(8 * (top - len(at))))
        # One C pass (a resumed request hands out its whole table).
        stamp_ids(at, allocated, self.step)

    def zero_stale(self, table: array[int], placed: Placements, lo: int, hi: int) -> None:
        """Zero the stale ids of ``table[lo:hi]``, one placement run at a time."""
        step, at = self.step, self.allocated_at
        starts, steps = placed.starts, placed.steps
        hi = min(hi, len(table))
        runs = len(starts)
        first = bisect_right(starts, lo) - 1
        if first < 0:
            return
        # A for loop over the runs, not a while loop on lo: one pass per run whatever the
        # body does, so no slip in it can turn a store into a hang.
        for run in range(first, runs):
            if lo >= hi:
                return
            placed_at = steps[run]
            if placed_at >= step:
                # Placed this step, and so is everything after it: nothing was allocated
                # after them, so a prefill's fresh table costs one bisection.
                return
            end = min(hi, starts[run + 1]) if run + 1 < runs else hi
            for pos in range(lo, end):
                gpu_id = table[pos]
                if gpu_id and gpu_id < len(at) and at[gpu_id] > placed_at:
                    table[pos] = 0
            lo = end
