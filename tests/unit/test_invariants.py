"""Every invariant predicate can hold and can fail (kvcore.spec.invariants).

Goal: a check that cannot fail is a defect. For every predicate in ``PREDICATES``, a record
that satisfies it (the predicate returns ``[]``) and, for each of its clauses, a record just
across the line that violates it, showing the predicate reports the right id and names the
offending values. Plus the catalogue: ``spec/INVARIANTS.md`` names exactly
``INVARIANT_IDS``, every id has at least one predicate, and ``check`` dispatches each record
to its predicates.

Method: one table of (predicate, holding record, violating records). Each violating record
is a minimal edit of the holding one (TigerBeetle's positive and negative space). A
coverage test asserts the table names every registered predicate, so a new predicate
without a failing-record test turns the suite red.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from spec_strategies import FULL, SLIDING, make_config, parse_statuses

from kvcore._native import Region
from kvcore.spec.descriptors import Status as CopyStatus
from kvcore.spec.invariants import (
    INVARIANT_IDS,
    PREDICATE_IDS,
    PREDICATES,
    BadCallRecord,
    BufferRecord,
    CompletionRecord,
    CopyCallRecord,
    CursorMoveRecord,
    EvictionOrderRecord,
    EvictionRecord,
    FailureRecord,
    FenceRecord,
    JobTableRecord,
    KeyRecord,
    LoadCoverageRecord,
    LoadRecord,
    LookupRecord,
    LookupTraceRecord,
    PlanRecord,
    RefinementRecord,
    SetupRecord,
    Skip,
    StoreOfferRecord,
    TierAgreementRecord,
    TraceEntry,
    TransferOutcomeRecord,
    Violation,
    a1_bad_call_refused,
    b1_block_ids_in_range,
    b1_copy_library_refuses,
    check,
    e1_volatile_chunk_never_offered,
    e2_cursor_leaves_no_hole,
    e3_one_pop_per_cycle,
    e4_draft_extra_chunk_hit,
    f1_fence,
    j1_one_kind_of_job,
    j2_completion_exact,
    k1_keys_distinct,
    l1_hit_matches_spec,
    l1_load_within_verified,
    l2_pending_exactly_when_uncertain,
    l3_load_covers_every_block,
    m1_eviction_safe,
    m2_eviction_order,
    m2_tier_agrees,
    m3_buffers_bounded,
    r1_refines_reference,
    s1_plan_shape,
    s2_store_runs,
    x1_failure_never_hit,
    x1_fault_reported,
    x2_copy_library_accepts,
    x2_valid_plan_carried_out,
    x2_valid_setup_accepted,
)
from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan
from kvcore.spec.types import PENDING, GroupSpec, Status, make_key

Predicate = Callable[[Any], list[Violation]]

# -- records ------------------------------------------------------------------------------------

K = [make_key(bytes([i]) * 8, 0) for i in range(8)]

DRAFT_CFG = make_config(GroupSpec(FULL, 4, is_draft=True))
TWO_CFG = make_config(GroupSpec(FULL, 4), GroupSpec(SLIDING, 2, 2, window_tokens=8))
SMALL_CFG = make_config(GroupSpec(FULL, 4), GroupSpec(FULL, 2, 2))
SMALL_CFG = replace(SMALL_CFG, num_gpu_blocks=10, num_cpu_blocks=6)

E1_OK = StoreOfferRecord(group=1, is_draft=True, tokens_per_chunk=4, frontier=16,
                         offered=(0, 1, 2))
E2_OK = CursorMoveRecord(group=0, old=2, new=5, offered=frozenset({2, 4}),
                         skipped={3: Skip.NULL})
E3_OK = LookupTraceRecord(
    draft=(False, True, True),
    entries=(TraceEntry(0, 100, (0, 25), 100, 0),
             TraceEntry(1, 100, (20, 26), 96, 1),   # draft group 1 shrinks to 96 ...
             TraceEntry(2, 96, (22, 25), 80, 1),    # ... draft group 2 shrinks to 80 ...
             TraceEntry(1, 80, (18, 21), 80, 1)),   # ... so group 1 is re-verified at 80.
    final_boundary=80)
E4_OK = LookupRecord(DRAFT_CFG, 0, 12, (parse_statuses("HHH"),), None, 8)
L1_OK = LookupRecord(TWO_CFG, 0, 13, (parse_statuses("HHH"), parse_statuses("HHH")), None, 12)
L1_LOAD_OK = LoadRecord(TWO_CFG, 0, 12, ((0, 3), (1, 3)))
L2_OK = LookupRecord(TWO_CFG, 0, 13, (parse_statuses("HHP"), parse_statuses("HHH")), None,
                     PENDING)
# TWO_CFG, C = 2, hit 10 (boundary 12): group 0 (4-token blocks) holds block 0 valid and
# is told blocks 0-2; group 1 (2-token blocks) has null padding at 0-1, blocks 2-5 real,
# none valid. The load fills group 0 positions 1-2 and group 1 positions 2-5.
L3_OK = LoadCoverageRecord(
    TWO_CFG, 2, 10, ((11, 12, 13, 14), (0, 0, 21, 22, 23, 24, 25)), (1, 0),
    TransferPlan(5, JobKind.LOAD, "r", (GroupTransfer((12, 13), 1, (0, 1), (K[0], K[1])),
                                        GroupTransfer((21, 22, 23, 24), 2, (2, 3),
                                                      (K[2], K[3])))))
J1_OK = JobTableRecord("r", (JobKind.STORE, JobKind.STORE), lookup_answered=False)
J2_OK = CompletionRecord(job_id=7, num_workers=4, reports=4, complete_calls=1,
                         job_keys=frozenset(K[:3]), completed_keys=frozenset(K[:3]))


def plan(kind: JobKind, *groups: GroupTransfer) -> TransferPlan:
    return TransferPlan(3, kind, "r", groups)


# Group 0: 4-token chunks, one block each; group 1: two 2-token blocks per chunk.
S1_OK = PlanRecord(SMALL_CFG, plan(
    JobKind.LOAD,
    GroupTransfer((1, 2), 0, (0, 1), (K[0], K[1])),
    GroupTransfer((3, 4, 5), 1, (2, 3), (K[2], K[3]))))  # starts mid-chunk: 2 chunks
S2_OK = PlanRecord(SMALL_CFG, plan(
    JobKind.STORE,
    GroupTransfer((1, 2), 0, (0, 1), (K[0], K[1])),
    GroupTransfer((3, 4, 5, 6), 2, (2, 3), (K[2], K[3]))),
    positions=((0, 1), (2, 3, 4, 5)))  # group 1: whole chunks 1 and 2 ([2, 3], [4, 5])
B1_OK = PlanRecord(SMALL_CFG, plan(
    JobKind.STORE,
    GroupTransfer((1, 9), 0, (0, 5), (K[0], K[1])),  # both ends of both ranges
    GroupTransfer()))
F1_OK = FenceRecord(allocated=frozenset({5, 6}), store_sources={1: frozenset({5}),
                                                                 2: frozenset({7})},
                    flushed=frozenset({1}))
X1_OK = FailureRecord(failed_store_status={K[0]: Status.MISS},
                      failed_load_jobs=frozenset({4}), reported_load_jobs=frozenset({4}))
X2_OK = TransferOutcomeRecord(job_id=7, planned_bytes=4096, success=True, moved_bytes=4096)
# A job the harness failed on purpose, reported failed: X1 holds, and X2 does not call it
# a refusal of a valid plan.
X1_FAULT_OK = TransferOutcomeRecord(job_id=7, planned_bytes=4096, success=False, moved_bytes=0,
                                    error="SimulatedFault: job 7", injected=True)
X2_SETUP_OK = SetupRecord("TransferEngine: valid tensors", None)
# Two pools of 4 rows of 64 bytes; the first refuses row 0 (the null block).
POOLS = (Region(4096, 256, 64, 64, 4, 1), Region(8192, 256, 64, 64, 4, 0))
B1_COPY_OK = CopyCallRecord(POOLS, ((0, 0, 0, 1, 2, 0, 64),),  # reads the null row
                            (CopyStatus.E_NULL_ROW, 0, 1, 0, 1), changed=False,
                            copied_ok=False)
X2_COPY_OK = CopyCallRecord(POOLS, ((0, 1, 0, 1, 2, 0, 64), (1, 3, 0, 0, 2, 32, 32)), None,
                            changed=False, copied_ok=True)
R1_OK = RefinementRecord("lookup('r1', 0, 40)", ("LookupResult", (32,)), ("LookupResult", (32,)))
A1_OK = BadCallRecord("lookup: negative computed", "ArgumentRangeError", kvcore_error=True,
                      changed=False)
M1_OK = EvictionRecord(call_keys=(K[0], K[1]), evicted=((K[2], "ready"), (K[3], "ready")),
                       needed=2, returned_none=False, changed_state=True)
# LRU: the two least recent evictable keys go. ARC: |T1| = 2 < int(p) = 3, so T2 gives
# the first victim; then T2 is empty and T1 gives the second (the fallback).
M2_LRU_OK = EvictionOrderRecord("lru", 2, ((K[0], K[1], K[2]),), (K[0], K[1]),
                                slots=(4, 5), expected_slots=(4, 5))
M2_ARC_OK = EvictionOrderRecord("arc", 2, ((K[0], K[1]), (K[2],)), (K[2], K[0]),
                                t1_size=2, target=3.5, tier_target=3.5, tier_t1_size=2)
M2_TIER_OK = TierAgreementRecord("lookup(ab12)", "HIT", "HIT", "lru")
# 24 live keys at the limit, 4 dropped of an oldest event of 9 (less than half), counted.
M3_OK = BufferRecord("events", live=24, limit=24, dead=4, oldest=9, held=28)
K1_OK = KeyRecord(((0, b"a", make_key(b"a", 0)), (1, b"a", make_key(b"a", 1)),
                   (0, b"a", make_key(b"a", 0))))


@dataclass(frozen=True)
class Across:
    """A record just across the line, and a fragment its violation message must contain."""

    clause: str
    record: Any
    fragment: str


def group1(rec: PlanRecord, **edit: Any) -> PlanRecord:
    groups = list(rec.plan.groups)
    groups[1] = replace(groups[1], **edit)
    return replace(rec, plan=replace(rec.plan, groups=tuple(groups)))


def group0(rec: PlanRecord, **edit: Any) -> PlanRecord:
    groups = list(rec.plan.groups)
    groups[0] = replace(groups[0], **edit)
    return replace(rec, plan=replace(rec.plan, groups=tuple(groups)))


TABLE: list[tuple[Predicate, Any, list[Across]]] = [
    (e1_volatile_chunk_never_offered, E1_OK, [
        Across("volatile chunk V // o - 1 offered", replace(E1_OK, offered=(0, 1, 2, 3)),
               "volatile chunks [3]"),
        Across("frontier one token short of the next chunk",
               replace(E1_OK, frontier=15), "volatile chunks [2]"),
    ]),
    (e2_cursor_leaves_no_hole, E2_OK, [
        Across("cursor moved back", replace(E2_OK, new=1, offered=frozenset(), skipped={}),
               "moved back 2 -> 1"),
        Across("passed a chunk neither offered nor skipped",
               replace(E2_OK, offered=frozenset({2})), "passed chunks [4]"),
        Across("cursor one past the last offered chunk", replace(E2_OK, new=6),
               "passed chunks [5]"),
    ]),
    (e3_one_pop_per_cycle, E3_OK, [
        Across("double pop", replace(E3_OK, entries=(
            *E3_OK.entries[:3], replace(E3_OK.entries[3], pops=2))), "with 2 pops"),
        Across("draft verified without its extra chunk", replace(E3_OK, entries=(
            *E3_OK.entries[:3], replace(E3_OK.entries[3], pops=0))), "with 0 pops"),
        Across("a non-draft group popped", replace(E3_OK, entries=(
            replace(E3_OK.entries[0], pops=1), *E3_OK.entries[1:])), "expected 0"),
        # Upstream 0.33: a draft shrink does not end the other draft group's cycle.
        Across("not re-verified after another draft group shrank",
               replace(E3_OK, entries=E3_OK.entries[:3]), "last verified at 96"),
        Across("a draft group never verified",
               replace(E3_OK, draft=(False, True, True, True)), "never verified"),
    ]),
    (e4_draft_extra_chunk_hit, E4_OK, [
        Across("extra chunk is a miss",
               replace(E4_OK, hits=(parse_statuses("HHM"),)), "extra chunk 2 is Status.MISS"),
        Across("extra chunk does not exist", replace(E4_OK, result=12), "extra chunk 3 is None"),
        Across("extra chunk still pending",
               replace(E4_OK, hits=(parse_statuses("HHP"),)), "Status.PENDING"),
    ]),
    (l1_hit_matches_spec, L1_OK, [
        Across("one chunk too many", replace(L1_OK, result=16), "the spec's hit is 12"),
        Across("one token too few", replace(L1_OK, result=11), "the spec's hit is 12"),
    ]),
    (l1_load_within_verified, L1_LOAD_OK, [
        Across("window group loads a chunk below its reach",
               replace(L1_LOAD_OK, chunk_ranges=((0, 3), (0, 3))), "group 1 loads chunks [0, 3)"),
        Across("loads one chunk past the boundary",
               replace(L1_LOAD_OK, chunk_ranges=((0, 4), (1, 3))), "group 0 loads chunks [0, 4)"),
        Across("draft group loads its extra chunk",
               LoadRecord(DRAFT_CFG, 0, 8, ((0, 3),)), "outside the verified range (0, 2)"),
    ]),
    (l3_load_covers_every_block, L3_OK, [
        # What a load starting one block late looks like (kvcore's first_unfilled
        # mutant, killed in tests/refinement/test_refinement_mutants.py).
        Across("the first block to fill is skipped", replace(L3_OK, plan=group0(
            PlanRecord(TWO_CFG, L3_OK.plan), gpu_block_ids=(13,), block_index=2).plan),
            "group 0: blocks at positions [1]"),
        Across("the last block told loaded is left stale", replace(L3_OK, plan=group1(
            PlanRecord(TWO_CFG, L3_OK.plan), gpu_block_ids=(21, 22, 23)).plan),
            "group 1: blocks at positions [5]"),
        Across("a block filled with another id", replace(L3_OK, plan=group1(
            PlanRecord(TWO_CFG, L3_OK.plan), gpu_block_ids=(21, 22, 23, 26)).plan),
            "blocks at positions [5]"),
        Across("a valid block overwritten", replace(L3_OK, plan=group0(
            PlanRecord(TWO_CFG, L3_OK.plan), gpu_block_ids=(11, 12, 13), block_index=0).plan),
            "writes positions [0] outside [1, 3)"),
        Across("a block past the boundary written", replace(L3_OK, plan=group0(
            PlanRecord(TWO_CFG, L3_OK.plan), gpu_block_ids=(12, 13, 14)).plan),
            "writes positions [3] outside [1, 3)"),
        Across("a group's entry missing from the plan", replace(L3_OK, plan=replace(
            L3_OK.plan, groups=L3_OK.plan.groups[:1])), "group 1: blocks at positions [2, 3"),
    ]),
    (l2_pending_exactly_when_uncertain, L2_OK, [
        Across("uncertain answer given as a number", replace(L2_OK, result=8), "spec says PENDING"),
        Across("certain answer deferred", replace(L2_OK, hits=(
            parse_statuses("HHH"), parse_statuses("HHH")), result=PENDING), "spec says 12"),
        Across("a served key being loaded, answered", replace(L1_OK, loading=(
            frozenset({2}), frozenset())), "spec says PENDING"),
    ]),
    (j1_one_kind_of_job, J1_OK, [
        Across("a load beside a store", replace(J1_OK, kinds=(JobKind.LOAD, JobKind.STORE)),
               "has a load and other jobs"),
        Across("two loads", replace(J1_OK, kinds=(JobKind.LOAD, JobKind.LOAD)),
               "has a load and other jobs"),
        Across("lookup answered with a job in flight",
               replace(J1_OK, kinds=(JobKind.STORE,), lookup_answered=True),
               "got a lookup answer with 1 jobs"),
    ]),
    (j2_completion_exact, J2_OK, [
        Across("one report short", replace(J2_OK, reports=3), "after 3 reports"),
        Across("one report too many", replace(J2_OK, reports=5), "after 5 reports"),
        Across("complete_* twice", replace(J2_OK, complete_calls=2), "called 2 times"),
        Across("complete_* never", replace(J2_OK, complete_calls=0), "called 0 times"),
        Across("a key missing", replace(J2_OK, completed_keys=frozenset(K[:2])),
               "completed keys differ"),
        Across("an extra key", replace(J2_OK, completed_keys=frozenset(K[:4])),
               "completed keys differ"),
    ]),
    (s1_plan_shape, S1_OK, [
        Across("one group entry missing", replace(S1_OK, plan=replace(
            S1_OK.plan, groups=S1_OK.plan.groups[:1])), "1 group entries for 2 groups"),
        Across("one slot short", group1(S1_OK, cpu_slots=(2,)), "span 2 chunks, but 1 slots"),
        Across("one key too many", group0(S1_OK, keys=(K[0], K[1], K[4])),
               "span 2 chunks, but 2 slots and 3 keys"),
        Across("one GPU block too many spills into a third chunk",
               group1(S1_OK, gpu_block_ids=(3, 4, 5, 6)), "span 3 chunks"),
    ]),
    (s2_store_runs, S2_OK, [
        Across("a later run is short", replace(S2_OK, positions=((0, 1), (2, 3, 4))),
               "run 1 [4] is not a whole chunk"),
        Across("the first run is short (kvcore stores whole chunks only)",
               replace(S2_OK, positions=((0, 1), (3, 4, 5))), "run 0 [3] is not a whole chunk"),
        Across("chunks go backwards", replace(S2_OK, positions=((1, 0), (4, 5, 2, 3))),
               "repeat or go backwards"),
        Across("block_index is not the first position", group1(S2_OK, block_index=0),
               "block_index 0 != first position 2"),
    ]),
    (b1_block_ids_in_range, B1_OK, [
        Across("the null GPU block", group0(B1_OK, gpu_block_ids=(0, 9)), "GPU ids [0]"),
        Across("GPU id == num_gpu_blocks", group0(B1_OK, gpu_block_ids=(1, 10)),
               "GPU ids [10] outside 1..9"),
        Across("CPU slot == num_cpu_blocks", group0(B1_OK, cpu_slots=(0, 6)),
               "CPU slots [6] outside 0..5"),
        Across("negative CPU slot", group0(B1_OK, cpu_slots=(-1, 5)), "CPU slots [-1]"),
    ]),
    (f1_fence, F1_OK, [
        Across("a re-allocated source block of an unflushed store",
               replace(F1_OK, flushed=frozenset()), "stores [1]"),
        Across("a second store reads a re-allocated block",
               replace(F1_OK, store_sources={**F1_OK.store_sources, 2: frozenset({6})}),
               "stores [2]"),
    ]),
    (x1_failure_never_hit, X1_OK, [
        Across("a failed store's key is READY", replace(X1_OK, failed_store_status={
            K[0]: Status.HIT}), "1 keys of failed stores are still present"),
        Across("a failed store's key is still WRITING", replace(X1_OK, failed_store_status={
            K[0]: Status.PENDING}), "still present"),
        Across("a failed load not reported for recompute",
               replace(X1_OK, reported_load_jobs=frozenset()), "failed loads [4]"),
    ]),
    (x1_fault_reported, X1_FAULT_OK, [
        Across("a failed copy reported as landed",
               replace(X1_FAULT_OK, success=True, moved_bytes=4096, error=None),
               "reported success=True with 4096 bytes"),
        Across("a failed copy reported with bytes", replace(X1_FAULT_OK, moved_bytes=1),
               "success=False with 1 bytes"),
    ]),
    (x2_valid_plan_carried_out, X1_FAULT_OK, []),
    (x2_valid_plan_carried_out, X2_OK, [
        Across("the engine refused the plan",
               replace(X2_OK, success=False, moved_bytes=0, error="KVCopyError: code 11"),
               "refused a valid plan"),
        Across("one byte short", replace(X2_OK, moved_bytes=4095), "moved 4095 bytes"),
        Across("copied to the wrong place", replace(X2_OK, wrong_bytes="CPU tier [1][0]"),
               "CPU tier [1][0] differs"),
    ]),
    (x2_valid_setup_accepted, X2_SETUP_OK, [
        Across("a valid engine refused", replace(
            X2_SETUP_OK, refused="TransferArgumentError: max_queued_jobs: 64 ..."),
            "a valid call refused or not honoured"),
    ]),
    (b1_copy_library_refuses, B1_COPY_OK, [
        Across("a bad table accepted", replace(B1_COPY_OK, error=None), "accepted a table"),
        Across("refused with another code",
               replace(B1_COPY_OK, error=(CopyStatus.E_ROW_RANGE, 0, 1, 0, 4)),
               "the rule says"),
        Across("refused, but on the wrong side",
               replace(B1_COPY_OK, error=(CopyStatus.E_NULL_ROW, 0, 2, 0, 1)), "the rule says"),
        Across("refused, but bytes changed", replace(B1_COPY_OK, changed=True),
               "changed bytes"),
        Across("two destinations meet, accepted",
               replace(X2_COPY_OK, descs=((0, 1, 0, 1, 2, 0, 64), (0, 2, 0, 1, 2, 8, 8)),
                       error=None), "E_DST_OVERLAP"),
    ]),
    (x2_copy_library_accepts, X2_COPY_OK, [
        Across("a valid table refused",
               replace(X2_COPY_OK, error=(CopyStatus.E_SIZE, 0, 1, 64, 63), copied_ok=False),
               "refused a valid table"),
        Across("accepted, wrong bytes", replace(X2_COPY_OK, copied_ok=False), "other bytes"),
    ]),
    (r1_refines_reference, R1_OK, [
        Across("a smaller hit than the reference's",
               replace(R1_OK, implementation=("LookupResult", (16,))), "kvcore gave"),
    ]),
    (a1_bad_call_refused, A1_OK, [
        Across("accepted", replace(A1_OK, raised=None, kvcore_error=False), "accepted"),
        Across("a bare builtin", replace(A1_OK, raised="TypeError", kvcore_error=False),
               "not a kvcore error"),
        Across("refused after a change", replace(A1_OK, changed=True), "changed the state"),
        Across("refused, naming another argument",
               replace(A1_OK, mismatch="names 'num_tokens'; the fault is in 'computed'"),
               "but it names 'num_tokens'"),
    ]),
    (m1_eviction_safe, M1_OK, [
        Across("a pinned key evicted",
               replace(M1_OK, evicted=((K[2], "pinned"), (K[3], "ready"))),
               "evicted 1 pinned or writing"),
        Across("a writing key evicted",
               replace(M1_OK, evicted=((K[2], "ready"), (K[3], "writing"))),
               "evicted 1 pinned or writing"),
        Across("a key of the same call evicted",
               replace(M1_OK, evicted=((K[2], "ready"), (K[1], "ready"))),
               "keys of the same prepare_store call"),
        Across("None returned after evicting",
               replace(M1_OK, returned_none=True, changed_state=False), "not atomic"),
        Across("None returned after a state change",
               replace(M1_OK, returned_none=True, evicted=(), changed_state=True),
               "not atomic"),
        Across("one eviction more than needed", replace(M1_OK, needed=1),
               "evicted 2 keys, 1 were needed"),
    ]),
    (m2_eviction_order, M2_LRU_OK, [
        Across("a more recent key evicted first", replace(M2_LRU_OK, victims=(K[0], K[2])),
               "lru evicted"),
        Across("a store refused with enough evictable keys",
               replace(M2_LRU_OK, victims=None), "evicted None"),
        Across("a victim when too few keys are evictable",
               replace(M2_LRU_OK, needed=4), "names None"),
        Across("slots other than the reference's",
               replace(M2_LRU_OK, slots=(5, 4)), "differ from the reference"),
    ]),
    (m2_eviction_order, M2_ARC_OK, [
        Across("T1 preferred although |T1| < int(p)", replace(M2_ARC_OK, victims=(K[0], K[1])),
               "arc evicted"),
        Across("a more recent T2 key evicted before the least recent one",
               replace(M2_ARC_OK, queues=((K[0], K[1]), (K[3], K[2])), victims=(K[2], K[0])),
               "arc evicted"),
        Across("int(p) = 2 <= |T1|: T1 must give the first victim",
               replace(M2_ARC_OK, target=2.5),
               "arc evicted"),
        Across("the tier's p drifted from the rule's, the same victims still",
               replace(M2_ARC_OK, tier_target=4.5), "target p is 4.5 in the tier"),
        Across("the tier counts one WRITING key too many in |T1|",
               replace(M2_ARC_OK, tier_t1_size=3), "|T1| (with WRITING keys) is 3"),
    ]),
    (m2_tier_agrees, M2_TIER_OK, [
        Across("a key the reference holds READY answered PENDING",
               replace(M2_TIER_OK, got="PENDING"), "the tier gives PENDING"),
        Across("a drain's dropped count differs",
               replace(M2_TIER_OK, call="take_events", got=((), 1), want=((), 0)),
               "take_events: the tier gives ((), 1)"),
    ]),
    (m3_buffers_bounded, M3_OK, [
        Across("one live key past the limit", replace(M3_OK, live=25, held=29),
               "holds 25 live entries; its limit is 24"),
        Across("dropped keys of exactly half the oldest event still referenced",
               replace(M3_OK, dead=5, oldest=10, held=29), "half of it or more"),
        Across("a dropped head past its own event", replace(M3_OK, dead=9, oldest=9, held=33),
               "half of it or more"),
        Across("the counts say one key fewer than the events reference",
               replace(M3_OK, held=29), "references 29 entries"),
    ]),
    (k1_keys_distinct, K1_OK, [
        Across("one key for two groups",
               KeyRecord((*K1_OK.triples, (2, b"a", make_key(b"a", 0)))), "names both"),
        Across("one key for two prefixes",
               KeyRecord((*K1_OK.triples, (0, b"b", make_key(b"a", 0)))), "names both"),
        Across("a key made from a neighbour's hash, alone in its record",
               KeyRecord(((0, b"b", make_key(b"a", 0)),)), "but is the key of"),
        Across("a key of the right hash under another group",
               KeyRecord(((1, b"b", make_key(b"b", 0)),)), "was made for group 1"),
    ]),
]

PREDICATE_ID = {fn: fn.__name__[:2].upper() for fn, _, _ in TABLE}


@pytest.mark.parametrize(("predicate", "record"),
                         [pytest.param(p, r, id=p.__name__) for p, r, _ in TABLE])
def test_holding_record_passes(predicate: Predicate, record: Any) -> None:
    assert predicate(record) == []
    assert check([record]) == []


@pytest.mark.parametrize(("predicate", "across"), [
    pytest.param(p, a, id=f"{p.__name__}: {a.clause}") for p, _, cases in TABLE for a in cases])
def test_record_across_the_line_is_reported(predicate: Predicate, across: Across) -> None:
    violations = predicate(across.record)
    assert violations, f"{predicate.__name__} missed: {across.clause}"
    assert {v.id for v in violations} == {PREDICATE_IDS[predicate.__name__]}
    assert any(across.fragment in v.message for v in violations), \
        [v.message for v in violations]
    assert all(v.values for v in violations), "a violation names its offending values"
    # check() reaches the same predicate through its record type.
    assert any(v in check([across.record]) for v in violations)


def test_every_registered_predicate_has_a_failing_record() -> None:
    registered = {fn for fns in PREDICATES.values() for fn in fns}
    tested = {fn for fn, _, cases in TABLE if cases}
    assert registered == tested


def test_predicate_ids_follow_the_names() -> None:
    for fns in PREDICATES.values():
        for fn in fns:
            assert PREDICATE_IDS[fn.__name__] == fn.__name__[:2].upper()
            assert PREDICATE_IDS[fn.__name__] in INVARIANT_IDS
            assert fn.__doc__ and fn.__doc__.startswith(PREDICATE_IDS[fn.__name__])


def test_every_invariant_id_has_a_predicate() -> None:
    assert set(PREDICATE_IDS.values()) == set(INVARIANT_IDS)
    assert len(set(INVARIANT_IDS)) == len(INVARIANT_IDS)


def test_check_runs_every_predicate_of_a_record_type() -> None:
    """A LookupRecord breaking E4, L1 and L2 at once reports all three ids."""
    record = replace(E4_OK, hits=(parse_statuses("HHP"),), result=12)
    assert {v.id for v in check([record])} == {"E4", "L2"}
    record = replace(E4_OK, hits=(parse_statuses("HHHM"),), num_tokens=16, result=4)
    assert {v.id for v in check([record])} == {"L1"}
    assert check([object(), E1_OK]) == []


def test_violations_of_several_records_are_all_reported() -> None:
    bad = [replace(E1_OK, offered=(3,)), replace(J2_OK, reports=1), K1_OK]
    assert [v.id for v in check(bad)] == ["E1", "J2"]


# -- the catalogue ----------------------------------------------------------------------------

INVARIANTS_MD = Path(__file__).resolve().parents[2] / "spec" / "INVARIANTS.md"


def catalogue_ids(text: str) -> list[str]:
    """The ids in the first column of INVARIANTS.md's table (header and rule rows skipped)."""
    ids = []
    for line in text.splitlines():
        if not line.lstrip().startswith("|"):
            continue
        first = line.strip().strip("|").split("|")[0]
        cell = re.sub(r"[`*_\s]", "", first)
        if re.fullmatch(r"[A-Z]\d+", cell):
            ids.append(cell)
    return ids


def test_catalogue_parser_reads_the_first_column() -> None:
    text = "| id | statement |\n|---|---|\n| **E1** | x |\n| `B1` | y |\nE2 is prose\n"
    assert catalogue_ids(text) == ["E1", "B1"]


def test_invariants_md_names_exactly_the_invariant_ids() -> None:
    assert INVARIANTS_MD.exists(), "spec/INVARIANTS.md is missing: one row per invariant id"
    ids = catalogue_ids(INVARIANTS_MD.read_text(encoding="utf-8"))
    assert len(ids) == len(set(ids)), f"duplicate rows: {ids}"
    assert set(ids) == set(INVARIANT_IDS)
