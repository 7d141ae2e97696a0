"""L1 (load half) / S1 / B1 / load coverage obligations on kvcore's load planner.

Functions under test: ``kvcore.scheduler._rules.load_plan`` (which calls ``group_load``
and ``first_unfilled``), assembled into a load job as ``OffloadScheduler.after_alloc``
does (one CPU slot and key per chunk ``[first_chunk, end_chunk)``). Compared with the
predicates ``l1_load_within_verified``, ``s1_plan_shape`` and ``b1_block_ids_in_range``
and with the load rule stated here from the semantics: for boundary ``T = C + hit`` the
blocks to fill run from the first non-null block at or after ``valid_blocks`` to
``cdiv(T, tokens_per_block)``; every non-null block in ``[valid_blocks, cdiv(T, tpb))``
is filled (coverage: a request told its tokens are loaded gets every block filled), a
null inside that run or a short table is a ``BlockTableError``, and a run that starts
before the chunks the lookup verified is a ``ConfigError``.

Mutants (one-token changes of kvcore, patched in while CrossHair runs): ``first_unfilled``
starting one block late (every load skips a block it should fill: the issue's mutant),
``group_load`` letting a null through at the end of the run, ``group_load`` rounding the
last chunk down instead of up, and ``group_load`` not checking the run's first chunk
against the chunks the lookup verified (a load may read chunks before the verified
window).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvcore.scheduler import _rules
from kvcore.spec.errors import BlockTableError, ConfigError
from kvcore.spec.invariants import (
    LoadRecord,
    PlanRecord,
    b1_block_ids_in_range,
    l1_load_within_verified,
    s1_plan_shape,
)
from kvcore.spec.lookup import served_chunks
from kvcore.spec.plans import GroupTransfer, JobKind, TransferPlan
from kvcore.spec.types import GroupKind, GroupSpec, OffloadConfig, cdiv, make_key

from ._bounded import CONFIRMED, REFUTED, Obligation, WindowTable, pick, small_config
from ._mutate import mutant

F, S, M = GroupKind.FULL, GroupKind.SLIDING, GroupKind.MAMBA
KEY = make_key(b"chunk", 0)


def load_holds(cfg: OffloadConfig, group: int, computed: int, hit: int,
               table: Sequence[int], valid: int) -> bool:
    """kvcore's plan for one group against the load rule and the predicates."""
    g = cfg.groups[group]
    boundary = computed + hit
    end = cdiv(boundary, g.tokens_per_block)
    # The other groups' blocks are all valid already: they load nothing.
    others = [cdiv(boundary, x.tokens_per_block) for x in cfg.groups]
    tables = [table if i == group else [1] * others[i] for i in range(len(cfg.groups))]
    valids = [valid if i == group else others[i] for i in range(len(cfg.groups))]
    start = end
    if len(table) >= end:
        start = next((p for p in range(valid, end) if table[p] != 0), end)
    served = served_chunks(g, boundary, computed)
    if len(table) < end or any(table[p] == 0 for p in range(start, end)):
        expect: type[Exception] | None = BlockTableError
    elif start < end and (served is None or start // g.blocks_per_chunk < served[0]
                          or cdiv(boundary, g.tokens_per_chunk) > served[1]):
        expect = ConfigError
    else:
        expect = None
    try:
        gl = _rules.load_plan(cfg, computed, hit, tables, valids)[group]
    except (BlockTableError, ConfigError) as exc:
        return expect is not None and isinstance(exc, expect)
    if expect is not None:
        return False
    if start == end:
        return gl.gpu_block_ids == () and gl.first_chunk == gl.end_chunk
    n = gl.end_chunk - gl.first_chunk
    gt = GroupTransfer(gl.gpu_block_ids, gl.block_index, tuple(range(n)), (KEY,) * n)
    plan = TransferPlan(1, JobKind.LOAD, "r", tuple(
        gt if i == group else GroupTransfer() for i in range(len(cfg.groups))))
    ranges = tuple((gl.first_chunk, gl.end_chunk) if i == group else (0, 0)
                   for i in range(len(cfg.groups)))
    record = PlanRecord(cfg, plan)
    if s1_plan_shape(record) or b1_block_ids_in_range(record) or \
            l1_load_within_verified(LoadRecord(cfg, computed, hit, ranges)):
        return False
    # Coverage: every real block from valid_blocks to the boundary's block is filled.
    filled = range(gl.block_index, gl.block_index + len(gl.gpu_block_ids))
    return (all(p in filled for p in range(valid, end) if table[p] != 0)
            and list(gl.gpu_block_ids) == [table[p] for p in filled]
            and gl.block_index >= valid and gl.block_index + len(gl.gpu_block_ids) == end)


# -- one FULL group, symbolic -----------------------------------------------------------------


def _any_size(tpb: int, bpc: int, draft: bool, computed: int, hit: int, valid: int,
              num_gpu: int, ids: list[int]) -> bool:
    tpb, bpc = pick(tpb - 1, 3) + 1, pick(bpc - 1, 2) + 1
    cfg = small_config(GroupSpec(F, tpb, bpc, is_draft=draft), num_gpu_blocks=num_gpu)
    end = cdiv(computed + hit, tpb)
    table = WindowTable(end, valid, ids)
    return load_holds(cfg, 0, computed, hit, table, valid)


def load_any_size(tpb: int, bpc: int, draft: bool, computed: int, hit: int, valid: int,
                  num_gpu: int, ids: list[int]) -> bool:
    """load_plan on one FULL group, draft or not: tokens_per_block 1..3 and
    blocks_per_chunk 1..2 enumerated (each a path), symbolic over any C >= 0 and
    hit >= 1 with C + hit <= 10**6, any valid_blocks from C's block with at most 3
    blocks between it and cdiv(T, tpb), any num_gpu_blocks >= 2 and ids free in
    0..num_gpu_blocks - 1 with nulls as a prefix of the run (freed blocks). The error
    paths (a null inside the run, a run before the verified chunks) format their values
    into the message, which makes CrossHair enumerate them; ``load_layouts`` covers them.

    pre: 1 <= tpb <= 3
    pre: 1 <= bpc <= 2
    pre: 0 <= computed and 1 <= hit and computed + hit <= 1000000
    pre: computed // tpb <= valid <= (computed + hit + tpb - 1) // tpb <= valid + 3
    pre: 2 <= num_gpu <= 16777216
    pre: len(ids) == 3 and all(0 <= i < num_gpu for i in ids)
    pre: not any(ids[i - 1] != 0 and ids[i] == 0 for i in range(1, 3))
    post: __return__
    """
    return _any_size(tpb, bpc, draft, computed, hit, valid, num_gpu, ids)


SKIPS_FIRST = mutant("kvcore.scheduler._rules:first_unfilled",
                     "for i in range(valid_blocks, end):",
                     "for i in range(valid_blocks + 1, end):",
                     "every load skips the first block it should fill")
NULL_AT_END = mutant("kvcore.scheduler._rules:group_load", "if 0 in ids:",
                     "if 0 in ids[:-1]:", "a null block at the end of the run is loaded")
END_ROUNDED_DOWN = mutant("kvcore.scheduler._rules:group_load",
                          "end_chunk = cdiv(boundary, g.tokens_per_chunk)",
                          "end_chunk = boundary // g.tokens_per_chunk",
                          "the last, partial chunk gets no CPU slot")


def mutant_first_unfilled_skips(tpb: int, bpc: int, draft: bool, computed: int, hit: int,
                                valid: int, num_gpu: int, ids: list[int]) -> bool:
    """load_any_size with first_unfilled starting one block late.

    pre: 1 <= tpb <= 3
    pre: 1 <= bpc <= 2
    pre: 0 <= computed and 1 <= hit and computed + hit <= 1000000
    pre: computed // tpb <= valid <= (computed + hit + tpb - 1) // tpb <= valid + 3
    pre: 2 <= num_gpu <= 16777216
    pre: len(ids) == 3 and all(0 <= i < num_gpu for i in ids)
    pre: not any(ids[i - 1] != 0 and ids[i] == 0 for i in range(1, 3))
    post: __return__
    """
    with SKIPS_FIRST.applied():
        return _any_size(tpb, bpc, draft, computed, hit, valid, num_gpu, ids)


def mutant_end_rounded_down(tpb: int, bpc: int, draft: bool, computed: int, hit: int,
                            valid: int, num_gpu: int, ids: list[int]) -> bool:
    """load_any_size with group_load's last chunk rounded down.

    pre: 1 <= tpb <= 3
    pre: 1 <= bpc <= 2
    pre: 0 <= computed and 1 <= hit and computed + hit <= 1000000
    pre: computed // tpb <= valid <= (computed + hit + tpb - 1) // tpb <= valid + 3
    pre: 2 <= num_gpu <= 16777216
    pre: len(ids) == 3 and all(0 <= i < num_gpu for i in ids)
    pre: not any(ids[i - 1] != 0 and ids[i] == 0 for i in range(1, 3))
    post: __return__
    """
    with END_ROUNDED_DOWN.applied():
        return _any_size(tpb, bpc, draft, computed, hit, valid, num_gpu, ids)


# -- window, MAMBA and draft groups, enumerated ------------------------------------------------

LAYOUTS: tuple[tuple[OffloadConfig, int], ...] = (
    (small_config(GroupSpec(S, 1, 2, window_tokens=3)), 0),
    (small_config(GroupSpec(F, 4), GroupSpec(S, 1, 2, window_tokens=2, is_draft=True)), 1),
    (small_config(GroupSpec(F, 2), GroupSpec(M, 2, 2)), 1),
    (small_config(GroupSpec(S, 3, window_tokens=4)), 0),
    (small_config(GroupSpec(S, 2, window_tokens=2, extra_retained_tokens=2)), 0),
)
LAYOUT_C_MAX = 1
LAYOUT_HIT_MAX = 4
LAYOUT_IDS = 5  # cdiv(C + hit, tpb) <= 5


def _layouts(layout: int, computed: int, hit: int, valid: int, num_gpu: int,
             ids: list[int]) -> bool:
    cfg, group = LAYOUTS[pick(layout, len(LAYOUTS))]
    cfg = replace(cfg, num_gpu_blocks=num_gpu)
    c = pick(computed, LAYOUT_C_MAX + 1)
    h = pick(hit - 1, LAYOUT_HIT_MAX) + 1
    g = cfg.groups[group]
    end = cdiv(c + h, g.tokens_per_block)
    v = pick(min(valid, end), end + 1)
    return load_holds(cfg, group, c, h, ids[:end], v)


def load_layouts(layout: int, computed: int, hit: int, valid: int, num_gpu: int,
                 ids: list[int]) -> bool:
    """load_plan on 5 layouts (SLIDING with 2-block chunks, a draft SLIDING group beside
    FULL, MAMBA with 2-block chunks, a 4-token window over 3-token blocks, a window with
    extra_retained_tokens), for C <= 1, hit 1..4, every valid_blocks up to the boundary's
    block, any num_gpu_blocks >= 2 and every table of ids in 0..num_gpu_blocks - 1.

    pre: 0 <= layout < 5
    pre: 0 <= computed <= 1
    pre: 1 <= hit <= 4
    pre: 0 <= valid <= 5
    pre: 2 <= num_gpu <= 16777216
    pre: len(ids) == 5 and all(0 <= i < num_gpu for i in ids)
    post: __return__
    """
    return _layouts(layout, computed, hit, valid, num_gpu, ids)


SERVED_UNCHECKED = mutant("kvcore.scheduler._rules:group_load",
                          "if served is None or first_chunk < served[0] or end_chunk > served[1]:",
                          "if served is None or end_chunk > served[1]:",
                          "a load may read chunks before the window the lookup verified")


def mutant_served_unchecked(layout: int, computed: int, hit: int, valid: int, num_gpu: int,
                            ids: list[int]) -> bool:
    """load_layouts with group_load not checking the run's first chunk against L1.

    pre: 0 <= layout < 5
    pre: 0 <= computed <= 1
    pre: 1 <= hit <= 4
    pre: 0 <= valid <= 5
    pre: 2 <= num_gpu <= 16777216
    pre: len(ids) == 5 and all(0 <= i < num_gpu for i in ids)
    post: __return__
    """
    with SERVED_UNCHECKED.applied():
        return _layouts(layout, computed, hit, valid, num_gpu, ids)


def mutant_null_at_end(layout: int, computed: int, hit: int, valid: int, num_gpu: int,
                       ids: list[int]) -> bool:
    """load_layouts with group_load not checking the run's last block for null.

    pre: 0 <= layout < 5
    pre: 0 <= computed <= 1
    pre: 1 <= hit <= 4
    pre: 0 <= valid <= 5
    pre: 2 <= num_gpu <= 16777216
    pre: len(ids) == 5 and all(0 <= i < num_gpu for i in ids)
    post: __return__
    """
    with NULL_AT_END.applied():
        return _layouts(layout, computed, hit, valid, num_gpu, ids)


OBLIGATIONS = (
    Obligation("load_any_size", CONFIRMED, 220, 20, 42.5),
    Obligation("mutant_first_unfilled_skips", REFUTED, 30, 20, 2.4, "load_any_size"),
    Obligation("mutant_null_at_end", REFUTED, 40, 20, 7.0, "load_layouts"),
    Obligation("mutant_end_rounded_down", REFUTED, 30, 20, 2.0, "load_any_size"),
    Obligation("load_layouts", CONFIRMED, 360, 20, 70.7),
    Obligation("mutant_served_unchecked", REFUTED, 30, 20, 3.5, "load_layouts"),
)
