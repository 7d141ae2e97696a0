"""The reference scheduler: the engine hooks of ``OffloadScheduler``, in the simplest correct code.

This is the canonical history the implementation is compared against (TigerBeetle's state
checker): the refinement state machine drives ``kvcore.OffloadScheduler`` and this model
with the same hook calls and asserts equal observable results after every call. It is
written to be obviously right, not fast:

- keys are recomputed from the hashes on every call (``group_keys``);
- the hit is ``spec.lookup.spec_hit`` over the full hit map read from the manager, not a
  convergence loop; loads are ``spec.load.load_plan``; stores are ``spec.store``'s offers;
- the job table is one dict; a request's jobs, the keys being loaded and the fence are
  found by scanning it; stale window blocks are found by scanning every tracked table.

Hook semantics (DESIGN.md; where a rule is a choice DESIGN.md leaves open, the choice is
stated here so that the implementation has a definition to match):

- ``lookup`` rebuilds the request's block tables from the next step (the engine hands them
  over again), answers PENDING while the request has jobs (J1), 0 when it skips reading,
  else the spec's hit; it touches FULL groups' keys whole and each window group's keys
  from ``W + e`` chunks before the boundary reached (the hit, or C when PENDING).
- ``after_alloc`` pins the chunks of the load and, under ``StoreLevel.BLOCK``, moves every
  cursor to ``cdiv(C + hit, o)`` (the request hit those chunks; someone stored them). The
  load is returned at once and again in the next ``build_step``.
- Job ids count up from 1, shared by loads and stores; reports below the id reached at the
  last ``reset`` are ignored.
- ``build_step``: a GPU id allocated this step is stale wherever an older table entry holds
  it, so it is zeroed there (never stored under its old key); stores whose fenced sources
  (SLIDING and MAMBA ids from creation, since the engine frees those blocks while the
  request runs; FULL ids once the request finished) are re-allocated, and every job of a
  preempted request, are flushed. A request with a load in flight stores nothing that
  step; a ``prepare_store`` answering None moves no cursor.
- ``worker_output`` counts reports; a job completes at exactly ``num_workers`` (J2).
- Every hook checks its whole input before it changes anything: a rejected call (an
  unknown request or job, a duplicate report, block lists of the wrong group count,
  hashes or block tables shorter than the tokens claimed) leaves the state as it was.

Inputs are duck-typed (``kvcore.scheduler``'s hook dataclasses fit the protocols below),
because ``spec`` imports nothing from ``kvcore``. The outputs are this module's own
dataclasses with the same field names, in the same order, as ``kvcore.scheduler``'s, so
``dataclasses.astuple`` of either compares equal. Errors are ``kvcore.spec.errors``'s, the
same classes the implementation raises.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass, field, replace
from typing import Protocol

from kvcore.spec.errors import (
    BadReportError,
    BadStepError,
    UnknownJobError,
    UnknownRequestError,
)
from kvcore.spec.hooks import KeyEvent, LoadFailure, OutputResult, SchedulerStats, StepPlan
from kvcore.spec.load import load_plan
from kvcore.spec.lookup import spec_hit
from kvcore.spec.manager_model import ReferenceManager
from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan
from kvcore.spec.store import chunk_source_blocks, group_offer, storable_prefix, store_end
from kvcore.spec.types import (
    PENDING,
    GroupKind,
    Key,
    LookupResult,
    OffloadConfig,
    StoreLevel,
    cdiv,
    group_keys,
    key_group,
)

# -- inputs (duck-typed) ------------------------------------------------------------------


class RequestLike(Protocol):
    """A new request (``kvcore.scheduler.RequestInfo`` fits)."""

    @property
    def request_id(self) -> str: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def block_hashes(self) -> Sequence[bytes]: ...
    @property
    def max_offload_tokens(self) -> int | None: ...
    @property
    def skip_reading(self) -> bool: ...


class ScheduledLike(Protocol):
    """One request's part of a step (``kvcore.scheduler.ScheduledRequest`` fits)."""

    @property
    def request_id(self) -> str: ...
    @property
    def scheduled_tokens(self) -> int: ...
    @property
    def computed_tokens(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def new_block_ids(self) -> Sequence[Sequence[int]]: ...
    @property
    def new_hashes(self) -> Sequence[bytes]: ...
    @property
    def resumed(self) -> bool: ...


class StepLike(Protocol):
    """An engine step (``kvcore.scheduler.StepInput`` fits)."""

    @property
    def requests(self) -> Sequence[ScheduledLike]: ...
    @property
    def preempted(self) -> Sequence[str]: ...
    @property
    def allocated_ids(self) -> Set[int]: ...


class ReportLike(Protocol):
    """One worker's word on one job (``kvcore.scheduler.WorkerReport`` fits)."""

    @property
    def worker(self) -> int: ...
    @property
    def job_id(self) -> int: ...
    @property
    def success(self) -> bool: ...
    @property
    def bytes(self) -> int: ...


# -- state --------------------------------------------------------------------------------


@dataclass
class _Request:
    prompt_tokens: int
    max_offload_tokens: int | None
    skip_reading: bool
    hashes: list[bytes]
    tables: list[list[int]]
    cursors: list[int]
    finished: bool = False


@dataclass
class _Job:
    plan: TransferPlan
    reporters: set[int] = field(default_factory=set)
    failed: bool = False
    fenced: set[int] = field(default_factory=set)
    fence_at_finish: frozenset[int] = frozenset()


class ReferenceScheduler:
    """The reference for ``kvcore.OffloadScheduler``: same hooks, same observable results."""

    def __init__(self, config: OffloadConfig, manager: ReferenceManager | None = None) -> None:
        self.config = config
        self.manager = manager if manager is not None else ReferenceManager(config.num_cpu_blocks)
        self.requests: dict[str, _Request] = {}
        self.jobs: dict[int, _Job] = {}
        self.queued_loads: list[TransferPlan] = []
        self.next_job_id = 1
        self.stale_below = 1
        self._stats = SchedulerStats()

    # -- derived views (recomputed on every use) -------------------------------------------

    def _req(self, request_id: str) -> _Request:
        if request_id not in self.requests:
            raise UnknownRequestError(f"request {request_id!r} is not tracked; call "
                                      "add_request first")
        return self.requests[request_id]

    def _keys(self, req: _Request) -> list[list[Key]]:
        return [group_keys(self.config, g, req.hashes) for g in range(len(self.config.groups))]

    def _jobs_of(self, request_id: str) -> list[_Job]:
        return [job for job in self.jobs.values() if job.plan.request_id == request_id]

    def _loading_keys(self) -> set[Key]:
        return {k for job in self.jobs.values() if job.plan.kind is JobKind.LOAD
                for k in job.plan.keys}

    def _new_job_id(self) -> int:
        job_id = self.next_job_id
        self.next_job_id += 1
        return job_id

    # -- requests ------------------------------------------------------------------------

    def add_request(self, info: RequestLike) -> None:
        """Start tracking a request."""
        if info.request_id in self.requests:
            raise BadStepError(f"request {info.request_id!r} is already tracked")
        n = len(self.config.groups)
        self.requests[info.request_id] = _Request(
            info.prompt_tokens, info.max_offload_tokens, info.skip_reading,
            list(info.block_hashes), [[] for _ in range(n)], [0] * n)

    def add_hashes(self, request_id: str, hashes: Sequence[bytes]) -> None:
        """Append newly completed block hashes."""
        self._req(request_id).hashes.extend(hashes)

    # -- lookup --------------------------------------------------------------------------

    def lookup(self, request_id: str, computed_tokens: int, num_tokens: int, *,
               max_tokens: int | None = None) -> LookupResult:
        """The spec's hit over the manager's full hit map; PENDING while jobs are in flight.

        ``max_tokens`` caps the hit (the largest supported boundary at or below the cap).
        """
        req = self._req(request_id)
        hbt = self.config.hash_block_tokens
        if num_tokens // hbt > len(req.hashes):
            raise BadStepError(f"request {request_id!r}: {num_tokens} tokens claimed but "
                               f"only {len(req.hashes)} hashes of {hbt} tokens were given")
        if not 0 <= computed_tokens <= num_tokens:
            raise BadStepError(f"request {request_id!r}: computed_tokens={computed_tokens} "
                               f"outside 0..{num_tokens}")
        if max_tokens is not None and (isinstance(max_tokens, bool)
                                       or not isinstance(max_tokens, int) or max_tokens < 0):
            raise BadStepError(f"request {request_id!r}: max_tokens={max_tokens!r} must be "
                               "None (no cap) or an int >= 0")
        req.tables = [[] for _ in self.config.groups]
        self._stats.lookups += 1
        if self._jobs_of(request_id):
            self._stats.deferrals += 1
            return PENDING
        if req.skip_reading:
            return 0
        keys = self._keys(req)
        hits = [[self.manager.lookup(k) for k in ks] for ks in keys]
        loading = self._loading_keys()
        being_loaded = [frozenset(i for i, k in enumerate(ks) if k in loading) for ks in keys]
        result = spec_hit(self.config, computed_tokens, num_tokens, hits, being_loaded,
                          max_tokens=max_tokens)
        hit = result if isinstance(result, int) else 0
        self._touch(keys, computed_tokens + hit)
        if result is PENDING:
            self._stats.deferrals += 1
        self._stats.hit_tokens += hit
        return result

    def _touch(self, keys: list[list[Key]], boundary: int) -> None:
        """FULL groups: every key. Window groups: from ``W + e`` chunks before the boundary."""
        for group, g in enumerate(self.config.groups):
            if g.kind is GroupKind.FULL:
                self.manager.touch(keys[group])
            else:
                reach = (g.window_chunks or 1) + g.extra_chunks
                start = max(0, boundary // g.tokens_per_chunk - reach)
                self.manager.touch(keys[group][start:])

    # -- loads ---------------------------------------------------------------------------

    def after_alloc(self, request_id: str, block_ids: Sequence[Sequence[int]],
                    valid_blocks: Sequence[int], computed_tokens: int, load_tokens: int
                    ) -> TransferPlan | None:
        """The load of ``load_tokens`` into the engine's block tables, queued for the step."""
        req = self._req(request_id)
        if load_tokens == 0:
            return None
        if self._jobs_of(request_id):
            raise BadStepError(f"request {request_id!r} has jobs in flight; its lookup "
                               "returned PENDING, so there is nothing to load")
        n = len(self.config.groups)
        if len(block_ids) != n or len(valid_blocks) != n:
            raise BadStepError(f"request {request_id!r}: {len(block_ids)} block tables and "
                               f"{len(valid_blocks)} valid counts for {n} groups")
        loads = load_plan(self.config, computed_tokens, load_tokens, block_ids, valid_blocks)
        keys = self._keys(req)
        for g, gl in enumerate(loads):
            if gl.end_chunk > len(keys[g]):
                raise BadStepError(f"request {request_id!r}: loading up to token "
                                   f"{computed_tokens + load_tokens} needs {gl.end_chunk} "
                                   f"chunks of group {g}, but its hashes give {len(keys[g])}")
        chosen = [tuple(keys[g][gl.first_chunk:gl.end_chunk]) for g, gl in enumerate(loads)]
        slots = list(self.manager.prepare_load([k for ks in chosen for k in ks]))
        groups = []
        for g, gl in enumerate(loads):
            taken, slots = tuple(slots[:len(chosen[g])]), slots[len(chosen[g]):]
            groups.append(GroupTransfer(gl.gpu_block_ids, gl.block_index, taken, chosen[g]))
        plan = TransferPlan(self._new_job_id(), JobKind.LOAD, request_id, tuple(groups))
        self.jobs[plan.job_id] = _Job(plan)
        if self.config.store_level is StoreLevel.BLOCK:
            boundary = computed_tokens + load_tokens
            for g, spec in enumerate(self.config.groups):
                req.cursors[g] = max(req.cursors[g], cdiv(boundary, spec.tokens_per_chunk))
        self.queued_loads.append(plan)
        self._stats.loads += 1
        self._stats.chunks_loaded += len(plan.keys)
        return plan

    # -- the step ------------------------------------------------------------------------

    def build_step(self, step: StepLike) -> StepPlan:
        """Apply the step's allocations; return queued loads, new stores and the flush set."""
        self._validate_step(step)
        allocated = set(step.allocated_ids)
        for req in self.requests.values():
            for table in req.tables:
                for pos, gpu_id in enumerate(table):
                    if gpu_id in allocated:
                        table[pos] = 0
        flush = {j for j, job in self.jobs.items() if job.fenced & allocated}
        for request_id in step.preempted:
            flush |= {job.plan.job_id for job in self._jobs_of(request_id)}
            self.requests[request_id].tables = [[] for _ in self.config.groups]
        stores = []
        for sr in step.requests:
            req = self.requests[sr.request_id]
            req.hashes.extend(sr.new_hashes)
            if sr.resumed:
                req.tables = [[] for _ in self.config.groups]
            for table, ids in zip(req.tables, sr.new_block_ids, strict=False):
                table.extend(ids)
            if sr.request_id not in step.preempted:
                plan = self._store(sr.request_id, req, sr)
                if plan is not None:
                    stores.append(plan)
        loads, self.queued_loads = tuple(self.queued_loads), []
        return StepPlan(loads, tuple(stores), tuple(sorted(flush)))

    def _validate_step(self, step: StepLike) -> None:
        """Every way a step can contradict the config or a request, checked before any change."""
        n = len(self.config.groups)
        for request_id in step.preempted:
            self._req(request_id)
        for sr in step.requests:
            req = self._req(sr.request_id)
            if sr.new_block_ids and len(sr.new_block_ids) != n:
                raise BadStepError(f"request {sr.request_id!r}: {len(sr.new_block_ids)} "
                                   f"block lists for {n} groups")
            hashes = len(req.hashes) + len(sr.new_hashes)
            if sr.num_tokens // self.config.hash_block_tokens > hashes:
                raise BadStepError(f"request {sr.request_id!r}: {sr.num_tokens} tokens "
                                   f"claimed but only {hashes} hashes were given")
            if sr.request_id in step.preempted or self._load_in_flight(sr.request_id):
                continue
            frontier = min(sr.computed_tokens + sr.scheduled_tokens, sr.num_tokens)
            storable = storable_prefix(self.config, frontier, req.prompt_tokens,
                                       req.max_offload_tokens)
            for g, spec in enumerate(self.config.groups):
                kept = 0 if sr.resumed else len(req.tables[g])
                have = kept + (len(sr.new_block_ids[g]) if sr.new_block_ids else 0)
                end = store_end(self.config, g, frontier, storable)
                if end > req.cursors[g] and have < end * spec.blocks_per_chunk:
                    raise BadStepError(f"request {sr.request_id!r}: group {g} has {have} "
                                       f"blocks but storing up to token {frontier} needs "
                                       f"{end * spec.blocks_per_chunk}")

    def _load_in_flight(self, request_id: str) -> bool:
        return any(job.plan.kind is JobKind.LOAD for job in self._jobs_of(request_id))

    def _store(self, request_id: str, req: _Request, sr: ScheduledLike) -> TransferPlan | None:
        """This step's store for one request: offer, prepare, move cursors, build the plan."""
        if self._load_in_flight(request_id):
            return None
        cfg = self.config
        frontier = min(sr.computed_tokens + sr.scheduled_tokens, sr.num_tokens)
        storable = storable_prefix(cfg, frontier, req.prompt_tokens, req.max_offload_tokens)
        offers = [group_offer(cfg, g, req.cursors[g], frontier, storable, req.tables[g])
                  for g in range(len(cfg.groups))]
        keys = self._keys(req)
        offered = [keys[g][c] for g, offer in enumerate(offers) for c in offer.offered]
        out = self.manager.prepare_store(offered) if offered else None
        if offered and out is None:
            self._stats.store_skipped_no_room += 1
            return None
        for g, offer in enumerate(offers):
            req.cursors[g] = max(req.cursors[g], offer.new_cursor)
        if out is None or not out.keys_to_store:
            return None
        accepted = dict(zip(out.keys_to_store, out.slots, strict=True))
        groups: list[GroupTransfer] = []
        window_ids: set[int] = set()
        other_ids: set[int] = set()
        for g, offer in enumerate(offers):
            chunks = [c for c in offer.offered if keys[g][c] in accepted]
            runs = [chunk_source_blocks(req.tables[g], c, cfg.groups[g].blocks_per_chunk)
                    for c in chunks]
            ids = tuple(i for _, run in runs for i in run)
            sources = other_ids if cfg.groups[g].kind is GroupKind.FULL else window_ids
            sources.update(ids)
            groups.append(GroupTransfer(ids, runs[0][0] if runs else 0,
                                        tuple(accepted[keys[g][c]] for c in chunks),
                                        tuple(keys[g][c] for c in chunks)))
        plan = TransferPlan(self._new_job_id(), JobKind.STORE, request_id, tuple(groups))
        job = _Job(plan, fenced=set(window_ids), fence_at_finish=frozenset(other_ids))
        if req.finished:
            job.fenced |= job.fence_at_finish
        self.jobs[plan.job_id] = job
        self._stats.stores += 1
        self._stats.chunks_stored += len(out.keys_to_store)
        return plan

    # -- completions ---------------------------------------------------------------------

    def worker_output(self, reports: Iterable[ReportLike]) -> OutputResult:
        """Count reports; settle each job when all ``num_workers`` have reported it."""
        fresh = self._validate_reports(list(reports))
        completed: list[int] = []
        finished: list[str] = []
        failed_loads: list[LoadFailure] = []
        failed_stores: list[int] = []
        for r in fresh:
            job = self.jobs[r.job_id]
            job.reporters.add(r.worker)
            job.failed = job.failed or not r.success
            if job.plan.kind is JobKind.LOAD:
                self._stats.bytes_loaded += r.bytes
            else:
                self._stats.bytes_stored += r.bytes
            if len(job.reporters) < self.config.num_workers:
                continue
            completed.append(r.job_id)
            plan = job.plan
            del self.jobs[r.job_id]
            if plan.kind is JobKind.STORE:
                self.manager.complete_store(list(plan.keys), success=not job.failed)
                if job.failed:
                    failed_stores.append(plan.job_id)
                    self._stats.failed_stores += 1
            else:
                self.manager.complete_load(list(plan.keys))
                if job.failed:
                    failed_loads.append(LoadFailure(plan.request_id, plan.job_id, tuple(
                        g.gpu_block_ids for g in plan.groups)))
                    self._stats.failed_loads += 1
                else:
                    finished.append(plan.request_id)
            req = self.requests.get(plan.request_id)
            if req is not None and req.finished and not self._jobs_of(plan.request_id):
                del self.requests[plan.request_id]
        return OutputResult(tuple(completed), tuple(finished), tuple(failed_loads),
                            tuple(failed_stores))

    def _validate_reports(self, reports: list[ReportLike]) -> list[ReportLike]:
        """The reports that count, in order; raises on the first bad one, changing nothing."""
        seen: set[tuple[int, int]] = set()
        fresh: list[ReportLike] = []
        for r in reports:
            if r.job_id < self.stale_below:
                continue
            job = self.jobs.get(r.job_id)
            if job is None:
                raise UnknownJobError(f"job {r.job_id} is not in flight (never issued, or "
                                      "already completed)")
            if not 0 <= r.worker < self.config.num_workers:
                raise BadReportError(f"job {r.job_id}: worker {r.worker} outside "
                                     f"0..{self.config.num_workers - 1} (num_workers)")
            if r.worker in job.reporters or (r.job_id, r.worker) in seen:
                raise BadReportError(f"job {r.job_id}: worker {r.worker} reported twice")
            seen.add((r.job_id, r.worker))
            fresh.append(r)
        return fresh

    # -- endings -------------------------------------------------------------------------

    def request_finished(self, request_id: str) -> None:
        """The engine frees the request's blocks now; its stores' other sources get fenced."""
        req = self._req(request_id)
        req.finished = True
        jobs = self._jobs_of(request_id)
        if not jobs:
            del self.requests[request_id]
        for job in jobs:
            job.fenced |= job.fence_at_finish

    def reset(self) -> tuple[int, ...]:
        """Drop the CPU tier and every job (returned, to be waited for); cursors go to 0."""
        flush = tuple(sorted(self.jobs))
        self.jobs = {}
        self.queued_loads = []
        self.stale_below = self.next_job_id
        self.manager.reset()
        self.requests = {r: req for r, req in self.requests.items() if not req.finished}
        for req in self.requests.values():
            req.cursors = [0] * len(self.config.groups)
        return flush

    def take_events(self) -> list[KeyEvent]:
        """Keys stored in or removed from the CPU tier since the last call, one per key."""
        return [KeyEvent(key, key_group(key), e.removed)
                for e in self.manager.take_events() for key in e.keys]

    def stats(self) -> SchedulerStats:
        return replace(self._stats, extra=dict(self._stats.extra))

    # -- inspection ----------------------------------------------------------------------

    def has_pending_work(self) -> bool:
        return bool(self.jobs)

    def jobs_of(self, request_id: str) -> frozenset[int]:
        self._req(request_id)
        return frozenset(job.plan.job_id for job in self._jobs_of(request_id))

    def tracked_requests(self) -> frozenset[str]:
        return frozenset(self.requests)

    def cursors(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._req(request_id).cursors)
