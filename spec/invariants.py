"""Pure predicates, one or more per invariant id (named for it), over plain-data records.

Each predicate takes the record its rule is about and returns a list of ``Violation``;
an empty list means the rule holds. The runtime checker (``KVCORE_CHECK=1``), the
Hypothesis state machines and the CrossHair obligations all call these same functions,
so each rule has exactly one definition. ``check`` runs every predicate that applies to a
``Snapshot``. Compound rules are split into clauses, one predicate each, so a violation
names the one that broke.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcore.spec.descriptors import (
    CROSS_SIDE,
    RegionShape,
    cross_violations,
    first_violation,
)
from kvcore.spec.descriptors import Status as CopyStatus
from kvcore.spec.lookup import HitMap, read_at_segment_end, served_chunks, spec_hit
from kvcore.spec.plans import JobKind, TransferPlan, chunks_spanned
from kvcore.spec.types import (
    KEY_GROUP_BYTES,
    PENDING,
    Key,
    LookupResult,
    OffloadConfig,
    Status,
    cdiv,
)


@dataclass(frozen=True)
class Violation:
    """A broken rule: its id, a sentence, and the offending values."""

    id: str
    message: str
    values: dict[str, Any] = field(default_factory=dict)


INVARIANT_IDS = ("E1", "E2", "E3", "E4", "L1", "L2", "L3", "J1", "J2",
                 "S1", "S2", "B1", "F1", "X1", "X2", "M1", "M2", "M3", "K1", "R1", "A1")

# -- records ------------------------------------------------------------------------------


class Skip(enum.Enum):
    """Why a store cursor may pass a chunk without offering it (E2's stated reasons)."""

    NULL = "null"
    UNREACHABLE = "unreachable"
    HIT = "hit"


@dataclass(frozen=True)
class StoreOfferRecord:
    """The chunks of one group offered to ``prepare_store`` in one step (E1)."""

    group: int
    is_draft: bool
    tokens_per_chunk: int
    frontier: int
    offered: tuple[int, ...]


@dataclass(frozen=True)
class CursorMoveRecord:
    """One group's store cursor before and after a step, and what it passed (E2).

    With ``config`` set, a chunk skipped as UNREACHABLE is checked against the spec's
    keep rule, so a store rule that drops readable chunks is a hole too.
    """

    group: int
    old: int
    new: int
    offered: frozenset[int]
    skipped: dict[int, Skip]
    config: OffloadConfig | None = None


@dataclass(frozen=True)
class TraceEntry:
    """One verification in the lookup's convergence loop.

    ``boundary`` is the boundary the group was verified at; ``query`` the chunk range it
    read; ``result`` the largest boundary <= ``boundary`` it supports (0: none);
    ``pops`` how many extra chunks it required beyond the boundary.
    """

    group: int
    boundary: int
    query: tuple[int, int]
    result: int
    pops: int


@dataclass(frozen=True)
class LookupTraceRecord:
    """The convergence loop's trace and its answer (E3)."""

    draft: tuple[bool, ...]
    entries: tuple[TraceEntry, ...]
    final_boundary: int


@dataclass(frozen=True)
class LookupRecord:
    """One lookup: the inputs the spec needs and the answer given (L1, L2, E4)."""

    config: OffloadConfig
    computed: int
    num_tokens: int
    hits: HitMap
    loading: tuple[frozenset[int], ...] | None
    result: LookupResult
    max_tokens: int | None = None


@dataclass(frozen=True)
class LoadRecord:
    """The chunk range each group loads for a hit (L1: only verified chunks are loaded)."""

    config: OffloadConfig
    computed: int
    hit: int
    chunk_ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class LoadCoverageRecord:
    """A load plan beside the block tables and valid counts it was built from (L3).

    ``tables`` is each group's whole block table as the engine passed it (0 = null) and
    ``valid_blocks`` how many leading blocks already held valid KV; ``computed + hit`` is
    the boundary the request is told it holds after the load.
    """

    config: OffloadConfig
    computed: int
    hit: int
    tables: tuple[tuple[int, ...], ...]
    valid_blocks: tuple[int, ...]
    plan: TransferPlan


@dataclass(frozen=True)
class JobTableRecord:
    """A request's jobs in flight when a hook ran, and whether a lookup got an answer (J1)."""

    request_id: str
    kinds: tuple[JobKind, ...]
    lookup_answered: bool = False


@dataclass(frozen=True)
class CompletionRecord:
    """A job's completion: reports received and the manager calls made (J2)."""

    job_id: int
    num_workers: int
    reports: int
    complete_calls: int
    job_keys: frozenset[Key]
    completed_keys: frozenset[Key]


@dataclass(frozen=True)
class PlanRecord:
    """A transfer plan with its config, and for stores the GPU position of each id (S1, S2, B1)."""

    config: OffloadConfig
    plan: TransferPlan
    positions: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True)
class FenceRecord:
    """GPU ids handed out this step, stores still reading ids, and the jobs flushed (F1)."""

    allocated: frozenset[int]
    store_sources: dict[int, frozenset[int]]
    flushed: frozenset[int]


@dataclass(frozen=True)
class FailureRecord:
    """Keys of failed stores with their status afterwards; failed loads and reports (X1)."""

    failed_store_status: dict[Key, Status]
    failed_load_jobs: frozenset[int] = frozenset()
    reported_load_jobs: frozenset[int] = frozenset()


@dataclass(frozen=True)
class SetupRecord:
    """A valid set-up call (a constructor, a registration, a read-back of the tier) and the
    refusal it met, or how its result fails to honour the call; None if it was accepted
    and honoured (X2)."""

    call: str
    refused: str | None


@dataclass(frozen=True)
class TransferOutcomeRecord:
    """What the copy engine made of one plan the scheduler built with its checks on (X2).

    ``planned_bytes`` is counted by the caller from the plan and its own buffers, not by the
    engine; ``error`` is the engine's refusal (at submit or in the job), None on success.
    """

    job_id: int
    planned_bytes: int
    success: bool
    moved_bytes: int
    error: str | None = None
    # The first pool whose bytes differ from the plan's copy (built by the caller from
    # ``spec.plans``' sequential mapping); None when they agree or were not compared.
    wrong_bytes: str | None = None
    # The caller's harness failed this job's copy on purpose after it was enqueued (a
    # device error injected into the stand-in stream): it must be reported failed (X1),
    # and its failure is no refusal of a valid plan (X2).
    injected: bool = False


@dataclass(frozen=True)
class CopyCallRecord:
    """One call into the C copy library and what it did (B1 and X2 at the byte level).

    ``error`` is the refusal as (status, index, side, value, bound), the index being the
    region's for side 3 (region) and the descriptor's otherwise; None if the call
    succeeded. ``changed``: a refused call changed some byte of the memory it was given;
    ``copied_ok``: after an accepted call the memory equals the reference copy.
    """

    regions: tuple[RegionShape, ...]
    descs: tuple[tuple[int, ...], ...]
    error: tuple[int, int, int, int, int] | None
    changed: bool
    copied_ok: bool
    flags: int = 0


@dataclass(frozen=True)
class RefinementRecord:
    """One hook's answer (or observable state after it) from kvcore and from the reference
    model, as plain data (R1)."""

    after: str
    implementation: Any
    reference: Any


@dataclass(frozen=True)
class BadCallRecord:
    """One call made wrong on purpose, and what it did (A1): the class it raised (None if
    it was accepted), whether that is a kvcore error, and whether any state changed.

    ``mismatch`` says how the error's fields differ from what the call's one fault implies
    (the argument it names; a copy error's code, index, group, value and bound), empty
    when they agree or when the caller does not pin them.
    """

    call: str
    raised: str | None
    kvcore_error: bool
    changed: bool
    mismatch: str = ""


@dataclass(frozen=True)
class EvictionRecord:
    """One ``prepare_store`` that needed room (M1).

    ``evicted`` pairs each evicted key with its state then ("ready", "pinned", "writing").
    """

    call_keys: tuple[Key, ...]
    evicted: tuple[tuple[Key, str], ...]
    needed: int
    returned_none: bool
    changed_state: bool


@dataclass(frozen=True)
class KeyRecord:
    """(group, chunk hash, key) triples that were produced (K1)."""

    triples: tuple[tuple[int, bytes, Key], ...]


# -- predicates, one per id -----------------------------------------------------------------


def e1_volatile_chunk_never_offered(r: StoreOfferRecord) -> list[Violation]:
    """E1: no key of a draft group's volatile chunk (index >= V // o - 1) is ever offered.

    The drafter rewrites its trailing chunk every step; storing it serves bytes that no
    longer match their key (the vllm#44780 configuration).
    """
    if not r.is_draft:
        return []
    first_volatile = r.frontier // r.tokens_per_chunk - 1
    bad = [c for c in r.offered if c >= first_volatile]
    if not bad:
        return []
    return [Violation("E1", f"group {r.group}: volatile chunks {bad} offered "
                      f"(frontier {r.frontier} tokens, first volatile chunk {first_volatile})",
                      {"group": r.group, "chunks": bad, "frontier": r.frontier})]


def e2_cursor_leaves_no_hole(r: CursorMoveRecord) -> list[Violation]:
    """E2: the store cursor never passes a chunk that was not offered; it never moves back.

    A passed chunk that was neither offered nor skipped for a stated reason is a hole: it is
    never stored, and every later prefix lookup of the group stops there (the hole #44784
    left for chunked prefill).
    """
    out: list[Violation] = []
    if r.new < r.old:
        out.append(Violation("E2", f"group {r.group}: cursor moved back {r.old} -> {r.new}",
                             {"group": r.group, "old": r.old, "new": r.new}))
    holes = [c for c in range(r.old, r.new) if c not in r.offered and c not in r.skipped]
    if holes:
        out.append(Violation("E2", f"group {r.group}: cursor {r.old} -> {r.new} passed "
                             f"chunks {holes[:8]} that were never offered",
                             {"group": r.group, "holes": holes[:8]}))
    if r.config is not None:
        readable = [c for c, why in r.skipped.items()
                    if why is Skip.UNREACHABLE and read_at_segment_end(r.config, r.group, c)]
        if readable:
            out.append(Violation("E2", f"group {r.group}: chunks {readable[:8]} skipped as "
                                 "unreachable, but a lookup can read them",
                                 {"group": r.group, "chunks": readable[:8]}))
    return out


def e3_one_pop_per_cycle(r: LookupTraceRecord) -> list[Violation]:
    """E3: a draft group's extra chunk is popped once per verification at a boundary, and the
    group is re-verified when another group strictly shrinks the boundary below it.

    Popping twice under-serves by a chunk; never re-verifying after a shrink serves a
    boundary whose extra chunk was not checked (upstream 0.33 re-armed only on non-draft
    shrinks, so two draft window groups could serve without the extra chunk).
    """
    out: list[Violation] = []
    for e in r.entries:
        want = 1 if r.draft[e.group] else 0
        if e.pops != want:
            out.append(Violation("E3", f"group {e.group} verified at {e.boundary} with "
                                 f"{e.pops} pops, expected {want}",
                                 {"group": e.group, "pops": e.pops, "boundary": e.boundary}))
    verified_at: dict[int, int] = {}
    current: int | None = None
    for e in r.entries:
        current = e.result if current is None else min(current, e.result)
        verified_at[e.group] = current
    if r.final_boundary == 0:
        return out
    for group, at in verified_at.items():
        if r.draft[group] and at != r.final_boundary:
            out.append(Violation("E3", f"draft group {group} was last verified at {at} but "
                                 f"the lookup served {r.final_boundary} without re-verifying",
                                 {"group": group, "verified_at": at,
                                  "final": r.final_boundary}))
    missing = [g for g, d in enumerate(r.draft) if d and g not in verified_at]
    if missing:
        out.append(Violation("E3", f"draft groups {missing} never verified",
                             {"groups": missing}))
    return out


def e4_draft_extra_chunk_hit(r: LookupRecord) -> list[Violation]:
    """E4: a draft group serves a boundary only with one extra hit chunk beyond it."""
    if not isinstance(r.result, int) or r.result == 0:
        return []
    boundary = r.computed + r.result
    out: list[Violation] = []
    for i, g in enumerate(r.config.groups):
        if not g.is_draft:
            continue
        extra = cdiv(boundary, g.tokens_per_chunk)
        status = r.hits[i][extra] if extra < len(r.hits[i]) else None
        if status is not Status.HIT:
            out.append(Violation("E4", f"draft group {i} serves boundary {boundary} but its "
                                 f"extra chunk {extra} is {status}",
                                 {"group": i, "boundary": boundary, "chunk": extra}))
    return out


def l1_hit_matches_spec(r: LookupRecord) -> list[Violation]:
    """L1: the hit equals the spec's hit (largest boundary every group supports)."""
    want = spec_hit(r.config, r.computed, r.num_tokens, r.hits, r.loading,
                    max_tokens=r.max_tokens)
    if want is PENDING or r.result is PENDING or want == r.result:
        return []
    return [Violation("L1", f"lookup returned {r.result}, the spec's hit is {want}",
                      {"result": r.result, "spec": want, "computed": r.computed,
                       "num_tokens": r.num_tokens})]


def l1_load_within_verified(r: LoadRecord) -> list[Violation]:
    """L1 (load half): every loaded chunk lies inside the range the lookup verified."""
    out: list[Violation] = []
    boundary = r.computed + r.hit
    for i, (lo, hi) in enumerate(r.chunk_ranges):
        if lo >= hi:
            continue
        served = served_chunks(r.config.groups[i], boundary, r.computed)
        if served is None or lo < served[0] or hi > served[1]:
            out.append(Violation("L1", f"group {i} loads chunks [{lo}, {hi}) outside the "
                                 f"verified range {served}",
                                 {"group": i, "range": (lo, hi), "verified": served}))
    return out


def l3_load_covers_every_block(r: LoadCoverageRecord) -> list[Violation]:
    """L3: a completed load leaves no block the request is told is loaded stale.

    Per group, every real (non-null) block at a position in ``[valid, cdiv(C + hit, tpb))``
    is written by the load, with the plan's id at that position; and the load writes
    nothing at or past that end nor over a block that was already valid. A load that skips
    a block (the engine then computes from token ``C + hit`` over whatever the block held
    before) passes L1 and S1 alike, since its chunk range and its shape stay consistent.
    """
    out: list[Violation] = []
    boundary = r.computed + r.hit
    for i, g in enumerate(r.config.groups):
        gt = r.plan.groups[i] if i < len(r.plan.groups) else None
        table, valid = r.tables[i], r.valid_blocks[i]
        told = cdiv(boundary, g.tokens_per_block)
        written = {} if gt is None else {gt.block_index + n: gpu_id
                                         for n, gpu_id in enumerate(gt.gpu_block_ids)}
        stale = [p for p in range(valid, min(told, len(table)))
                 if table[p] != 0 and written.get(p) != table[p]]
        outside = sorted(p for p in written if not valid <= p < told)
        if stale:
            out.append(Violation("L3", f"job {r.plan.job_id} group {i}: blocks at positions "
                                 f"{stale[:8]} are told loaded (up to token {boundary}) but "
                                 "the load does not fill them",
                                 {"group": i, "positions": stale[:8], "boundary": boundary}))
        if outside:
            out.append(Violation("L3", f"job {r.plan.job_id} group {i}: the load writes "
                                 f"positions {outside[:8]} outside [{valid}, {told})",
                                 {"group": i, "positions": outside[:8]}))
    return out


def l2_pending_exactly_when_uncertain(r: LookupRecord) -> list[Violation]:
    """L2: PENDING exactly when the answer is uncertain or a needed key is being loaded."""
    want = spec_hit(r.config, r.computed, r.num_tokens, r.hits, r.loading,
                    max_tokens=r.max_tokens)
    if (want is PENDING) == (r.result is PENDING):
        return []
    return [Violation("L2", f"lookup returned {r.result}, the spec says {want}",
                      {"result": repr(r.result), "spec": repr(want)})]


def j1_one_kind_of_job(r: JobTableRecord) -> list[Violation]:
    """J1: one kind of job per request; no lookup result while jobs are in flight."""
    out: list[Violation] = []
    if JobKind.LOAD in r.kinds and len(r.kinds) > 1:
        out.append(Violation("J1", f"request {r.request_id} has a load and other jobs: "
                             f"{[k.value for k in r.kinds]}", {"request": r.request_id}))
    if r.lookup_answered and r.kinds:
        out.append(Violation("J1", f"request {r.request_id} got a lookup answer with "
                             f"{len(r.kinds)} jobs in flight", {"request": r.request_id}))
    return out


def j2_completion_exact(r: CompletionRecord) -> list[Violation]:
    """J2: completion needs exactly num_workers reports; complete_* once per job, exact keys."""
    out: list[Violation] = []
    if r.reports != r.num_workers:
        out.append(Violation("J2", f"job {r.job_id} completed after {r.reports} reports, "
                             f"num_workers={r.num_workers}", {"job": r.job_id}))
    if r.complete_calls != 1:
        out.append(Violation("J2", f"job {r.job_id}: complete_* called {r.complete_calls} "
                             "times", {"job": r.job_id}))
    if r.completed_keys != r.job_keys:
        out.append(Violation("J2", f"job {r.job_id}: completed keys differ from the job's",
                             {"job": r.job_id, "extra": len(r.completed_keys - r.job_keys),
                              "missing": len(r.job_keys - r.completed_keys)}))
    return out


def s1_plan_shape(r: PlanRecord) -> list[Violation]:
    """S1: one entry per group; per group, chunk count == slots == keys."""
    groups = r.config.groups
    if len(r.plan.groups) != len(groups):
        return [Violation("S1", f"job {r.plan.job_id} has {len(r.plan.groups)} group entries "
                          f"for {len(groups)} groups", {"job": r.plan.job_id})]
    out: list[Violation] = []
    for i, gt in enumerate(r.plan.groups):
        spanned = chunks_spanned(len(gt.gpu_block_ids), gt.block_index,
                                 groups[i].blocks_per_chunk)
        if not spanned == len(gt.cpu_slots) == len(gt.keys):
            out.append(Violation("S1", f"job {r.plan.job_id} group {i}: "
                                 f"{len(gt.gpu_block_ids)} GPU blocks from index "
                                 f"{gt.block_index} span {spanned} chunks, but "
                                 f"{len(gt.cpu_slots)} slots and {len(gt.keys)} keys",
                                 {"job": r.plan.job_id, "group": i}))
    return out


def _runs(positions: Sequence[int], bpc: int) -> list[list[int]]:
    runs: list[list[int]] = []
    for pos in positions:
        if runs and pos // bpc == runs[-1][-1] // bpc:
            runs[-1].append(pos)
        else:
            runs.append([pos])
    return runs


def s2_store_runs(r: PlanRecord) -> list[Violation]:
    """S2: within a group, a store is one whole run per chunk.

    upstream allows a short first run; kvcore stores whole chunks only, because a chunk
    stored with null leading sub-blocks leaves CPU bytes unwritten that a later load
    starting mid-chunk reads. The copy path maps GPU blocks to CPU sub-blocks
    sequentially; any other shape puts bytes in the wrong sub-block of the wrong chunk.
    """
    if r.plan.kind is not JobKind.STORE or r.positions is None:
        return []
    out: list[Violation] = []
    for i, positions in enumerate(r.positions):
        bpc = r.config.groups[i].blocks_per_chunk
        runs = _runs(positions, bpc)
        for n, run in enumerate(runs):
            whole = run == list(range(run[0], run[0] + bpc)) and run[0] % bpc == 0
            if not whole:
                out.append(Violation("S2", f"job {r.plan.job_id} group {i}: run {n} "
                                     f"{run} is not a whole chunk of {bpc} blocks",
                                     {"job": r.plan.job_id, "group": i, "run": run}))
        chunks = [run[0] // bpc for run in runs]
        if chunks != sorted(set(chunks)):
            out.append(Violation("S2", f"job {r.plan.job_id} group {i}: chunks {chunks} "
                                 "repeat or go backwards", {"group": i}))
        if runs and r.plan.groups[i].block_index != runs[0][0]:
            out.append(Violation("S2", f"job {r.plan.job_id} group {i}: block_index "
                                 f"{r.plan.groups[i].block_index} != first position "
                                 f"{runs[0][0]}", {"group": i}))
    return out


def b1_block_ids_in_range(r: PlanRecord) -> list[Violation]:
    """B1: every GPU id satisfies 0 < id < num_gpu_blocks, every CPU id 0 <= id < num_cpu_blocks.

    An unchecked id became a segfault inside the batched copy (vllm#44780); the copy
    library re-checks every byte range before the first byte moves.
    """
    out: list[Violation] = []
    n_gpu, n_cpu = r.config.num_gpu_blocks, r.config.num_cpu_blocks
    for i, gt in enumerate(r.plan.groups):
        bad_gpu = [b for b in gt.gpu_block_ids if not 0 < b < n_gpu]
        bad_cpu = [s for s in gt.cpu_slots if not 0 <= s < n_cpu]
        if bad_gpu:
            out.append(Violation("B1", f"job {r.plan.job_id} group {i}: GPU ids {bad_gpu[:4]}"
                                 f" outside 1..{n_gpu - 1}", {"group": i, "ids": bad_gpu[:4]}))
        if bad_cpu:
            out.append(Violation("B1", f"job {r.plan.job_id} group {i}: CPU slots "
                                 f"{bad_cpu[:4]} outside 0..{n_cpu - 1}",
                                 {"group": i, "slots": bad_cpu[:4]}))
    return out


def f1_fence(r: FenceRecord) -> list[Violation]:
    """F1: a store's source block is never reused before the store is waited on."""
    unflushed = sorted(job for job, ids in r.store_sources.items()
                       if ids & r.allocated and job not in r.flushed)
    if not unflushed:
        return []
    return [Violation("F1", f"stores {unflushed[:8]} read GPU blocks re-allocated this step "
                      "but were not flushed", {"jobs": unflushed[:8]})]


def x1_failure_never_hit(r: FailureRecord) -> list[Violation]:
    """X1: a failed transfer never becomes a hit; a failed load is reported to the engine."""
    out: list[Violation] = []
    hits = [k for k, s in r.failed_store_status.items() if s is not Status.MISS]
    if hits:
        out.append(Violation("X1", f"{len(hits)} keys of failed stores are still present",
                             {"keys": [k.hex()[:16] for k in hits[:4]]}))
    unreported = sorted(r.failed_load_jobs - r.reported_load_jobs)
    if unreported:
        out.append(Violation("X1", f"failed loads {unreported[:8]} not reported for "
                             "recompute", {"jobs": unreported[:8]}))
    return out


def x1_fault_reported(r: TransferOutcomeRecord) -> list[Violation]:
    """X1: a job whose copy failed is reported failed, with no bytes.

    A failure the engine loses (reported on another job, or not at all) turns into a hit
    whose bytes never landed: the wrong-bytes load of a failed store, or a request that
    computes on over KV its failed load never wrote.
    """
    if r.injected and (r.success or r.moved_bytes != 0):
        return [Violation("X1", f"job {r.job_id}'s copy failed (a device error injected "
                          f"after it was enqueued) but the engine reported success="
                          f"{r.success} with {r.moved_bytes} bytes", {"job": r.job_id})]
    return []


def x2_valid_setup_accepted(r: SetupRecord) -> list[Violation]:
    """X2: a valid set-up (config, options, tensors, CPU buffer, tier read-back, each
    documented form of a hook input) is accepted, and so is every hook call a check's
    harness makes by the rules (a kvcore error that ends a battery stage).

    A validator stricter than its rules refuses an engine that did nothing wrong: every
    engine of that shape fails to start, never reads its tier back, or (a hook input's
    scan broken on one form) fails its first step.
    """
    if r.refused is not None:
        return [Violation("X2", f"{r.call}: a valid call refused or not honoured: "
                          f"{r.refused[:200]}",
                          {"call": r.call})]
    return []


def x2_valid_plan_carried_out(r: TransferOutcomeRecord) -> list[Violation]:
    """X2: a plan that passed S1, S2 and B1 is carried out whole by the copy engine.

    A refusal there is not a safe failure: the engine recomputes, but every store of that
    shape is lost and every load of it is a miss, so offloading silently stops paying.
    A job the harness failed on purpose (``injected``) is X1's to judge.
    """
    if r.injected:
        return []
    if not r.success:
        return [Violation("X2", f"job {r.job_id}: the copy engine refused a valid plan: "
                          f"{(r.error or '?')[:200]}", {"job": r.job_id})]
    if r.moved_bytes != r.planned_bytes:
        return [Violation("X2", f"job {r.job_id} moved {r.moved_bytes} bytes, its plan "
                          f"holds {r.planned_bytes}", {"job": r.job_id})]
    if r.wrong_bytes is not None:
        return [Violation("X2", f"job {r.job_id} succeeded but {r.wrong_bytes} differs from "
                          "the plan's copy", {"job": r.job_id, "pool": r.wrong_bytes})]
    return []


def b1_copy_library_refuses(r: CopyCallRecord) -> list[Violation]:
    """B1: the copy library refuses every table ``spec.descriptors`` forbids, with its code,
    index, side and offending values, before any byte moves.

    A bad table the library accepts is the out-of-bounds copy of vllm#44780; a wrong code,
    index or side sends the engineer to the wrong field.
    """
    expected = first_violation(r.regions, r.descs, r.flags)
    cross = cross_violations(r.regions, r.descs) if expected is None else None
    if expected is None and cross is None:
        return []
    got = r.error
    if got is None:
        want = CopyStatus(expected[0] if expected else cross[0]).name  # type: ignore[index]
        return [Violation("B1", f"the copy library accepted a table it must refuse with {want}",
                          {"descs": list(r.descs[:4])})]
    if r.changed:
        return [Violation("B1", "a refused call changed bytes", {"status": got[0]})]
    if expected is not None:
        if tuple(got) != tuple(expected):
            return [Violation("B1", f"refused with {got}, the rule says {expected} "
                              f"({CopyStatus(expected[0]).name})",
                              {"got": got, "want": expected})]
        return []
    code, pairs = cross  # type: ignore[misc]
    if got[0] != code or (got[1], got[3]) not in pairs or got[2] != CROSS_SIDE[code] \
            or got[4] != 0:
        return [Violation("B1", f"refused with {got}, the rule says {CopyStatus(code).name} "
                          f"at one of {sorted(pairs)[:4]}", {"got": got})]
    return []


def x2_copy_library_accepts(r: CopyCallRecord) -> list[Violation]:
    """X2: the copy library carries out every table ``spec.descriptors`` allows, byte for
    byte as one memcpy per descriptor in order."""
    if first_violation(r.regions, r.descs, r.flags) is not None or \
            cross_violations(r.regions, r.descs) is not None:
        return []
    if r.error is not None:
        return [Violation("X2", f"the copy library refused a valid table: {r.error}",
                          {"error": r.error, "descs": list(r.descs[:4])})]
    if not r.copied_ok:
        return [Violation("X2", "an accepted table left other bytes than one memcpy per "
                          "descriptor", {"descs": list(r.descs[:4])})]
    return []


def r1_refines_reference(r: RefinementRecord) -> list[Violation]:
    """R1: kvcore refines the reference model: every hook returns what the reference returns
    (or fails the same way) and their observable state agrees after it.

    The safety invariants allow many wrong answers (a smaller hit, a chunk never stored,
    another eviction); the reference, written apart from kvcore, allows exactly one.
    """
    if r.implementation == r.reference:
        return []
    return [Violation("R1", f"{r.after}: kvcore gave {str(r.implementation)[:300]}, the "
                      f"reference {str(r.reference)[:300]}", {"after": r.after[:120]})]


def a1_bad_call_refused(r: BadCallRecord) -> list[Violation]:
    """A1: a bad call raises a kvcore error that says what is wrong, before anything changes.

    Accepted, it corrupts the state (a block id past the pool is the copy of vllm#44780);
    a bare builtin error halfway through leaves a half-applied step behind.
    """
    if r.raised is None:
        return [Violation("A1", f"{r.call}: accepted", {"call": r.call})]
    if not r.kvcore_error:
        return [Violation("A1", f"{r.call}: raised {r.raised}, not a kvcore error",
                          {"call": r.call, "raised": r.raised})]
    if r.changed:
        return [Violation("A1", f"{r.call}: raised {r.raised} but changed the state",
                          {"call": r.call, "raised": r.raised})]
    if r.mismatch:
        return [Violation("A1", f"{r.call}: raised {r.raised}, but it {r.mismatch}",
                          {"call": r.call, "raised": r.raised})]
    return []


def m1_eviction_safe(r: EvictionRecord) -> list[Violation]:
    """M1: pinned or WRITING keys are never evicted; eviction is atomic.

    Evicting a pinned key hands its slot to a new store while a load still reads it.
    """
    out: list[Violation] = []
    unsafe = [k for k, state in r.evicted if state != "ready"]
    if unsafe:
        out.append(Violation("M1", f"evicted {len(unsafe)} pinned or writing keys",
                             {"keys": [k.hex()[:16] for k in unsafe[:4]]}))
    own = set(r.call_keys) & {k for k, _ in r.evicted}
    if own:
        out.append(Violation("M1", f"evicted {len(own)} keys of the same prepare_store call",
                             {"keys": [k.hex()[:16] for k in list(own)[:4]]}))
    if r.returned_none and (r.evicted or r.changed_state):
        out.append(Violation("M1", "prepare_store returned None but changed state "
                             "(eviction not atomic)", {"evicted": len(r.evicted)}))
    if not r.returned_none and len(r.evicted) != r.needed:
        out.append(Violation("M1", f"evicted {len(r.evicted)} keys, {r.needed} were needed",
                             {"evicted": len(r.evicted), "needed": r.needed}))
    return out


def k1_keys_distinct(r: KeyRecord) -> list[Violation]:
    """K1: keys of different groups or different prefixes never collide.

    Two triples with one key are a collision. So is a key that is not its own (group,
    hash) in the key encoding (the hash, then the group as ``KEY_GROUP_BYTES`` big-endian
    bytes, restated here): it is the key of the prefix and group it encodes, which the
    tier serves to whoever asks for those, whether or not that request is in the record.
    """
    seen: dict[Key, tuple[int, bytes]] = {}
    suffixes: dict[int, bytes] = {}
    for group, chunk_hash, key in r.triples:
        other = seen.setdefault(key, (group, chunk_hash))
        if other != (group, chunk_hash):
            return [Violation("K1", f"key {key.hex()[:24]} names both {other} and "
                              f"{(group, chunk_hash)}", {"groups": (other[0], group)})]
        suffix = suffixes.get(group)
        if suffix is None:
            suffix = suffixes[group] = group.to_bytes(KEY_GROUP_BYTES, "big")
        if key != chunk_hash + suffix:
            owner = (int.from_bytes(key[-KEY_GROUP_BYTES:], "big"),
                     key[:-KEY_GROUP_BYTES].hex()[:16])
            return [Violation("K1", f"key {key.hex()[:24]} was made for group {group}, "
                              f"hash {chunk_hash.hex()[:16]}, but is the key of "
                              f"(group, hash) {owner}", {"groups": (owner[0], group)})]
    return []


# -- eviction order (M2) -----------------------------------------------------------------------


@dataclass(frozen=True)
class TierAgreementRecord:
    """One tier call beside the reference manager's answer to the same call (M2).

    ``got`` and ``want`` are what the tier and the reference returned, or now hold, for
    it: a key's status, the keys' states and slots after a load call, the events of a
    drain with the count dropped. They are compared whole.
    """

    call: str
    got: object
    want: object
    policy: str = ""


def m2_tier_agrees(r: TierAgreementRecord) -> list[Violation]:
    """M2: every answer of the tier is the reference manager's: a status, a pin, a slot
    or an event that differs misleads the lookup, the load or a router reading events."""
    if r.got == r.want:
        return []
    # Cut: a drain's events can name thousands of keys.
    return [Violation("M2", f"{r.call}: the tier gives {str(r.got)[:300]}, the reference "
                      f"{str(r.want)[:300]}", {"policy": r.policy, "call": r.call})]


@dataclass(frozen=True)
class EvictionOrderRecord:
    """One ``prepare_store`` that needed room, beside an independent view of the tier (M2).

    ``queues`` holds the evictable keys (READY, unpinned, not among the call's keys) of
    each recency list as tracked outside the tier, least recent first: one list for LRU,
    T1 then T2 for ARC, whose ``t1_size`` (T1 with its WRITING keys) and ``target`` (p)
    decide which list gives each victim (``tier_target``, ``tier_t1_size``: the tier's own
    p and |T1|, which must agree). ``victims`` is what the tier chose (None: it refused the store).
    ``slots``/``expected_slots`` are the slots the tier and the reference handed out for
    the same choice, when compared.
    """

    policy: str
    needed: int
    queues: tuple[tuple[Key, ...], ...]
    victims: tuple[Key, ...] | None
    t1_size: int = 0
    target: float = 0.0
    slots: tuple[int, ...] | None = None
    expected_slots: tuple[int, ...] | None = None
    tier_target: float | None = None
    tier_t1_size: int | None = None


def _policy_victims(r: EvictionOrderRecord) -> tuple[Key, ...] | None:
    """The victims the policy's rule names, or None when too few keys are evictable."""
    if r.policy == "lru":
        queue = r.queues[0] if r.queues else ()
        return tuple(queue[:r.needed]) if len(queue) >= r.needed else None
    t1, t2 = (list(q) for q in r.queues)
    t1_size = r.t1_size
    chosen: list[Key] = []
    while len(chosen) < r.needed:
        first, second = (t1, t2) if t1_size >= int(r.target) else (t2, t1)
        source = first if first else second
        if not source:
            return None
        if source is t1:
            t1_size -= 1
        chosen.append(source.pop(0))
    return tuple(chosen)


def _short(keys: tuple[Key, ...] | None) -> list[str] | None:
    return None if keys is None else [k.hex()[:12] for k in keys[:4]]


def m2_eviction_order(r: EvictionOrderRecord) -> list[Violation]:
    """M2: eviction takes the policy's victims and nothing else.

    LRU evicts the least recently completed or touched evictable keys; ARC takes the least
    recent evictable key of T1 while ``|T1| >= int(p)``, else of T2, falling back to the
    other list. The tier keeps one pool per group, so a record describes one group's pool
    (its queues, its need, the victims of that group) and victims are the policy's choice
    within the key's group. A store is refused only when too few keys are evictable (for a
    multi-group store: in at least one of its groups), and the slots
    handed out for a choice are the reference's. A policy that evicts a hot key instead of
    a cold one breaks no safety rule (M1), but it turns hits into recomputation.
    """
    want = _policy_victims(r)
    out: list[Violation] = []
    if want != r.victims:
        got, named = _short(r.victims), _short(want)
        out.append(Violation("M2", f"{r.policy} evicted {got}, its rule names {named} "
                             f"({r.needed} needed)",
                             {"policy": r.policy, "victims": got, "expected": named}))
    if r.tier_t1_size is not None and r.tier_t1_size != r.t1_size:
        out.append(Violation("M2", f"arc's |T1| (with WRITING keys) is {r.tier_t1_size} in the "
                             f"tier, {r.t1_size} by its rule", {"policy": r.policy}))
    if r.tier_target is not None and r.tier_target != r.target:
        # p decides every later choice: a drift shows before it first changes a victim.
        out.append(Violation("M2", f"arc's target p is {r.tier_target} in the tier, "
                             f"{r.target} by its rule", {"policy": r.policy}))
    if r.slots is not None and r.expected_slots is not None and r.slots != r.expected_slots:
        out.append(Violation("M2", f"slots {list(r.slots[:8])} differ from the reference's "
                             f"{list(r.expected_slots[:8])}", {"policy": r.policy}))
    return out


# -- bounded buffers (M3) ----------------------------------------------------------------------


@dataclass(frozen=True)
class BufferRecord:
    """What one buffer holds against its limit (M3), in the buffer's unit (keys).

    ``live`` is what the buffer still hands out, ``limit`` its bound. ``dead`` counts
    entries already dropped but still referenced (a lazily cut head), ``oldest`` the size
    of the unit they belong to. ``held`` is what the buffer references, counted
    afresh from its contents where that is cheap (a drain reads them all anyway), else
    None; it must equal ``live + dead``, so a drifting counter cannot hide a leak.
    """

    buffer: str
    live: int
    limit: int
    dead: int = 0
    oldest: int = 0
    held: int | None = None


def m3_buffers_bounded(r: BufferRecord) -> list[Violation]:
    """M3: memory is bounded by what is live: a buffer holds at most its limit, and what
    it dropped but still references is less than half of its oldest unit.

    A buffer past its limit grows with the run (a server that never drains its events
    keeps every key); a dropped head kept whole pins a prefill's 50K-key event for as long
    as nobody drains, and cutting it at every drop copies it per store instead.
    """
    out: list[Violation] = []
    values = {"buffer": r.buffer, "live": r.live, "limit": r.limit, "dead": r.dead}
    if not 0 <= r.live <= r.limit:
        out.append(Violation("M3", f"{r.buffer} holds {r.live} live entries; its limit is "
                             f"{r.limit}", values))
    if r.dead < 0 or (r.dead and 2 * r.dead >= r.oldest):
        out.append(Violation("M3", f"{r.buffer} still references {r.dead} dropped entries of "
                             f"its oldest unit of {r.oldest}: half of it or more", values))
    if r.held is not None and r.held != r.live + r.dead:
        out.append(Violation("M3", f"{r.buffer} references {r.held} entries, its counts say "
                             f"{r.live} live + {r.dead} dropped", values))
    return out


# -- the checker ------------------------------------------------------------------------------

PREDICATES: dict[type, tuple[Callable[[Any], list[Violation]], ...]] = {
    StoreOfferRecord: (e1_volatile_chunk_never_offered,),
    CursorMoveRecord: (e2_cursor_leaves_no_hole,),
    LookupTraceRecord: (e3_one_pop_per_cycle,),
    LookupRecord: (e4_draft_extra_chunk_hit, l1_hit_matches_spec,
                   l2_pending_exactly_when_uncertain),
    LoadRecord: (l1_load_within_verified,),
    LoadCoverageRecord: (l3_load_covers_every_block,),
    JobTableRecord: (j1_one_kind_of_job,),
    CompletionRecord: (j2_completion_exact,),
    PlanRecord: (s1_plan_shape, s2_store_runs, b1_block_ids_in_range),
    FenceRecord: (f1_fence,),
    FailureRecord: (x1_failure_never_hit,),
    TransferOutcomeRecord: (x1_fault_reported, x2_valid_plan_carried_out),
    SetupRecord: (x2_valid_setup_accepted,),
    CopyCallRecord: (b1_copy_library_refuses, x2_copy_library_accepts),
    RefinementRecord: (r1_refines_reference,),
    BadCallRecord: (a1_bad_call_refused,),
    EvictionRecord: (m1_eviction_safe,),
    KeyRecord: (k1_keys_distinct,),
    EvictionOrderRecord: (m2_eviction_order,),
    TierAgreementRecord: (m2_tier_agrees,),
    BufferRecord: (m3_buffers_bounded,),
}

# The id each predicate checks, derived from its name, so the catalogue test can compare
# it with INVARIANTS.md.
PREDICATE_IDS: dict[str, str] = {
    fn.__name__: fn.__name__[:2].upper() for fns in PREDICATES.values() for fn in fns
}


def check(records: Sequence[object]) -> list[Violation]:
    """Run every predicate that applies to each record; the union of their violations."""
    out: list[Violation] = []
    for record in records:
        for predicate in PREDICATES.get(type(record), ()):
            out.extend(predicate(record))
    return out
