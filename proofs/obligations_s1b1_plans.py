"""S1 / S2 / B1 obligations: the plans the spec produces are well shaped and in bounds.

A plan is assembled from the spec's load and store rules the way the reference scheduler
(``spec.model.ReferenceScheduler.after_alloc`` / ``_store``) assembles it: per group, the
GPU block ids and ``block_index`` come from ``spec.load.group_load`` (loads) or from
``spec.store.group_offer`` plus ``chunk_source_blocks`` (stores), with one CPU slot and one
key per chunk. The plan is then checked with the spec's predicates ``s1_plan_shape``,
``s2_store_runs``, ``b1_block_ids_in_range`` and, for loads, ``l1_load_within_verified``.

- ``load_plan_any_size`` (symbolic): a FULL group, draft or not, with any
  ``tokens_per_block`` in 1..64 and ``blocks_per_chunk`` in 1..4, any boundary up to
  ``10**6`` tokens, any C, any number of valid leading blocks covering C, and up to four
  blocks to fill (so a load may start and stop mid-chunk).
- ``load_plan_small_layouts`` / ``store_plan_small_layouts`` (enumerated): window and MAMBA
  groups whose block tables hold leading null blocks, draft groups, ``blocks_per_chunk`` 2.

Mutants: a load whose CPU slot count is derived from the GPU block count (wrong when the
load starts mid-chunk), a load that keeps the table's leading null blocks, and a store
that, like upstream W24, checks only a chunk's last block for null and copies the rest.
"""

from __future__ import annotations

from kvcore.scheduler._rules import (
    GroupLoad,
    chunk_reachable,
    chunk_source_blocks,
    group_load,
    group_offer,
)
from kvcore.spec.invariants import (
    LoadRecord,
    PlanRecord,
    b1_block_ids_in_range,
    l1_load_within_verified,
    s1_plan_shape,
    s2_store_runs,
)
from kvcore.spec.lookup import served_chunks
from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan
from kvcore.spec.types import GroupKind, GroupSpec, OffloadConfig, cdiv, make_key
from proofs._bounded import CONFIRMED, REFUTED, Obligation, pick, small_config
from proofs.obligations_e1e2_store import Table

F, S, M = GroupKind.FULL, GroupKind.SLIDING, GroupKind.MAMBA
KEY = make_key(b"chunk", 0)


def load_transfer(gl: GroupLoad, slot_count: int | None = None) -> GroupTransfer:
    """One group's load job: GPU ids from the load rule, one slot and key per chunk."""
    n = gl.end_chunk - gl.first_chunk if slot_count is None else slot_count
    return GroupTransfer(gl.gpu_block_ids, gl.block_index, tuple(range(n)), (KEY,) * n)


def load_ok(cfg: OffloadConfig, group: int, computed: int, hit: int,
            gt: GroupTransfer, gl: GroupLoad) -> bool:
    groups = tuple(gt if i == group else GroupTransfer() for i in range(len(cfg.groups)))
    record = PlanRecord(cfg, TransferPlan(1, JobKind.LOAD, "r", groups))
    ranges = tuple((gl.first_chunk, gl.end_chunk) if i == group else (0, 0)
                   for i in range(len(cfg.groups)))
    return (s1_plan_shape(record) == [] and b1_block_ids_in_range(record) == []
            and l1_load_within_verified(LoadRecord(cfg, computed, hit, ranges)) == [])


# -- loads, symbolic ------------------------------------------------------------------------------


def load_plan_any_size(tpb: int, bpc: int, draft: bool, computed: int, hit: int,
                       valid: int) -> bool:
    """
    pre: 1 <= tpb <= 64
    pre: 1 <= bpc <= 4
    pre: 0 <= computed and 1 <= hit and computed + hit <= 1000000
    pre: computed // tpb <= valid <= (computed + hit + tpb - 1) // tpb
    pre: (computed + hit + tpb - 1) // tpb - valid <= 4
    post: __return__
    """
    end = cdiv(computed + hit, tpb)
    cfg = small_config(GroupSpec(F, tpb, bpc, is_draft=draft), num_gpu_blocks=end + 1,
                       num_cpu_blocks=8)
    gl = group_load(cfg, 0, computed, hit, Table(end), valid)
    return load_ok(cfg, 0, computed, hit, load_transfer(gl), gl)


# -- loads and stores, enumerated -----------------------------------------------------------------

LAYOUTS: tuple[tuple[OffloadConfig, int], ...] = (
    (small_config(GroupSpec(F, 1, 2)), 0),
    (small_config(GroupSpec(F, 1, 2, is_draft=True)), 0),
    (small_config(GroupSpec(S, 1, 2, window_tokens=3)), 0),
    (small_config(GroupSpec(F, 4), GroupSpec(S, 1, 2, window_tokens=2, is_draft=True)), 1),
    (small_config(GroupSpec(F, 2), GroupSpec(M, 2, 2)), 1),
    (small_config(GroupSpec(S, 3, window_tokens=4)), 0),
)


def engine_nulls(g: GroupSpec, boundary: int) -> int:
    """Leading blocks an engine has freed at ``boundary`` (window reach, MAMBA state)."""
    if g.kind is F:
        return 0
    if g.kind is M:
        return max(cdiv(boundary, g.tokens_per_block) - g.blocks_per_chunk, 0)
    return max(boundary - g.reach_tokens, 0) // g.tokens_per_block


def load_plan_small_layouts(layout: int, computed: int, hit: int) -> bool:
    """
    pre: 0 <= layout < 6
    pre: 0 <= computed <= 4
    pre: 1 <= hit <= 12
    post: __return__
    """
    cfg, group = LAYOUTS[pick(layout, len(LAYOUTS))]
    c = pick(computed, 5)
    h = pick(hit - 1, 12) + 1
    g = cfg.groups[group]
    if served_chunks(g, c + h, c) is None:
        return True  # not a boundary the lookup can return (MAMBA off a chunk end)
    end = cdiv(c + h, g.tokens_per_block)
    gl = group_load(cfg, group, c, h, Table(end, engine_nulls(g, c + h)),
                    c // g.tokens_per_block)
    return load_ok(cfg, group, c, h, load_transfer(gl), gl)


def store_transfer(cfg: OffloadConfig, group: int, table: Table, chunks: tuple[int, ...],
                   keep_nulls: bool = False) -> tuple[GroupTransfer, tuple[int, ...]]:
    """One group's store job and the GPU position of each id (for S2)."""
    bpc = cfg.groups[group].blocks_per_chunk
    runs = []
    for c in chunks:
        if keep_nulls:  # the mutant: copy the chunk's leading null sub-blocks too
            runs.append((c * bpc, tuple(table[c * bpc:(c + 1) * bpc])))
        else:
            runs.append(chunk_source_blocks(table, c, bpc))
    ids = tuple(i for _, run in runs for i in run)
    positions = tuple(p for start, run in runs for p in range(start, start + len(run)))
    gt = GroupTransfer(ids, runs[0][0] if runs else 0, tuple(range(len(chunks))),
                       (KEY,) * len(chunks))
    return gt, positions


def store_ok(cfg: OffloadConfig, group: int, gt: GroupTransfer,
             positions: tuple[int, ...]) -> bool:
    n = len(cfg.groups)
    groups = tuple(gt if i == group else GroupTransfer() for i in range(n))
    pos = tuple(positions if i == group else () for i in range(n))
    record = PlanRecord(cfg, TransferPlan(2, JobKind.STORE, "r", groups), positions=pos)
    return (s1_plan_shape(record) == [] and s2_store_runs(record) == []
            and b1_block_ids_in_range(record) == [])


def _store_case(layout: int, cursor: int, frontier: int, nulls: int, mutant: bool) -> bool:
    cfg, group = LAYOUTS[pick(layout, len(LAYOUTS))]
    g = cfg.groups[group]
    v = pick(frontier, 13)
    table = Table(cdiv(v, g.tokens_per_block) + g.blocks_per_chunk, pick(nulls, 4))
    offer = group_offer(cfg, group, pick(cursor, 3), v, v, table)
    chunks = offer.offered
    if mutant:  # upstream W24's rule: skip a chunk only when its *last* block is null
        bpc = g.blocks_per_chunk
        chunks = tuple(c for c in range(offer.old_cursor, offer.new_cursor)
                       if table[c * bpc + bpc - 1] != 0 and chunk_reachable(cfg, group, c))
    gt, positions = store_transfer(cfg, group, table, chunks, keep_nulls=mutant)
    return store_ok(cfg, group, gt, positions)


def store_plan_small_layouts(layout: int, cursor: int, frontier: int, nulls: int) -> bool:
    """
    pre: 0 <= layout < 6
    pre: 0 <= cursor <= 2
    pre: 0 <= frontier <= 12
    pre: 0 <= nulls <= 3
    post: __return__
    """
    return _store_case(layout, cursor, frontier, nulls, mutant=False)


# -- mutants ----------------------------------------------------------------------------------


def mutant_load_slots_from_blocks(tpb: int, bpc: int, draft: bool, computed: int, hit: int,
                                  valid: int) -> bool:
    """CPU slots counted as ``cdiv(len(gpu ids), bpc)``: wrong for a mid-chunk start.

    pre: 1 <= tpb <= 64
    pre: 1 <= bpc <= 4
    pre: 0 <= computed and 1 <= hit and computed + hit <= 1000000
    pre: computed // tpb <= valid <= (computed + hit + tpb - 1) // tpb
    pre: (computed + hit + tpb - 1) // tpb - valid <= 4
    post: __return__
    """
    end = cdiv(computed + hit, tpb)
    cfg = small_config(GroupSpec(F, tpb, bpc, is_draft=draft), num_gpu_blocks=end + 1,
                       num_cpu_blocks=8)
    gl = group_load(cfg, 0, computed, hit, Table(end), valid)
    wrong = load_transfer(gl, cdiv(len(gl.gpu_block_ids), bpc))
    return load_ok(cfg, 0, computed, hit, wrong, gl)


def mutant_load_keeps_leading_nulls(layout: int, computed: int, hit: int) -> bool:
    """The load takes every block from the first invalid one, freed (null) blocks included.

    pre: 0 <= layout < 6
    pre: 0 <= computed <= 4
    pre: 1 <= hit <= 12
    post: __return__
    """
    cfg, group = LAYOUTS[pick(layout, len(LAYOUTS))]
    c = pick(computed, 5)
    h = pick(hit - 1, 12) + 1
    g = cfg.groups[group]
    if served_chunks(g, c + h, c) is None:
        return True
    end = cdiv(c + h, g.tokens_per_block)
    table = Table(end, engine_nulls(g, c + h))
    valid = c // g.tokens_per_block
    gl = group_load(cfg, group, c, h, table, valid)
    if not gl.gpu_block_ids:
        return True
    start = valid
    wrong = GroupLoad(start // g.blocks_per_chunk, gl.end_chunk, start,
                      tuple(table[start:end]))
    return load_ok(cfg, group, c, h, load_transfer(wrong), wrong)


def mutant_store_keeps_null_sub_blocks(layout: int, cursor: int, frontier: int,
                                       nulls: int) -> bool:
    """A chunk is skipped only when its last block is null (upstream W24's rule), and the
    source pass copies every sub-block of it, so a leading null sub-block becomes GPU id 0.

    pre: 0 <= layout < 6
    pre: 0 <= cursor <= 2
    pre: 0 <= frontier <= 12
    pre: 0 <= nulls <= 3
    post: __return__
    """
    return _store_case(layout, cursor, frontier, nulls, mutant=True)


OBLIGATIONS = (
    Obligation("load_plan_any_size", CONFIRMED, 30, 10),
    Obligation("load_plan_small_layouts", CONFIRMED, 30, 10),
    Obligation("store_plan_small_layouts", CONFIRMED, 60, 10),
    Obligation("mutant_load_slots_from_blocks", REFUTED, 20, 5, "load_plan_any_size"),
    Obligation("mutant_load_keeps_leading_nulls", REFUTED, 20, 5, "load_plan_small_layouts"),
    Obligation("mutant_store_keeps_null_sub_blocks", REFUTED, 20, 5,
               "store_plan_small_layouts"),
)
# The most CPU seconds this file's obligations may take together (the sum of their
# per-condition budgets must fit); measured times are far lower (see proofs/README.md).
TOTAL_BUDGET_S = 180
