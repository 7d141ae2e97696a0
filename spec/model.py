"""The reference scheduler: the engine hooks of ``OffloadScheduler``, in the simplest correct code.

This is the canonical history the implementation is compared against (TigerBeetle's state
checker): the refinement state machine drives ``kvcore.OffloadScheduler`` and this model
with the same hook calls and asserts equal observable results after every call. It is
written to be obviously right, not fast:

- keys are recomputed from the hashes on every call (``group_keys``);
- the hit is ``spec.lookup.spec_hit`` over the full hit map read from the manager, not a
  convergence loop; the store and load rules are this module's own (``store_walk``,
  ``load_blocks``), decided chunk by chunk and block by block from the semantics, and
  share no function with ``kvcore.scheduler`` (a test walks the imports to keep it so);
- the job table is one dict; a request's jobs, the keys being loaded and the fence are
  found by scanning it; stale window blocks are found by scanning every tracked table.

Hook semantics (docs/semantics.md; where a rule is a choice it leaves open, the choice is
stated here so that the implementation has a definition to match):

- ``lookup`` rebuilds the request's block tables from the next step (the engine hands them
  over again), answers PENDING while the request has jobs (J1), 0 when it skips reading,
  else the spec's hit; it touches FULL groups' keys whole and each window group's keys
  from the window's reach before the boundary reached (the hit, or C when PENDING): the
  boundary's chunk index minus ``e`` and minus the reach in whole chunks, ``W`` or
  ``cdiv(R, o)`` when the engine retains more (``extra_retained_tokens``), whichever is
  more, up to the boundary's chunk index plus ``e``: every chunk a lookup at the
  boundary reads is touched, and none past it.
- ``after_alloc`` pins the chunks of the load and, under ``StoreLevel.BLOCK``, moves every
  cursor to ``cdiv(C + hit, o)`` (the request hit those chunks; someone stored them). The
  load is returned at once and again in the next ``build_step``.
- Job ids count up from 1, shared by loads and stores; reports below the id reached at the
  last ``reset`` are ignored.
- ``build_step``: a GPU id allocated this step is stale wherever an older table entry holds
  it, so it is zeroed there (never stored under its old key); stores whose fenced sources
  (SLIDING and MAMBA ids from creation, since the engine frees those blocks while the
  request runs; FULL ids once the request finished), loads whose destinations are
  re-allocated after their request finished, and every job of a preempted request, are
  flushed. A request with a load in flight stores nothing that step; a ``prepare_store``
  answering None moves no cursor.
- ``worker_output`` counts reports; a job completes at exactly ``num_workers`` (J2).
- Every hook checks its whole input before it changes anything: a rejected call (an
  unknown or finished request, an unknown job or one ``after_alloc`` queued but no
  ``build_step`` handed out yet, a duplicate report, block lists of the wrong group count,
  hashes or block tables shorter than the tokens claimed) leaves the state as it was.
- Argument rules (the same errors as the implementation's): the hook dataclasses check
  their own field types when built; on top, a GPU block id is below ``num_gpu_blocks``
  and is 0 (null) only in a SLIDING/MAMBA group's table, and no id repeats within the
  ids one call gives a FULL group; ``allocated_ids`` are ``1..num_gpu_blocks-1``; a step
  names each request once in ``requests`` and once in ``preempted``; every hash has the
  length of the first hash the scheduler accepted; ``after_alloc`` loads 0 tokens or
  exactly the latest lookup's hit, with its ``computed_tokens``, once.

Inputs are the hook dataclasses of ``kvcore.spec.hooks`` (the protocols below say which
fields are read), checked with ``isinstance`` so that both schedulers reject the same
calls. The outputs are this module's own dataclasses with the same field names, in the
same order, as ``kvcore.scheduler``'s, so ``dataclasses.astuple`` of either compares
equal. Errors are ``kvcore.spec.errors``'s, the same classes the implementation raises.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass, field, replace
from typing import Protocol

from kvcore.spec.errors import (
    ArgumentRangeError,
    ArgumentTypeError,
    BadReportError,
    BadStepError,
    BlockIdError,
    BlockTableError,
    ConfigError,
    DuplicateRequestError,
    HashError,
    UnknownJobError,
    UnknownRequestError,
)
from kvcore.spec.hooks import (
    KeyEvent,
    LoadFailure,
    OutputResult,
    RequestInfo,
    SchedulerStats,
    StepInput,
    StepPlan,
    WorkerReport,
    check_hashes,
    check_id_tables,
    check_ids,
    check_int,
    check_request_id,
)
from kvcore.spec.lookup import read_at_segment_end, served_chunks, spec_hit
from kvcore.spec.manager_model import ReferenceManager
from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan
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


# -- the store and load rules, from the semantics -------------------------------------------


def storable_tokens(cfg: OffloadConfig, frontier: int, prompt_tokens: int,
                    request_cap: int | None) -> int:
    """U: the write frontier V cut by every cap that applies, never below 0."""
    caps = [frontier, cfg.max_offload_tokens, request_cap,
            prompt_tokens if cfg.prompt_only else None]
    return max(0, min(c for c in caps if c is not None))


def chunk_ready(cfg: OffloadConfig, group: int, chunk: int, frontier: int,
                storable: int) -> bool:
    """May ``chunk`` be stored this step? Every token of it lies below U, and for a draft
    group the next chunk is written too (the chunk at the frontier is the drafter's, E1)."""
    o = cfg.groups[group].tokens_per_chunk
    chunk_end = (chunk + 1) * o
    if chunk_end > storable:
        return False
    return not cfg.groups[group].is_draft or chunk_end + o <= frontier


def store_walk(cfg: OffloadConfig, group: int, cursor: int, frontier: int, storable: int,
               table: Sequence[int]) -> tuple[list[int], int]:
    """(chunks offered, cursor after): walk from the cursor over every ready chunk.

    A ready chunk is offered when all its GPU blocks are real (a null one was freed by
    the window or zeroed as stale; only whole chunks are stored) and a segment-end lookup
    reads it; otherwise it is passed with a reason. The walk stops at the first chunk
    that is not ready, so nothing after a held-back chunk is passed (no holes).
    """
    bpc = cfg.groups[group].blocks_per_chunk
    offered: list[int] = []
    chunk = cursor
    while chunk_ready(cfg, group, chunk, frontier, storable):
        blocks = table[chunk * bpc:(chunk + 1) * bpc]
        if len(blocks) < bpc:
            raise ValueError(f"group {group}: block table has {len(table)} blocks, chunk "
                             f"{chunk} needs {(chunk + 1) * bpc}; pass every allocated block")
        if all(blocks) and read_at_segment_end(cfg, group, chunk):
            offered.append(chunk)
        chunk += 1
    return offered, chunk


def load_blocks(cfg: OffloadConfig, group: int, computed: int, hit: int,
                table: Sequence[int], valid: int) -> tuple[int, int, int, tuple[int, ...]]:
    """(first chunk, end chunk, block_index, GPU ids) of one group's load, block by block.

    The request is told it holds ``C + hit`` tokens, so every block position below
    ``cdiv(C + hit, tokens_per_block)`` must hold KV afterwards: one already valid is
    left alone, a null one before any real one is window padding (the engine keeps no
    block there), every other one is filled from the chunk containing it. A null after
    a real one, a table too short, or a chunk outside what the lookup verified is an error.
    """
    g = cfg.groups[group]
    boundary = computed + hit
    told = cdiv(boundary, g.tokens_per_block)
    if len(table) < told:
        raise BlockTableError(f"group {group}: {len(table)} blocks in the table, the load "
                              f"up to token {boundary} needs {told}")
    fill: list[int] = []
    for pos in range(valid, told):
        if table[pos] != 0:
            fill.append(pos)
        elif fill:
            raise BlockTableError(f"group {group}: null block at position {pos}, after "
                                  f"position {fill[0]} that the load fills")
    if not fill:
        return 0, 0, 0, ()
    verified = served_chunks(g, boundary, computed)
    for pos in fill:
        chunk = pos // g.blocks_per_chunk
        if verified is None or not verified[0] <= chunk < verified[1]:
            raise ConfigError(f"groups[{group}].extra_retained_tokens",
                              f"group {group} would load chunk {chunk} at position {pos}, "
                              f"outside the chunks {verified} the lookup verified; set "
                              "extra_retained_tokens if the engine keeps more of the window")
    first, last = fill[0] // g.blocks_per_chunk, fill[-1] // g.blocks_per_chunk
    return first, last + 1, fill[0], tuple(table[pos] for pos in fill)


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
    looked_up: tuple[int, int] | None = None  # (computed, hit) after_alloc may load


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
        self.manager = manager if manager is not None else ReferenceManager(
            (config.num_cpu_blocks,) * len(config.groups), config.max_pending_events)
        # Every group's chunks need a pool: a store of a group without one could only fail
        # after its step had already changed the request tables. (A test's stand-in tier
        # without capacity_of is taken as it is.)
        capacity_of = getattr(self.manager, "capacity_of", None)
        lacking = [] if capacity_of is None else [
            g for g in range(len(config.groups)) if capacity_of(g) == 0]
        if lacking:
            raise ConfigError("manager", f"no CPU pool for group(s) {lacking}")
        self.hash_len: int | None = None  # the length of every hash, once one is seen
        self.requests: dict[str, _Request] = {}
        self.jobs: dict[int, _Job] = {}
        self.queued_loads: list[TransferPlan] = []
        self.next_job_id = 1
        self.stale_below = 1
        self._stats = SchedulerStats()

    # -- derived views (recomputed on every use) -------------------------------------------

    def _req(self, request_id: str) -> _Request:
        """A request a hook may act on: tracked and not finished."""
        req = self._tracked(request_id)
        if req.finished:
            raise UnknownRequestError(f"request {request_id!r} was finished; it stays only "
                                      "until its jobs settle")
        return req

    def _tracked(self, request_id: str) -> _Request:
        check_request_id("scheduler", request_id)
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
        if type(info) is not RequestInfo:
            raise ArgumentTypeError("add_request", "info", info, "RequestInfo",
                                    "describe the request with kvcore.RequestInfo")
        if info.request_id in self.requests:
            raise BadStepError(f"request {info.request_id!r} is already tracked")
        self.hash_len = self._hash_length("add_request", "block_hashes", self.hash_len,
                                          info.block_hashes)
        n = len(self.config.groups)
        self.requests[info.request_id] = _Request(
            info.prompt_tokens, info.max_offload_tokens, info.skip_reading,
            list(info.block_hashes), [[] for _ in range(n)], [0] * n)

    def add_hashes(self, request_id: str, hashes: Sequence[bytes]) -> None:
        """Append newly completed block hashes."""
        check_request_id("add_hashes", request_id)
        new = check_hashes("add_hashes", "hashes", hashes)
        req = self._req(request_id)
        self.hash_len = self._hash_length("add_hashes", "hashes", self.hash_len, new)
        req.hashes.extend(new)

    # -- lookup --------------------------------------------------------------------------

    def lookup(self, request_id: str, computed_tokens: int, num_tokens: int, *,
               max_tokens: int | None = None) -> LookupResult:
        """The spec's hit over the manager's full hit map; PENDING while jobs are in flight.

        ``max_tokens`` caps the hit (the largest supported boundary at or below the cap).
        """
        check_request_id("lookup", request_id)
        for name, value in (("computed_tokens", computed_tokens), ("num_tokens", num_tokens)):
            check_int("lookup", name, value)
        req = self._req(request_id)
        # Exactly int (as every other count): an int subclass can answer ``< 0`` with
        # False and add as a float, after the lookup has cleared the request's tables.
        if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 0):
            raise BadStepError(f"request {request_id!r}: max_tokens={max_tokens!r} must be "
                               "None (no cap) or an int >= 0")
        hbt = self.config.hash_block_tokens
        if num_tokens // hbt > len(req.hashes):
            raise BadStepError(f"request {request_id!r}: {num_tokens} tokens claimed but "
                               f"only {len(req.hashes)} hashes of {hbt} tokens were given")
        if not 0 <= computed_tokens <= num_tokens:
            raise BadStepError(f"request {request_id!r}: computed_tokens={computed_tokens} "
                               f"outside 0..{num_tokens}")
        req.tables = [[] for _ in self.config.groups]
        self._stats.lookups += 1
        req.looked_up = None
        if self._jobs_of(request_id):
            self._stats.deferrals += 1
            return PENDING
        if req.skip_reading:
            req.looked_up = (computed_tokens, 0)
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
        else:
            req.looked_up = (computed_tokens, hit)
        self._stats.hit_tokens += hit
        return result

    def _touch(self, keys: list[list[Key]], boundary: int) -> None:
        """FULL groups: every key. Window groups: the chunks a lookup at the boundary reads.

        From the reach before the boundary (R tokens, ``W`` chunks at least, rounded out to
        whole chunks, plus the draft extra chunk) up to the boundary's chunk plus the
        draft extra chunk: no chunk a lookup at the boundary reads is left untouched, and
        none past it is (a lookup that stops early is not charged for the whole prompt).
        """
        for group, g in enumerate(self.config.groups):
            if g.kind is GroupKind.FULL:
                self.manager.touch(keys[group])
                continue
            o = g.tokens_per_chunk
            reach_tokens = max((g.window_chunks or 1) * o, g.reach_tokens)
            start = boundary // o - cdiv(reach_tokens, o) - g.extra_chunks
            self.manager.touch(keys[group][max(0, start):boundary // o + g.extra_chunks])

    # -- loads ---------------------------------------------------------------------------

    def after_alloc(self, request_id: str, block_ids: Sequence[Sequence[int]],
                    valid_blocks: Sequence[int], computed_tokens: int, load_tokens: int
                    ) -> TransferPlan | None:
        """The load of ``load_tokens`` into the engine's block tables, queued for the step."""
        # Only the checked copies are read from here on (the caller's lists could read
        # differently a second time).
        req, tables, valid = self._check_alloc(request_id, block_ids, valid_blocks,
                                               computed_tokens, load_tokens)
        n = len(self.config.groups)
        if load_tokens == 0:
            req.looked_up = None
            return None
        if self._jobs_of(request_id):
            raise BadStepError(f"request {request_id!r} has jobs in flight; its lookup "
                               "returned PENDING, so there is nothing to load")
        if req.looked_up != (computed_tokens, load_tokens):
            raise ArgumentRangeError(
                "after_alloc", "load_tokens", load_tokens,
                f"0 or the hit of request {request_id!r}'s latest lookup "
                f"(computed_tokens, hit) = {req.looked_up}",
                "pass the number lookup() returned, with the same computed_tokens, once")
        loads = [load_blocks(self.config, g, computed_tokens, load_tokens, tables[g],
                             valid[g]) for g in range(n)]
        keys = self._keys(req)
        for g, (_, end_chunk, _, _) in enumerate(loads):
            if end_chunk > len(keys[g]):
                raise BadStepError(f"request {request_id!r}: loading up to token "
                                   f"{computed_tokens + load_tokens} needs {end_chunk} "
                                   f"chunks of group {g}, but its hashes give {len(keys[g])}")
        chosen = [tuple(keys[g][first:end]) for g, (first, end, _, _) in enumerate(loads)]
        slots = list(self.manager.prepare_load([k for ks in chosen for k in ks]))
        groups = []
        for g, (_, _, block_index, ids) in enumerate(loads):
            taken, slots = tuple(slots[:len(chosen[g])]), slots[len(chosen[g]):]
            groups.append(GroupTransfer(ids, block_index, taken, chosen[g]))
        plan = TransferPlan(self._new_job_id(), JobKind.LOAD, request_id, tuple(groups))
        # The engine frees the destinations when the request finishes: fence them then.
        self.jobs[plan.job_id] = _Job(plan, fence_at_finish=frozenset(
            gpu_id for g in groups for gpu_id in g.gpu_block_ids if gpu_id != 0))
        req.looked_up = None
        if self.config.store_level is StoreLevel.BLOCK:
            boundary = computed_tokens + load_tokens
            for g, spec in enumerate(self.config.groups):
                req.cursors[g] = max(req.cursors[g], cdiv(boundary, spec.tokens_per_chunk))
        self.queued_loads.append(plan)
        self._stats.loads += 1
        self._stats.chunks_loaded += len(plan.keys)
        return plan

    def _check_alloc(self, request_id: str, block_ids: Sequence[Sequence[int]],
                     valid_blocks: Sequence[int], computed_tokens: int, load_tokens: int
                     ) -> tuple[_Request, tuple[tuple[int, ...], ...], tuple[int, ...]]:
        """after_alloc's arguments: types, then the request, group count and block ids;
        the request and the checked copies of the tables and counts."""
        check_request_id("after_alloc", request_id)
        tables = check_id_tables("after_alloc", "block_ids", block_ids)
        valid = check_ids("after_alloc", "valid_blocks", valid_blocks)
        check_int("after_alloc", "computed_tokens", computed_tokens)
        check_int("after_alloc", "load_tokens", load_tokens)
        req = self._req(request_id)
        n = len(self.config.groups)
        if len(tables) != n or len(valid) != n:
            raise BadStepError(f"request {request_id!r}: {len(tables)} block tables and "
                               f"{len(valid)} valid counts for {n} groups")
        self._check_block_ids("after_alloc", "block_ids", tables)
        for g in range(n):
            if valid[g] > len(tables[g]):
                raise ArgumentRangeError("after_alloc", f"valid_blocks[{g}]", valid[g],
                                         f"0..{len(tables[g])} (the table's length)",
                                         "count only blocks present in block_ids")
        return req, tables, valid

    def _check_block_ids(self, where: str, name: str,
                         tables: Sequence[Sequence[int]]) -> None:
        """Each id is a block of the pool; a FULL group's table holds no null (0)."""
        top = self.config.num_gpu_blocks - 1
        for g, ids in enumerate(tables):
            full = self.config.groups[g].kind is GroupKind.FULL
            seen: set[int] = set()
            for i, gpu_id in enumerate(ids):
                if gpu_id > top:
                    raise BlockIdError(where, f"{name}[{g}][{i}]", gpu_id,
                                       f"0..{top} (num_gpu_blocks={top + 1})",
                                       "pass ids from the engine's GPU block pool", g)
                if full and gpu_id == 0:
                    raise BlockIdError(where, f"{name}[{g}][{i}]", 0,
                                       f"1..{top}: a FULL group holds no null block",
                                       "pass the real block id", g)
                if full and gpu_id in seen:  # two positions, one block's bytes
                    raise BlockIdError(where, f"{name}[{g}][{i}]", gpu_id,
                                       f"the ids not at positions 0..{i - 1} (a FULL "
                                       "group's blocks are distinct)",
                                       "pass each allocated block once", g)
                seen.add(gpu_id)

    @staticmethod
    def _hash_length(where: str, name: str, known: int | None,
                     hashes: Sequence[bytes]) -> int | None:
        """The one hash length: the first hash sets it, every later one must match."""
        for h in hashes:
            if known is not None and len(h) != known:
                raise HashError(where, f"len({name}[0])", len(h), f"{known} bytes",
                                "pass hashes from the engine's one hash function")
            known = len(h)
        return known

    # -- the step ------------------------------------------------------------------------

    def build_step(self, step: StepLike) -> StepPlan:
        """Apply the step's allocations; return queued loads, new stores and the flush set."""
        self._validate_step(step)
        for sr in step.requests:
            self.hash_len = self._hash_length("build_step", "new_hashes", self.hash_len,
                                              sr.new_hashes)
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
        self._check_step_shape(step)
        for request_id in step.preempted:
            self._req(request_id)
            if any(p.request_id == request_id for p in self.queued_loads):
                raise BadStepError(f"request {request_id!r} is preempted while its load is "
                                   "queued, to be handed out by this step into the blocks "
                                   "preemption frees; hand the load out with a step that "
                                   "keeps the request, then preempt it")
        hash_len = self.hash_len
        for sr in step.requests:
            req = self._req(sr.request_id)
            if sr.new_block_ids and len(sr.new_block_ids) != n:
                raise BadStepError(f"request {sr.request_id!r}: {len(sr.new_block_ids)} "
                                   f"block lists for {n} groups")
            self._check_block_ids("build_step", f"{sr.request_id}.new_block_ids",
                                  sr.new_block_ids)
            hash_len = self._hash_length("build_step", f"{sr.request_id}.new_hashes",
                                         hash_len, sr.new_hashes)
            hashes = len(req.hashes) + len(sr.new_hashes)
            if sr.num_tokens // self.config.hash_block_tokens > hashes:
                raise BadStepError(f"request {sr.request_id!r}: {sr.num_tokens} tokens "
                                   f"claimed but only {hashes} hashes were given")
            if sr.request_id in step.preempted or self._load_in_flight(sr.request_id):
                continue
            frontier = min(sr.computed_tokens + sr.scheduled_tokens, sr.num_tokens)
            storable = storable_tokens(self.config, frontier, req.prompt_tokens,
                                       req.max_offload_tokens)
            for g, spec in enumerate(self.config.groups):
                kept = 0 if sr.resumed else len(req.tables[g])
                have = kept + (len(sr.new_block_ids[g]) if sr.new_block_ids else 0)
                end = req.cursors[g]
                while chunk_ready(self.config, g, end, frontier, storable):
                    end += 1
                if end > req.cursors[g] and have < end * spec.blocks_per_chunk:
                    raise BadStepError(f"request {sr.request_id!r}: group {g} has {have} "
                                       f"blocks but storing up to token {frontier} needs "
                                       f"{end * spec.blocks_per_chunk}")

    def _check_step_shape(self, step: StepLike) -> None:
        """A StepInput naming each request at most once, allocating only real blocks."""
        if type(step) is not StepInput:
            raise ArgumentTypeError("build_step", "step", step, "StepInput",
                                    "describe the step with kvcore.StepInput")
        for field_name, ids in (("requests", [sr.request_id for sr in step.requests]),
                                ("preempted", list(step.preempted))):
            for i, rid in enumerate(ids):
                if rid in ids[:i]:
                    raise DuplicateRequestError("build_step", field_name, rid)
        top = self.config.num_gpu_blocks - 1
        bad = sorted(i for i in step.allocated_ids if not 1 <= i <= top)
        if bad:
            raise BlockIdError("build_step", "allocated_ids", bad[0] if bad[0] < 1 else bad[-1],
                               f"1..{top} (num_gpu_blocks={top + 1}; 0 is the null block)",
                               "list only ids the engine handed out from its GPU pool")

    def _load_in_flight(self, request_id: str) -> bool:
        return any(job.plan.kind is JobKind.LOAD for job in self._jobs_of(request_id))

    def _store(self, request_id: str, req: _Request, sr: ScheduledLike) -> TransferPlan | None:
        """This step's store for one request: offer, prepare, move cursors, build the plan."""
        if self._load_in_flight(request_id):
            return None
        cfg = self.config
        frontier = min(sr.computed_tokens + sr.scheduled_tokens, sr.num_tokens)
        storable = storable_tokens(cfg, frontier, req.prompt_tokens, req.max_offload_tokens)
        walks = [store_walk(cfg, g, req.cursors[g], frontier, storable, req.tables[g])
                 for g in range(len(cfg.groups))]
        keys = self._keys(req)
        offered = [keys[g][c] for g, (chunks, _) in enumerate(walks) for c in chunks]
        out = self.manager.prepare_store(offered) if offered else None
        if offered and out is None:
            self._stats.store_skipped_no_room += 1
            return None
        for g, (_, cursor) in enumerate(walks):
            req.cursors[g] = max(req.cursors[g], cursor)
        if out is None or not out.keys_to_store:
            return None
        accepted = dict(zip(out.keys_to_store, out.slots, strict=True))
        groups: list[GroupTransfer] = []
        window_ids: set[int] = set()
        other_ids: set[int] = set()
        for g, (chunks_offered, _) in enumerate(walks):
            bpc = cfg.groups[g].blocks_per_chunk
            chunks = [c for c in chunks_offered if keys[g][c] in accepted]
            # Whole chunks only: chunk c is GPU positions c * bpc .. c * bpc + bpc - 1.
            ids = tuple(req.tables[g][c * bpc + j] for c in chunks for j in range(bpc))
            sources = other_ids if cfg.groups[g].kind is GroupKind.FULL else window_ids
            sources.update(ids)
            groups.append(GroupTransfer(ids, chunks[0] * bpc if chunks else 0,
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
        """Count reports; settle each job when all ``num_workers`` have reported it.

        Two passes: tally every counted report (reporters, failure, bytes), noting the
        report at which each job reached ``num_workers``; then settle the jobs in that
        order. Settling touches only the manager and the settled job, never a tally, so
        this is the same as settling each job the moment its last report is counted.
        """
        if isinstance(reports, str | bytes) or not isinstance(reports, Iterable):
            raise ArgumentTypeError("worker_output", "reports", reports,
                                    "an iterable of WorkerReport", "pass a list of reports")
        batch = list(reports)
        for i, r in enumerate(batch):
            if type(r) is not WorkerReport:
                raise ArgumentTypeError("worker_output", f"reports[{i}]", r, "WorkerReport",
                                        "build each report with kvcore.WorkerReport")
        counted = self._counted_reports(batch)
        settle_order: list[int] = []
        for r in counted:
            job = self.jobs[r.job_id]
            job.reporters.add(r.worker)
            if not r.success:
                job.failed = True
            if job.plan.kind is JobKind.STORE:
                self._stats.bytes_stored += r.bytes
            else:
                self._stats.bytes_loaded += r.bytes
            if len(job.reporters) == self.config.num_workers:
                settle_order.append(r.job_id)
        settled = [self.jobs.pop(job_id) for job_id in settle_order]
        for job in settled:
            self._settle(job)
        for request_id in {job.plan.request_id for job in settled}:
            req = self.requests.get(request_id)
            if req is not None and req.finished and not self._jobs_of(request_id):
                del self.requests[request_id]
        return OutputResult(
            tuple(settle_order),
            tuple(j.plan.request_id for j in settled
                  if j.plan.kind is JobKind.LOAD and not j.failed),
            tuple(LoadFailure(j.plan.request_id, j.plan.job_id,
                              tuple(g.gpu_block_ids for g in j.plan.groups))
                  for j in settled if j.plan.kind is JobKind.LOAD and j.failed),
            tuple(j.plan.job_id for j in settled if j.plan.kind is JobKind.STORE and j.failed))

    def _settle(self, job: _Job) -> None:
        """One job done: the manager learns it once, with exactly the job's keys (J2)."""
        keys = list(job.plan.keys)
        if job.plan.kind is JobKind.LOAD:
            self.manager.complete_load(keys)
            self._stats.failed_loads += job.failed
        else:
            self.manager.complete_store(keys, success=not job.failed)
            self._stats.failed_stores += job.failed

    def _counted_reports(self, reports: list[ReportLike]) -> list[ReportLike]:
        """The reports that count: all but those for jobs before the last ``reset``.

        Each is judged against the job table and the reports before it in the batch; the
        first bad one raises (nothing has changed yet).
        """
        live = [r for r in reports if r.job_id >= self.stale_below]
        for n, r in enumerate(live):
            problem = self._report_problem(r, live[:n])
            if problem is not None:
                raise problem
        return live

    def _report_problem(self, r: ReportLike, earlier: list[ReportLike]) -> Exception | None:
        """What is wrong with one report, by precedence: its job, its worker, a repeat."""
        job = self.jobs.get(r.job_id)
        if job is None:
            return UnknownJobError(f"job {r.job_id} is not in flight (never issued, or "
                                   "already completed)")
        if any(p.job_id == r.job_id for p in self.queued_loads):
            return BadReportError(f"job {r.job_id} was queued by after_alloc but not yet "
                                  "handed to the workers")
        if not 0 <= r.worker < self.config.num_workers:
            return BadReportError(f"job {r.job_id}: worker {r.worker} outside "
                                  f"0..{self.config.num_workers - 1} (num_workers)")
        repeated = any((e.job_id, e.worker) == (r.job_id, r.worker) for e in earlier)
        if repeated or r.worker in job.reporters:
            return BadReportError(f"job {r.job_id}: worker {r.worker} reported twice")
        return None

    # -- endings -------------------------------------------------------------------------

    def request_finished(self, request_id: str) -> None:
        """The engine frees the request's blocks now; its stores' other sources get fenced."""
        check_request_id("request_finished", request_id)
        req = self._tracked(request_id)  # finishing again, jobs in flight: no change
        req.finished = True
        jobs = self._jobs_of(request_id)
        if not jobs:
            del self.requests[request_id]
        for job in jobs:
            job.fenced |= job.fence_at_finish

    def reset(self) -> tuple[int, ...]:
        """Drop the CPU tier and every job (returned, to be waited for); cursors go to 0.

        Refused while a load is queued: the engine was told its blocks will be filled,
        and a reset before the step hands the load out would drop it unannounced.
        """
        if self.queued_loads:
            raise BadStepError("reset() between after_alloc and build_step: loads "
                               f"{[p.job_id for p in self.queued_loads]} are queued")
        flush = tuple(sorted(self.jobs))
        self.jobs = {}
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
        return replace(self._stats, extra=dict(self._stats.extra),
                       events_dropped=self.manager.stats().events_dropped)

    # -- inspection ----------------------------------------------------------------------

    def has_pending_work(self) -> bool:
        return bool(self.jobs)

    def jobs_of(self, request_id: str) -> frozenset[int]:
        self._tracked(request_id)
        return frozenset(job.plan.job_id for job in self._jobs_of(request_id))

    def tracked_requests(self) -> frozenset[str]:
        return frozenset(self.requests)

    def cursors(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._tracked(request_id).cursors)
