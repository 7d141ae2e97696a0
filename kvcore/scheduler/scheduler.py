"""``OffloadScheduler``: the engine-facing hooks that decide what is loaded and stored.

Hook order per engine step: ``lookup`` for each waiting request (tokens it may load, 0, or
PENDING), ``after_alloc`` once its GPU blocks exist (queues the load job), ``build_step``
at the end of scheduling (stores, and jobs the workers must wait for first), then
``worker_output`` with the workers' reports. ``request_finished`` and ``reset`` end things.
The rules are kvcore's own (``_rules``, ``_lookup``), written apart from the spec's
reference model; this class keeps the state incremental and, with checks on, hands each
hook's records to ``kvcore.spec.invariants``.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from itertools import islice
from typing import Any, cast

from kvcore._checks import checks_enabled, enforce
from kvcore._scan import pack_ids, step_apply, step_vouch
from kvcore.scheduler import _store, _validate
from kvcore.scheduler._lookup import (
    Convergence,
    HitTest,
    Smaller,
    StatusReader,
    converge,
    reach_chunks,
    read_blocks,
)
from kvcore.scheduler._rules import (
    load_plan,
    needed_chunks,
    quiet_cursors,
    served_chunks,
    storable_prefix,
    store_shape,
)
from kvcore.scheduler._state import (
    HashChain,
    Job,
    JobTable,
    RequestState,
    StaleWindows,
)
from kvcore.spec.errors import (
    ArgumentRangeError,
    ArgumentTypeError,
    BadReportError,
    BadStepError,
    ConfigError,
    UnknownJobError,
    UnknownRequestError,
)
from kvcore.spec.hooks import (
    MAX_REPORT_INT,
    KeyEvent,
    LoadFailure,
    OutputResult,
    RequestInfo,
    ScheduledRequest,
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
from kvcore.spec.invariants import (
    CompletionRecord,
    CursorMoveRecord,
    FailureRecord,
    FenceRecord,
    JobTableRecord,
    KeyRecord,
    LoadCoverageRecord,
    LoadRecord,
    LookupRecord,
    LookupTraceRecord,
    PlanRecord,
    Skip,
)
from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan
from kvcore.spec.types import (
    PENDING,
    GroupKind,
    Key,
    LookupResult,
    OffloadConfig,
    StoreLevel,
    cdiv,
    key_group,
)

# Id lists at least this long enter a block table packed by struct (``_apply_blocks``).
_PACK_FROM = 64

# What the scheduler calls on its manager (``kvcore.manager.OffloadManager``'s interface).
MANAGER_METHODS = ("lookup", "touch", "prepare_load", "complete_load", "prepare_store",
                   "complete_store", "reset", "take_events", "stats")


def _check_pools(config: OffloadConfig, manager: Any) -> None:
    """A manager with no pool for one of the config's groups fails at the first store of
    that group, after the step that made the store had changed the scheduler (tables
    extended, the stale-window step advanced). Refused here, where the fix is obvious.
    A manager without ``capacity_of`` (an engine's own) is trusted."""
    capacity_of = getattr(manager, "capacity_of", None)
    if not callable(capacity_of):
        return
    lacking = [g for g in range(len(config.groups)) if not capacity_of(g)]
    if lacking:
        raise ConfigError("manager", f"the manager has no CPU pool for group(s) {lacking} of "
                          f"config {config.name!r} ({len(config.groups)} groups); build it "
                          "with kvcore.CPUOffloadManager.for_config(config), or give it one "
                          "capacity per group")


class OffloadScheduler:
    """Decides loads and stores for every request; owns no bytes and no pointers.

    ``manager`` is the CPU tier (``CPUOffloadManager`` or anything with its interface).
    ``check`` turns on runtime invariant checking (default: ``KVCORE_CHECK=1``).
    """

    def __init__(self, config: OffloadConfig, manager: Any, *,
                 check: bool | None = None) -> None:
        if not isinstance(config, OffloadConfig):
            raise ArgumentTypeError("OffloadScheduler", "config", config, "OffloadConfig",
                                    "build the configuration with kvcore.OffloadConfig")
        missing = [m for m in MANAGER_METHODS if not callable(getattr(manager, m, None))]
        if missing:
            raise ArgumentTypeError("OffloadScheduler", "manager", manager,
                                    "an offload manager (it lacks " + ", ".join(missing) + ")",
                                    "pass kvcore.CPUOffloadManager.for_config(config)")
        _check_pools(config, manager)
        self.check = checks_enabled(check)
        self.config = config
        self.manager = manager
        self._reqs: dict[str, RequestState] = {}
        self._jobs = JobTable()
        self._queued_loads: list[TransferPlan] = []
        self._window_groups = tuple(g.kind is not GroupKind.FULL for g in config.groups)
        self._stale = StaleWindows(stamped=any(self._window_groups))
        self._tokens_per_block = tuple(g.tokens_per_block for g in config.groups)
        # No config cap on U (a request's own cap is read per request): the common case.
        self._uncapped = config.max_offload_tokens is None and not config.prompt_only
        self._store_shape = store_shape(config)
        # What step_vouch reads to vouch for a step's requests in one C pass.
        self._vouch_layout = (ScheduledRequest, RequestState, HashChain, array,
                              config.num_gpu_blocks, config.hash_block_tokens,
                              self._tokens_per_block,
                              tuple(not w for w in self._window_groups))
        # What step_apply reads: window flags, the quiet rule's shape, _PACK_FROM.
        self._apply_layout = (self._window_groups, tuple(
            (tokens, draft, 0, ()) if rule is None else (tokens, draft, rule[0], rule[1].spans)
            for tokens, draft, rule in self._store_shape), _PACK_FROM)
        self._read_blocks = read_blocks(config)
        # Reads and touches go as a group's hashes plus its suffix only when the tier's
        # class defines both calls: a tier with one of them would get hashes where it
        # wants keys, and a wrapper that forwards unknown names (``__getattr__``) to an
        # inner tier would have its own lookup_many and touch bypassed.
        self._by_hash = all(callable(getattr(type(manager), name, None))
                            for name in ("lookup_hashes", "touch_hashes"))
        self._hash_len: int | None = None  # fixed by the first hash accepted
        self._stats = SchedulerStats()
        # Predicate evaluations per invariant id, for reports (``kvcore check``).
        self.checked: dict[str, int] = {}

    def _enforce(self, records: list[object]) -> None:
        enforce(records, self.checked, at_runtime=True)

    # -- requests -----------------------------------------------------------------------

    def add_request(self, info: RequestInfo) -> None:
        """Start tracking a request (the engine's "request arrived")."""
        if type(info) is not RequestInfo:
            raise ArgumentTypeError("add_request", "info", info, "RequestInfo",
                                    "describe the request with kvcore.RequestInfo")
        if info.request_id in self._reqs:
            raise BadStepError(f"request {info.request_id!r} is already tracked")
        hash_len = _validate.hash_length("add_request", "block_hashes", self._hash_len,
                                         info.block_hashes)
        self._hash_len = hash_len
        req = RequestState.fresh(self.config, info.request_id, info.prompt_tokens,
                                 info.max_offload_tokens, info.skip_reading,
                                 HashChain(info.block_hashes))
        self._reqs[info.request_id] = req
        if self.check:
            self._check_keys(req, info.block_hashes, 0)

    def _req(self, request_id: str) -> RequestState:
        """The request a hook names; a finished one is refused as if gone (it stays only
        until its jobs settle: storing, loading or looking it up again would act on
        blocks the engine already freed)."""
        req = self._tracked(request_id)
        if req.finished:
            raise UnknownRequestError(f"request {request_id!r} was finished; it stays only "
                                      "until its jobs in flight settle (pass a new request "
                                      "id to start again)")
        return req

    def _tracked(self, request_id: str) -> RequestState:
        if type(request_id) is not str:
            check_request_id("scheduler", request_id)
        try:
            return self._reqs[request_id]
        except KeyError:
            raise UnknownRequestError(f"request {request_id!r} is not tracked; call "
                                      "add_request first") from None

    def add_hashes(self, request_id: str, hashes: Sequence[bytes]) -> None:
        """Append newly completed block hashes (tokens were generated)."""
        check_request_id("add_hashes", request_id)
        new = check_hashes("add_hashes", "hashes", hashes)
        req = self._req(request_id)
        self._hash_len = _validate.hash_length("add_hashes", "hashes", self._hash_len, new)
        req.hashes.extend(new)
        if self.check:
            self._check_keys(req, new, req.hashes.size - len(new))

    # -- lookup -------------------------------------------------------------------------

    def lookup(self, request_id: str, computed_tokens: int, num_tokens: int, *,
               max_tokens: int | None = None) -> LookupResult:
        """Tokens beyond ``computed_tokens`` the request may load, 0, or PENDING.

        PENDING while the request has jobs in flight (J1), while an unknown key could
        change the answer, or while another request is loading a chunk it would read.
        ``max_tokens`` caps the hit (an engine's "load at most this many"): the answer is
        the largest boundary every group supports at or below the cap.
        """
        check_request_id("lookup", request_id)
        check_int("lookup", "computed_tokens", computed_tokens)
        check_int("lookup", "num_tokens", num_tokens)
        req = self._req(request_id)
        # Exactly int (as every other count): an int subclass can answer ``< 0`` with
        # False and add as a float, after the lookup has cleared the request's tables.
        if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 0):
            raise BadStepError(f"request {request_id!r}: max_tokens={max_tokens!r} must be "
                               "None (no cap) or an int >= 0")
        if num_tokens // self.config.hash_block_tokens > len(req.hashes):
            raise BadStepError(f"request {request_id!r}: {num_tokens} tokens claimed but "
                               f"only {len(req.hashes)} hashes of "
                               f"{self.config.hash_block_tokens} tokens were given")
        if not 0 <= computed_tokens <= num_tokens:
            raise BadStepError(f"request {request_id!r}: computed_tokens={computed_tokens} "
                               f"outside 0..{num_tokens}")
        req.clear_tables()
        req.looked_up = None
        self._stats.lookups += 1
        if req.jobs:
            self._stats.deferrals += 1
            return PENDING
        if req.skip_reading:
            req.looked_up = (computed_tokens, 0)
            return 0
        result, conv, reader = self._lookup_hit(req, computed_tokens, num_tokens, max_tokens)
        if isinstance(result, int):
            req.looked_up = (computed_tokens, result)
        self._touch(req, computed_tokens + (result if isinstance(result, int) else 0), reader)
        if self.check:
            self._check_lookup(req, computed_tokens, num_tokens, result, conv, max_tokens)
        if result is PENDING:
            self._stats.deferrals += 1
        elif isinstance(result, int):
            self._stats.hit_tokens += result
        return result

    def _lookup_hit(self, req: RequestState, computed: int, num_tokens: int,
                    max_tokens: int | None = None
                    ) -> tuple[LookupResult, Convergence, StatusReader | None]:
        reader = StatusReader(req.keys, self.manager, self._read_blocks, self._by_hash)
        num_keys = [len(k) for k in req.keys]

        def run(is_hit: Callable[[int, int], bool]) -> Convergence:
            # The cap is passed only when set, so loops swapped in with the older
            # signature (the bug zoo's) keep working uncapped.
            if max_tokens is None:
                return converge(self.config, computed, num_tokens, num_keys, is_hit)
            return converge(self.config, computed, num_tokens, num_keys, is_hit,
                            max_tokens=max_tokens)

        optimistic = run(HitTest(reader, pending_is_hit=True))
        conv = optimistic
        # With PENDING read as MISS the hit can only be smaller; the answer is PENDING
        # exactly when it is. Nothing to compare when the optimistic hit is already 0.
        # Only a boundary below the optimistic one reads below its range (the floor), so
        # such a read means the pessimistic hit is smaller: PENDING, answered at once.
        if optimistic.hit and reader.saw_pending():
            floor = self._pessimistic_floor(computed + optimistic.hit, computed)
            try:
                conv = run(HitTest(reader, pending_is_hit=False, floor=floor))
            except Smaller:
                return PENDING, optimistic, reader
            if conv.hit != optimistic.hit:
                return PENDING, conv, reader
        if conv.hit > 0 and self._being_loaded(req, computed, conv.hit):
            return PENDING, conv, reader
        return conv.hit, conv, reader

    def _pessimistic_floor(self, boundary: int, computed: int) -> list[int]:
        """Per group, the first chunk a verification at ``boundary`` reads (0 for FULL).

        A window or Mamba group's range starts at or after this for every boundary at or
        above ``boundary`` (the start only moves up with the boundary), so reading a
        chunk below it means the loop is verifying a smaller boundary. FULL ranges start
        at the first uncomputed chunk whatever the boundary: no floor.
        """
        floor = []
        for g in self.config.groups:
            rng = None if g.kind is GroupKind.FULL else needed_chunks(g, boundary, computed)
            floor.append(0 if rng is None else rng[0])
        return floor

    def _being_loaded(self, req: RequestState, computed: int, hit: int) -> bool:
        if not self._jobs.loading:
            return False
        for group, g in enumerate(self.config.groups):
            rng = served_chunks(g, computed + hit, computed)
            if rng is not None and any(req.keys[group][i] in self._jobs.loading
                                       for i in range(*rng)):
                return True
        return False

    def _touch(self, req: RequestState, boundary: int,
               reader: StatusReader | None = None) -> None:
        """Refresh recency: whole prefixes for FULL groups; for windows, the chunks a lookup
        at ``boundary`` reads (the reach before it, and a draft group's extra chunks), so a
        lookup that stops early touches O(window) keys, not the rest of the prompt. Keys
        the lookup's ``reader`` derived are handed over again, not derived twice."""
        for group, g in enumerate(self.config.groups):
            if g.kind is GroupKind.FULL:
                lo, hi = 0, len(req.keys[group])
            else:
                hit_chunks = boundary // g.tokens_per_chunk
                reach = reach_chunks(g) + g.extra_chunks
                lo, hi = max(0, hit_chunks - reach), hit_chunks + g.extra_chunks
            keys = req.keys[group]
            if self._by_hash:  # the group's hashes and its suffix, no key objects
                hashes = keys.chunk_hashes(lo, hi) if reader is None \
                    else reader.items(group, lo, hi)
                self.manager.touch_hashes(hashes, keys.suffix)
            else:
                self.manager.touch(keys[lo:hi] if reader is None else reader.items(group, lo, hi))

    # -- loads --------------------------------------------------------------------------

    def after_alloc(self, request_id: str, block_ids: Sequence[Sequence[int]],
                    valid_blocks: Sequence[int], computed_tokens: int, load_tokens: int
                    ) -> TransferPlan | None:
        """Queue the load of ``load_tokens`` (the lookup's hit) into the allocated blocks.

        ``block_ids`` is each group's whole block table (0 = null), ``valid_blocks`` how
        many leading blocks of each already hold valid KV on the GPU. ``load_tokens`` is 0
        or what the request's latest lookup answered, with the same ``computed_tokens``.
        """
        # From here on only the checked copies are read: a list subclass could answer
        # differently the second time (a valid count above its table's length).
        req, tables, valid = self._validate_alloc(request_id, block_ids, valid_blocks,
                                                  computed_tokens, load_tokens)
        if load_tokens == 0:
            req.looked_up = None
            return None
        if req.jobs:
            raise BadStepError(f"request {request_id!r} has jobs in flight; its lookup "
                               "returned PENDING, so there is nothing to load")
        if req.looked_up != (computed_tokens, load_tokens):
            raise ArgumentRangeError(
                "after_alloc", "load_tokens", load_tokens,
                f"0 or the hit of request {request_id!r}'s latest lookup "
                f"(computed_tokens, hit) = {req.looked_up}",
                "pass the number lookup() returned, with the same computed_tokens, once")
        loads = load_plan(self.config, computed_tokens, load_tokens, tables, valid)
        keys = [req.keys[g][gl.first_chunk:gl.end_chunk] for g, gl in enumerate(loads)]
        flat = tuple(k for ks in keys for k in ks)  # a tuple: the tier copies a list
        slots = iter(self.manager.prepare_load(flat))
        groups = tuple(GroupTransfer(gl.gpu_block_ids, gl.block_index,
                                     tuple(next(slots) for _ in keys[g]), tuple(keys[g]))
                       for g, gl in enumerate(loads))
        plan = TransferPlan(self._jobs.new_id(), JobKind.LOAD, request_id, groups)
        # Its destinations are fenced once the request finishes (as a store's FULL
        # sources are): the engine frees them then, and a block handed out again while
        # the load may still write it must wait for the load (flush).
        self._jobs.add(Job(plan, other_sources=frozenset(
            i for g in groups for i in g.gpu_block_ids if i)))
        req.jobs.add(plan.job_id)
        req.looked_up = None
        boundary = computed_tokens + load_tokens
        moves: list[object] = []
        if self.config.store_level is StoreLevel.BLOCK:
            # The request hit every chunk below the boundary (on the GPU or in this tier):
            # whoever computed them stored them, so the cursor passes them.
            for group, g in enumerate(self.config.groups):
                old, new = req.cursors[group], cdiv(boundary, g.tokens_per_chunk)
                req.cursors[group] = max(old, new)
                moves.append(CursorMoveRecord(group, old, req.cursors[group], frozenset(),
                                              dict.fromkeys(range(old, new), Skip.HIT)))
        self._queued_loads.append(plan)
        self._stats.loads += 1
        self._stats.chunks_loaded += len(flat)
        if self.check:
            ranges = tuple((gl.first_chunk, gl.end_chunk) for gl in loads)
            self._enforce([LoadRecord(self.config, computed_tokens, load_tokens, ranges),
                           LoadCoverageRecord(self.config, computed_tokens, load_tokens,
                                              tables, valid, plan),
                           PlanRecord(self.config, plan), *moves,
                           JobTableRecord(request_id, self._kinds_in_flight(request_id))])
        return plan

    def _validate_alloc(self, request_id: str, block_ids: object, valid_blocks: object,
                        computed_tokens: object, load_tokens: object
                        ) -> tuple[RequestState, tuple[tuple[int, ...], ...],
                                   tuple[int, ...]]:
        """Every argument of ``after_alloc`` checked, types first; changes nothing."""
        where = "after_alloc"
        check_request_id(where, request_id)
        tables = check_id_tables(where, "block_ids", block_ids)
        valid = check_ids(where, "valid_blocks", valid_blocks)
        check_int(where, "computed_tokens", computed_tokens)
        check_int(where, "load_tokens", load_tokens)
        req = self._req(request_id)
        n = len(self.config.groups)
        if len(tables) != n or len(valid) != n:
            raise BadStepError(f"request {request_id!r}: {len(tables)} block tables and "
                               f"{len(valid)} valid counts for {n} groups")
        _validate.check_tables(self.config, where, "block_ids", tables)
        for group, count in enumerate(valid):
            if count > len(tables[group]):
                raise ArgumentRangeError(where, f"valid_blocks[{group}]", count,
                                         f"0..{len(tables[group])} (the table's length)",
                                         "count only blocks present in block_ids")
        return req, tables, valid

    # -- the step -----------------------------------------------------------------------

    def build_step(self, step: StepInput) -> StepPlan:
        """Apply the step's block allocations and return loads, stores and flushes.

        The whole step is validated before anything changes, so a rejected step leaves
        the scheduler as it was.
        """
        self._hash_len, vouched = self._validate_step(step)
        self._stale.advance(step.allocated_ids)
        flush: set[int] = self._jobs.jobs_reading(step.allocated_ids)
        for request_id in step.preempted:
            req = self._req(request_id)
            flush |= req.jobs
            req.clear_tables()
        if self.check:
            self._enforce([FenceRecord(step.allocated_ids, self._jobs.fenced_sources(),
                                 frozenset(flush))])
        stores: list[TransferPlan] = []
        if vouched:
            # One C pass applies every request's blocks and, with checks off, moves the
            # cursors of the quiet ones; the rest store here. (All blocks are applied
            # before any store: if the tier or a runtime check raises in a store, later
            # requests' blocks are in, where the Python loop stopped at the failing one.
            # Neither leaves the step undone: such an error is a bug, not a bad call.)
            for at in step_apply(step.requests, self._reqs, step.preempted,
                                 self._apply_layout, self._stale.step,
                                 self._uncapped and not self.check):
                sr = step.requests[at]
                plan = self._store_step(self._reqs[sr.request_id], sr)
                if plan is not None:
                    stores.append(plan)
        else:
            for sr in step.requests:
                req = self._reqs[sr.request_id]
                self._apply_blocks(req, sr)
                if sr.request_id in step.preempted:
                    continue
                plan = self._store_step(req, sr)
                if plan is not None:
                    stores.append(plan)
        if self.check:
            for sr in step.requests:
                if sr.new_hashes:
                    req = self._reqs[sr.request_id]
                    self._check_keys(req, sr.new_hashes, req.hashes.size - len(sr.new_hashes))
        loads, self._queued_loads = tuple(self._queued_loads), []
        return StepPlan(loads, tuple(stores), tuple(sorted(flush)))

    def _validate_step(self, step: StepInput) -> tuple[int | None, bool]:
        """The whole step checked; returns the hash length once its new hashes count, and
        whether the C pass vouched for every request (then step_apply may apply them)."""
        if type(step) is not StepInput:
            raise ArgumentTypeError("build_step", "step", step, "StepInput",
                                    "describe the step with kvcore.StepInput")
        _validate.check_unique(step)
        _validate.check_allocated(self.config, step.allocated_ids)
        # A request preempted in the step that hands out its queued load (after_alloc):
        # the workers submit the load after the step's flush, into blocks the preemption
        # frees, which the next step may give to another request with no fence on them.
        queued = {p.request_id for p in self._queued_loads} if step.preempted else set()
        for request_id in step.preempted:
            self._req(request_id)
            if request_id in queued:
                raise BadStepError(f"request {request_id!r} is preempted in the step that "
                                   "hands out its queued load (after_alloc), which would "
                                   "write the blocks preemption frees; hand the load out "
                                   "with a step that keeps the request, then preempt it")
        # The C pass vouches for the usual step at about 0.5 us a request; at its first
        # doubt the checks below run, and they raise the error (or find none).
        vouched = step_vouch(step.requests, self._reqs, step.preempted, self._vouch_layout,
                             self._hash_len or 0)
        if vouched >= 0:
            return vouched or self._hash_len, True
        hash_len = self._hash_len
        for sr in step.requests:
            hash_len = self._validate_scheduled(self._req(sr.request_id), sr,
                                                sr.request_id in step.preempted, hash_len)
        return hash_len, False

    def _validate_scheduled(self, req: RequestState, sr: ScheduledRequest,
                            preempted: bool, hash_len: int | None) -> int | None:
        """Reject a scheduled request whose numbers cannot be right (no state changes)."""
        cfg, rid = self.config, sr.request_id
        if sr.new_block_ids and len(sr.new_block_ids) != len(cfg.groups):
            raise BadStepError(f"request {rid!r}: {len(sr.new_block_ids)} block lists for "
                               f"{len(cfg.groups)} groups")
        _validate.check_tables(cfg, "build_step", "new_block_ids", sr.new_block_ids, rid)
        hash_len = _validate.hash_length("build_step", "new_hashes", hash_len,
                                         sr.new_hashes, rid)
        hashes = req.hashes.size + len(sr.new_hashes)
        if sr.num_tokens // cfg.hash_block_tokens > hashes:
            raise BadStepError(f"request {rid!r}: num_tokens={sr.num_tokens} but only "
                               f"{hashes} hashes of {cfg.hash_block_tokens} tokens were given; "
                               "pass new hashes in new_hashes or add_hashes")
        if preempted:
            return hash_len
        frontier = min(sr.computed_tokens + sr.scheduled_tokens, sr.num_tokens)
        new, tables, resumed = sr.new_block_ids, req.tables, sr.resumed
        for group, tokens in enumerate(self._tokens_per_block):
            have = (0 if resumed else len(tables[group])) + (len(new[group]) if new else 0)
            # have < cdiv(frontier, tokens), without the call: a count below the ceiling
            # is below the quotient itself.
            if have * tokens < frontier:
                raise BadStepError(f"request {rid!r}: group {group} has {have} blocks, but "
                                   f"{cdiv(frontier, tokens)} hold its "
                                   f"{frontier} computed tokens; pass every allocated block")
        return hash_len

    def _apply_blocks(self, req: RequestState, sr: ScheduledRequest) -> None:
        if sr.new_hashes:
            req.hashes.extend(sr.new_hashes)
        if sr.resumed:
            req.clear_tables()
        step, window = self._stale.step, self._window_groups
        for group, ids in enumerate(sr.new_block_ids):
            if ids:
                table = req.tables[group]
                if window[group]:
                    req.placed[group].place(len(table), step)
                if len(ids) < _PACK_FROM:
                    table.extend(ids)
                else:
                    # A prefill's or a resumed request's whole table (50K ids at 128K
                    # DeepSeek-V4 tokens): array.extend converts a tuple id by id through
                    # its generic item path; pack_ids writes C ints in one C loop (10x
                    # faster than struct.pack(*ids), which first spreads the tuple into
                    # arguments). Validated ids (0 <= id < num_gpu_blocks <= 2**24) fit.
                    table.frombytes(pack_ids(ids))

    def _drop(self, request_id: str) -> None:
        """Stop tracking a request; nothing of it stays reachable."""
        del self._reqs[request_id]

    def _store_step(self, req: RequestState, sr: ScheduledRequest) -> TransferPlan | None:
        if req.jobs and any(self._jobs.jobs[j].plan.kind is JobKind.LOAD for j in req.jobs):
            return None
        frontier = min(sr.computed_tokens + sr.scheduled_tokens, sr.num_tokens)
        if self._uncapped and req.max_offload_tokens is None:
            storable = frontier  # U = V: no cap applies (frontier >= 0 by the hook types)
        else:
            storable = storable_prefix(self.config, frontier, req.prompt_tokens,
                                       req.max_offload_tokens)
        partial = None
        if not self.check:
            # Most decode steps complete no chunk, or only chunks the keep rule skips: no
            # offer, at most cursor moves, no records to check (with checks on the full
            # path runs, to hand E1/E2 their records). Otherwise only the busy groups get
            # the full offer.
            busy: list[int] = []
            # Given a busy list, quiet_cursors always answers a list.
            quiet = cast("list[int]", quiet_cursors(self._store_shape, req.cursors, frontier,
                                                    storable, busy))
            if not busy:
                req.cursors = quiet
                return None
            partial = (quiet, busy)
        draft = _store.draft_store(self.config, req, frontier, self._stale, storable,
                                   partial)
        built = self._offer(req, draft)
        if self.check:
            # One check for every outcome (nothing offered, no room, nothing new, a job):
            # E1/E2 on the offer and the cursor move; on a job also S1/S2/B1, and J1 when
            # the job is created, not only at the next lookup.
            records = _store.store_records(self.config, draft, built, req.cursors)
            if built is not None:
                records.append(JobTableRecord(req.request_id,
                                              self._kinds_in_flight(req.request_id)))
            self._enforce(records)
        return None if built is None else built.plan

    def _offer(self, req: RequestState, draft: _store.StoreDraft) -> _store.BuiltStore | None:
        """Offer the draft's keys to the tier and build a job for those it takes; the
        cursors move unless the tier had no room (the chunks are offered again later)."""
        if not draft.keys:
            self._move_cursors(req, draft)
            return None
        out = self.manager.prepare_store(draft.keys)
        if out is None:
            self._stats.store_skipped_no_room += 1
            return None
        self._move_cursors(req, draft)
        if not out.keys_to_store:
            return None
        accepted = dict(zip(out.keys_to_store, out.slots, strict=True))
        built = _store.build_store(self.config, req, draft, self._jobs.new_id(), accepted)
        self._jobs.add(Job(built.plan, window_sources=built.window_sources,
                           other_sources=built.other_sources))
        req.jobs.add(built.plan.job_id)
        self._stats.stores += 1
        self._stats.chunks_stored += len(out.keys_to_store)
        return built

    @staticmethod
    def _move_cursors(req: RequestState, draft: _store.StoreDraft) -> None:
        for group, offer in enumerate(draft.offers):
            req.cursors[group] = max(req.cursors[group], offer.new_cursor)

    # -- completions ----------------------------------------------------------------------

    def worker_output(self, reports: Iterable[WorkerReport]) -> OutputResult:
        """Count the workers' reports; settle each job all ``num_workers`` have reported.

        The whole batch is validated before anything changes: a duplicate report, one from
        a worker outside ``0..num_workers-1`` or for an unknown job raises and leaves the
        state as it was. Reports for jobs discarded by ``reset`` are ignored.
        """
        fresh = self._validate_reports(_report_list(reports))
        completed: list[int] = []
        finished_loads: list[str] = []
        failed_loads: list[LoadFailure] = []
        failed_stores: list[int] = []
        for r in fresh:
            job = self._jobs.jobs[r.job_id]
            job.reporters.add(r.worker)
            job.failed |= not r.success
            if job.plan.kind is JobKind.LOAD:
                self._stats.bytes_loaded += r.bytes
            else:
                self._stats.bytes_stored += r.bytes
            if job.settled(self.config.num_workers):
                completed.append(r.job_id)
                self._complete(job, finished_loads, failed_loads, failed_stores)
        return OutputResult(tuple(completed), tuple(finished_loads), tuple(failed_loads),
                            tuple(failed_stores))

    def _validate_reports(self, reports: list[WorkerReport]) -> list[WorkerReport]:
        seen: set[tuple[int, int]] = set()
        fresh: list[WorkerReport] = []
        queued = {p.job_id for p in self._queued_loads}
        for r in reports:
            if r.job_id < self._jobs.stale_below:
                continue
            job = self._jobs.jobs.get(r.job_id)
            if job is None:
                raise UnknownJobError(f"job {r.job_id} is not in flight (never issued, or "
                                      "already completed)")
            if r.job_id in queued:  # settling it would unpin slots the load still reads
                raise BadReportError(f"job {r.job_id} was queued by after_alloc but not yet "
                                     "handed to the workers; report it after the build_step "
                                     "that returns it")
            if not 0 <= r.worker < self.config.num_workers:
                raise BadReportError(f"job {r.job_id}: worker {r.worker} outside "
                                     f"0..{self.config.num_workers - 1} (num_workers)")
            if r.worker in job.reporters or (r.job_id, r.worker) in seen:
                raise BadReportError(f"job {r.job_id}: worker {r.worker} reported twice")
            seen.add((r.job_id, r.worker))
            fresh.append(r)
        return fresh

    def _complete(self, job: Job, finished_loads: list[str], failed_loads: list[LoadFailure],
                  failed_stores: list[int]) -> None:
        plan = job.plan
        keys = plan.keys
        self._jobs.remove(plan.job_id)
        if plan.kind is JobKind.STORE:
            self.manager.complete_store(keys, success=not job.failed)
            if job.failed:
                failed_stores.append(plan.job_id)
                self._stats.failed_stores += 1
        else:
            self.manager.complete_load(keys)
            if job.failed:
                failed_loads.append(LoadFailure(plan.request_id, plan.job_id, tuple(
                    g.gpu_block_ids for g in plan.groups)))
                self._stats.failed_loads += 1
            else:
                finished_loads.append(plan.request_id)
        req = self._reqs.get(plan.request_id)
        if req is not None:
            req.jobs.discard(plan.job_id)
            if req.finished and not req.jobs:
                self._drop(plan.request_id)
        if self.check:
            self._check_completion(job, keys, failed_loads)

    # -- endings --------------------------------------------------------------------------

    def request_finished(self, request_id: str) -> None:
        """The engine finished (or aborted) the request and frees its GPU blocks now.

        Stores still reading its full-attention blocks, and loads still writing its
        blocks, get those blocks fenced, so a later allocation of any of them flushes the
        job first (F1). Nothing more is stored, and every hook but ``worker_output`` (and
        a repeated finish) refuses the request from now on.
        """
        check_request_id("request_finished", request_id)
        req = self._tracked(request_id)  # a second finish (jobs still in flight) is a no-op
        req.finished = True
        if not req.jobs:
            self._drop(request_id)
            return
        for job_id in req.jobs:
            job = self._jobs.jobs[job_id]
            self._jobs.fence_ids(job_id, job.other_sources)

    def reset(self) -> tuple[int, ...]:
        """Drop the CPU tier and every job; returns the jobs the workers must wait for.

        Reports for jobs issued before the reset are ignored afterwards; every tracked
        request stores again from its first chunk. Refused (``BadStepError``, nothing
        changed) between ``after_alloc`` and ``build_step``: the queued load's blocks were
        promised to the engine, so dropping it would serve stale bytes.
        """
        if self._queued_loads:
            raise BadStepError("reset() between after_alloc and build_step: loads "
                               f"{[p.job_id for p in self._queued_loads]} were queued but not "
                               "handed to the workers; reset between steps")
        flush = tuple(sorted(self._jobs.jobs))
        self._jobs.clear()
        self.manager.reset()
        for request_id in [r for r, req in self._reqs.items() if req.finished]:
            self._drop(request_id)
        for req in self._reqs.values():
            req.jobs.clear()
            req.cursors = [0] * len(self.config.groups)
        return flush

    def take_events(self) -> list[KeyEvent]:
        """Keys stored in or removed from the CPU tier since the last call."""
        return [KeyEvent(key, key_group(key), e.removed)
                for e in self.manager.take_events() for key in e.keys]

    def stats(self) -> SchedulerStats:
        """A snapshot of the counters (a copy: later steps do not change it), with the
        manager's count of events it dropped because nobody called ``take_events``."""
        dropped = getattr(self.manager.stats(), "events_dropped", 0)
        return replace(self._stats, extra=dict(self._stats.extra), events_dropped=dropped)

    def has_pending_work(self) -> bool:
        """True while jobs are in flight: the engine keeps stepping until they settle."""
        return bool(self._jobs.jobs)

    def job_in_flight(self, job_id: int) -> bool:
        """Whether ``job_id`` is issued and not yet settled. Any id in 0..2**62 is a fair
        question (False for one never issued: jobs are numbered from 1), so an engine can
        ask about an id it holds without first checking where it came from."""
        check_int("job_in_flight", "job_id", job_id, 0, MAX_REPORT_INT)
        return job_id in self._jobs.jobs

    def jobs_of(self, request_id: str) -> frozenset[int]:
        return frozenset(self._tracked(request_id).jobs)

    def tracked_requests(self) -> frozenset[str]:
        return frozenset(self._reqs)

    def cursors(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._tracked(request_id).cursors)

    # -- runtime checks (only with checks on) ---------------------------------------------

    def _check_keys(self, req: RequestState, given: Sequence[bytes], first: int) -> None:
        """The keys of every chunk the hashes ``given`` (the chain's from index ``first``)
        completed, each beside its group and its chunk's last hash (K1).

        The hashes are read from the engine's own sequence, not from the chain the keys
        are derived through, so a chain that answers a wrong hash (a prompt's or one added
        later, in any of its parts) makes a key that is not its (group, hash)'s. The group
        is the one that asked, not decoded from the key: decoding makes equal keys name
        the same (group, hash), so two groups sharing a key could never be seen."""
        triples: list[tuple[int, bytes, Key]] = []
        for group, keys in enumerate(req.keys):
            hpc = self.config.hashes_per_chunk(group)
            new, end = first // hpc, len(keys)  # chunk new is the first ending at >= first
            if new >= end:
                continue
            ends = islice(given, (new + 1) * hpc - 1 - first, None, hpc)
            triples.extend((group, h, k) for h, k in zip(ends, keys[new:end], strict=True))
        self._enforce([KeyRecord(tuple(triples))])

    def _check_lookup(self, req: RequestState, computed: int, num_tokens: int,
                      result: LookupResult, conv: Convergence,
                      max_tokens: int | None = None) -> None:
        hits = tuple(tuple(self.manager.lookup(k) for k in keys) for keys in req.keys)
        loading = tuple(frozenset(i for i, k in enumerate(keys) if k in self._jobs.loading)
                        for keys in req.keys)
        draft = tuple(g.is_draft for g in self.config.groups)
        final = computed + conv.hit if conv.hit else 0
        self._enforce([LookupRecord(self.config, computed, num_tokens, hits, loading, result,
                                    max_tokens),
                 LookupTraceRecord(draft, conv.trace, final),
                 JobTableRecord(req.request_id, self._kinds_in_flight(req.request_id),
                                result is not PENDING)])

    def _kinds_in_flight(self, request_id: str) -> tuple[JobKind, ...]:
        """From the job table itself, not the request's own list (pair the checks)."""
        return tuple(j.plan.kind for j in self._jobs.jobs.values()
                     if j.plan.request_id == request_id)

    def _check_completion(self, job: Job, keys: Sequence[Key],
                          failed_loads: list[LoadFailure]) -> None:
        records: list[object] = [CompletionRecord(job.plan.job_id, self.config.num_workers,
                                                  len(job.reporters), 1,
                                                  frozenset(job.plan.keys), frozenset(keys))]
        if job.failed and job.plan.kind is JobKind.STORE:
            records.append(FailureRecord({k: self.manager.lookup(k) for k in keys}))
        elif job.failed:
            records.append(FailureRecord({}, frozenset({job.plan.job_id}),
                                         frozenset(f.job_id for f in failed_loads)))
        self._enforce(records)


def _report_list(reports: object) -> list[WorkerReport]:
    """The batch as a list of ``WorkerReport`` (each validated when it was built)."""
    if isinstance(reports, str | bytes) or not isinstance(reports, Iterable):
        raise ArgumentTypeError("worker_output", "reports", reports,
                                "an iterable of WorkerReport", "pass a list of reports")
    batch = list(reports)
    for i, r in enumerate(batch):
        if type(r) is not WorkerReport:
            raise ArgumentTypeError("worker_output", f"reports[{i}]", r, "WorkerReport",
                                    "build each report with kvcore.WorkerReport")
    return batch
