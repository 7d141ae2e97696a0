"""E1 / E2 / S1 / S2 / B1 obligations on kvcore's store path.

Functions under test, all kvcore's own: ``kvcore.scheduler._store.draft_store`` (which
calls ``_rules.storable_prefix``, ``_rules.group_offer`` and ``_rules.store_end``) and
``_store.build_store`` (which calls ``_rules.chunk_source_blocks``). They are compared
with the invariant predicates of ``kvcore.spec.invariants`` (E1, E2, S1, S2, B1) and with
the store rule stated here directly from the semantics:

- the storable prefix is ``U = max(0, min(V, max_offload_tokens, the request's cap,
  prompt_len if prompt_only))``; every offered chunk ends at or before ``U``;
- the cursor moves to ``U // o`` (a draft group: at most ``V // o - 1``), never back;
- a chunk is offered iff none of its GPU blocks is the null block 0 (and, for a SLIDING
  group with a keep rule, a lookup can read it; E2's predicate checks that part).

Mutants (each a one-token change of the kvcore function, patched in while CrossHair
runs; see ``proofs/_mutate.py``): the draft hold-back dropped from ``store_end``
(pre-#44784), ``prompt_only`` ignored by ``storable_prefix``, W24's "skip a chunk only
when its last block is null" in ``group_offer``, a cursor that skips its first candidate,
and ``build_store`` recording every stored block's table position one block early (so
the plan's ``block_index`` and positions are shifted by one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import overload

from kvcore.scheduler import _rules, _store
from kvcore.scheduler._state import HashChain, RequestState
from kvcore.spec.invariants import (
    CursorMoveRecord,
    PlanRecord,
    StoreOfferRecord,
    b1_block_ids_in_range,
    e1_volatile_chunk_never_offered,
    e2_cursor_leaves_no_hole,
    s1_plan_shape,
    s2_store_runs,
)
from kvcore.spec.types import GroupKind, GroupSpec, Key, OffloadConfig, cdiv, make_key

from ._bounded import CONFIRMED, REFUTED, Obligation, WindowTable, pick, small_config
from ._mutate import mutant

F, S, M = GroupKind.FULL, GroupKind.SLIDING, GroupKind.MAMBA


class LazyKeys(Sequence[Key]):
    """A group's keys without building them: chunk ``i``'s key is the tuple (group, i)."""

    def __init__(self, group: int, size: int) -> None:
        self._group = group
        self._size = size

    def __len__(self) -> int:
        return self._size

    @overload
    def __getitem__(self, index: int) -> Key: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Key]: ...

    def __getitem__(self, index: int | slice) -> Key | Sequence[Key]:
        if isinstance(index, slice):
            raise ValueError("LazyKeys is indexed one key at a time by the store path")
        if not 0 <= index < self._size:
            raise IndexError(index)
        return (self._group, index)  # type: ignore[return-value]


def spec_storable(frontier: int, prompt: int, cap: int | None, request_cap: int | None,
                  prompt_only: bool) -> int:
    """U, written from the semantics (not kvcore's ``storable_prefix``)."""
    bounds = [frontier]
    if cap is not None:
        bounds.append(cap)
    if request_cap is not None:
        bounds.append(request_cap)
    if prompt_only:
        bounds.append(prompt)
    return max(0, min(bounds))


def offer_holds(cfg: OffloadConfig, group: int, cursor: int, frontier: int, storable: int,
                table: Sequence[int], offer: _store.GroupOffer) -> bool:
    """E1, E2 and the store rule for one group's offer."""
    g = cfg.groups[group]
    o, bpc = g.tokens_per_chunk, g.blocks_per_chunk
    end = storable // o
    if g.is_draft:
        end = min(end, max(frontier // o - 1, 0))
    if offer.old_cursor != cursor or offer.new_cursor != max(cursor, end):
        return False
    if e1_volatile_chunk_never_offered(StoreOfferRecord(
            group, g.is_draft, o, frontier, offer.offered)):
        return False
    if e2_cursor_leaves_no_hole(CursorMoveRecord(
            group, cursor, offer.new_cursor, frozenset(offer.offered), offer.skipped, cfg)):
        return False
    if list(offer.offered) != sorted(set(offer.offered)):
        return False
    for c in range(cursor, offer.new_cursor):
        has_null = any(table[p] == 0 for p in range(c * bpc, (c + 1) * bpc))
        if (c in offer.offered) and (has_null or (c + 1) * o > storable):
            return False
        if has_null and c not in offer.skipped:
            return False
        if not has_null and g.kind is not S and c not in offer.offered:
            return False
    return all(cursor <= c < offer.new_cursor for c in offer.offered)


# -- the storable prefix, symbolic ---------------------------------------------------------


def _prefix(frontier: int, prompt: int, cap: int, request_cap: int, prompt_only: bool) -> bool:
    cfg = small_config(GroupSpec(F, 1), max_offload_tokens=None if cap < 0 else cap,
                       prompt_only=prompt_only)
    rcap = None if request_cap < 0 else request_cap
    return (_rules.storable_prefix(cfg, frontier, prompt, rcap)
            == spec_storable(frontier, prompt, cfg.max_offload_tokens, rcap, prompt_only))


def storable_prefix_rule(frontier: int, prompt: int, cap: int, request_cap: int,
                         prompt_only: bool) -> bool:
    """storable_prefix equals U as the semantics state it, for every frontier and prompt
    length in 0..10**12, max_offload_tokens None or 0..2**24 (its config limit), the
    request's cap None or 0..10**12, and prompt_only either way.

    pre: 0 <= frontier <= 10**12 and 0 <= prompt <= 10**12
    pre: -1 <= cap <= 16777216 and -1 <= request_cap <= 10**12
    post: __return__
    """
    return _prefix(frontier, prompt, cap, request_cap, prompt_only)


PROMPT_ONLY_IGNORED = mutant("kvcore.scheduler._rules:storable_prefix",
                             "limit = min(limit, prompt_tokens)", "limit = min(limit, frontier)",
                             "prompt_only does not cap the storable prefix")


def mutant_prompt_only_ignored(frontier: int, prompt: int, cap: int, request_cap: int,
                               prompt_only: bool) -> bool:
    """storable_prefix_rule with storable_prefix ignoring prompt_only.

    pre: 0 <= frontier <= 10**12 and 0 <= prompt <= 10**12
    pre: -1 <= cap <= 16777216 and -1 <= request_cap <= 10**12
    post: __return__
    """
    with PROMPT_ONLY_IGNORED.applied():
        return _prefix(frontier, prompt, cap, request_cap, prompt_only)


# -- one step, symbolic ------------------------------------------------------------------


def _one_step(tpb: int, bpc: int, draft: bool, cursor: int, frontier: int, storable: int,
              ids: list[int]) -> bool:
    cfg = small_config(GroupSpec(F, tpb, bpc, is_draft=draft))
    table = WindowTable(cdiv(frontier, tpb) + bpc, cursor * bpc, ids)
    offer = _rules.group_offer(cfg, 0, cursor, frontier, storable, table)
    return offer_holds(cfg, 0, cursor, frontier, storable, table, offer)


def offer_one_step(tpb: int, bpc: int, draft: bool, cursor: int, frontier: int,
                   storable: int, ids: list[int]) -> bool:
    """group_offer (and store_end) on one FULL group, draft or not, symbolic over:
    tokens_per_block 1..64, blocks_per_chunk 1..4, frontier V up to 10**6 tokens, any
    storable prefix U <= V, the cursor anywhere in 0..10**9 with at most 3 chunks
    between it and V (any cursor at or above V included), and the block ids of those
    chunks free non-null ints (negatives and huge values pass through). Null blocks are
    covered by ``store_plan_layouts``: a skipped chunk is recorded as a dict key, which
    makes CrossHair enumerate a symbolic cursor.

    pre: 1 <= tpb <= 64
    pre: 1 <= bpc <= 4
    pre: 0 <= storable <= frontier <= 1000000
    pre: 0 <= cursor <= 1000000000 and (cursor + 4) * tpb * bpc > frontier
    pre: len(ids) == 12 and all(i != 0 for i in ids)
    post: __return__
    """
    return _one_step(tpb, bpc, draft, cursor, frontier, storable, ids)


NO_HOLD_BACK = mutant("kvcore.scheduler._rules:store_end", "if g.is_draft:", "if False:",
                      "the draft group's volatile chunk is offered (pre-#44784)")
LAST_BLOCK_ONLY = mutant("kvcore.scheduler._rules:group_offer",
                         "if 0 in table[chunk * bpc:chunk * bpc + bpc]:",
                         "if table[chunk * bpc + bpc - 1] == 0:",
                         "W24: a chunk is skipped only when its last block is null")
FIRST_CANDIDATE_SKIPPED = mutant("kvcore.scheduler._rules:group_offer",
                                 "for chunk in range(cursor, end):",
                                 "for chunk in range(cursor + 1, end):",
                                 "the cursor passes its first candidate without offering it")


def mutant_no_hold_back(tpb: int, bpc: int, draft: bool, cursor: int, frontier: int,
                        storable: int, ids: list[int]) -> bool:
    """offer_one_step with store_end's draft hold-back removed.

    pre: 1 <= tpb <= 64
    pre: 1 <= bpc <= 4
    pre: 0 <= storable <= frontier <= 1000000
    pre: 0 <= cursor <= 1000000000 and (cursor + 4) * tpb * bpc > frontier
    pre: len(ids) == 12 and all(i != 0 for i in ids)
    post: __return__
    """
    with NO_HOLD_BACK.applied():
        return _one_step(tpb, bpc, draft, cursor, frontier, storable, ids)


def mutant_first_candidate_skipped(tpb: int, bpc: int, draft: bool, cursor: int,
                                   frontier: int, storable: int, ids: list[int]) -> bool:
    """offer_one_step with group_offer's candidate loop starting one chunk late.

    pre: 1 <= tpb <= 64
    pre: 1 <= bpc <= 4
    pre: 0 <= storable <= frontier <= 1000000
    pre: 0 <= cursor <= 1000000000 and (cursor + 4) * tpb * bpc > frontier
    pre: len(ids) == 12 and all(i != 0 for i in ids)
    post: __return__
    """
    with FIRST_CANDIDATE_SKIPPED.applied():
        return _one_step(tpb, bpc, draft, cursor, frontier, storable, ids)


# -- store plans, enumerated layouts ---------------------------------------------------------

# (config, group under test). Layouts 3..5 are SLIDING groups with a keep rule.
LAYOUTS: tuple[tuple[OffloadConfig, int], ...] = (
    (small_config(GroupSpec(F, 1, 2, is_draft=True)), 0),
    (small_config(GroupSpec(M, 1, 2)), 0),
    (small_config(GroupSpec(S, 1, 2, window_tokens=3)), 0),
    (small_config(GroupSpec(F, 4), GroupSpec(S, 1, window_tokens=1, is_draft=True)), 1),
    (small_config(GroupSpec(F, 4), GroupSpec(S, 1, 2, window_tokens=2)), 1),
    (small_config(GroupSpec(F, 6), GroupSpec(S, 2, window_tokens=2, is_draft=True)), 1),
)
PLAN_V_MAX = 4
PLAN_CURSOR_MAX = 2
PLAN_IDS = 6  # table positions with free ids: cdiv(V, tpb) + bpc <= 6


def _store_plan(layout: int, cursor: int, frontier: int, num_gpu: int, ids: list[int],
                accept: list[bool], slots: list[int]) -> bool:
    cfg, group = LAYOUTS[pick(layout, len(LAYOUTS))]
    v = pick(frontier, PLAN_V_MAX + 1)
    c0 = pick(cursor, PLAN_CURSOR_MAX + 1)
    n = len(cfg.groups)
    g = cfg.groups[group]
    size = cdiv(v, g.tokens_per_block) + g.blocks_per_chunk
    tables: list[list[int]] = [[] for _ in range(n)]
    tables[group] = ids[:size]
    keys: list[list[Key]] = [[make_key(bytes([i, c]), i) for c in range(8)] for i in range(n)]
    cursors = [1 << 30] * n  # the other groups have nothing left to offer
    cursors[group] = c0
    req = RequestState("r", v, None, False, HashChain(), keys, tables, cursors)
    draft = _store.draft_store(cfg, req, v)
    offer = draft.offers[group]
    if not offer_holds(cfg, group, c0, v, v, tables[group], offer):
        return False
    accepted = {k: slots[i] for i, k in enumerate(draft.keys) if accept[i]}
    built = _store.build_store(cfg, req, draft, 7, accepted)
    record = PlanRecord(replace(cfg, num_gpu_blocks=num_gpu), built.plan, built.positions)
    if s1_plan_shape(record) or s2_store_runs(record) or b1_block_ids_in_range(record):
        return False
    gt = built.plan.groups[group]
    want = [c for i, c in enumerate(offer.offered) if accept[i]]
    return (list(gt.keys) == [keys[group][c] for c in want]
            and list(gt.cpu_slots) == [accepted[keys[group][c]] for c in want]
            and [tables[group][p] for p in built.positions[group]] == list(gt.gpu_block_ids))


def store_plan_layouts(layout: int, cursor: int, frontier: int, num_gpu: int,
                       ids: list[int], accept: list[bool], slots: list[int]) -> bool:
    """draft_store then build_store on 6 layouts (draft FULL with 2-block chunks, MAMBA,
    one SLIDING without a keep rule, one with, two draft SLIDING with one), for V <= 4
    (U = V), cursors <= 2, every table of free ids in 0..num_gpu - 1 (nulls anywhere)
    for any num_gpu >= 2, any subset of the offered keys accepted by the manager, and CPU
    slots in 0..63: E1, E2, the store rule, S1, S2 and B1 on the plan, and the plan's
    ids, keys and slots are the table's, the keys' and the manager's.

    pre: 0 <= layout < 6
    pre: 0 <= cursor <= 2
    pre: 0 <= frontier <= 4
    pre: 2 <= num_gpu <= 16777216
    pre: len(ids) == 6 and all(0 <= i < num_gpu for i in ids)
    pre: len(accept) == 4
    pre: len(slots) == 4 and all(0 <= s < 64 for s in slots)
    post: __return__
    """
    return _store_plan(layout, cursor, frontier, num_gpu, ids, accept, slots)


POSITION_OF_NULL = mutant("kvcore.scheduler._store:build_store",
                          "pos.extend(range(first, first + len(chunk_ids)))",
                          "pos.extend(range(first - 1, first - 1 + len(chunk_ids)))",
                          "store positions shifted by one block")


def mutant_store_positions_shifted(layout: int, cursor: int, frontier: int, num_gpu: int,
                                   ids: list[int], accept: list[bool],
                                   slots: list[int]) -> bool:
    """store_plan_layouts with build_store recording each id one position early.

    pre: 0 <= layout < 6
    pre: 0 <= cursor <= 2
    pre: 0 <= frontier <= 4
    pre: 2 <= num_gpu <= 16777216
    pre: len(ids) == 6 and all(0 <= i < num_gpu for i in ids)
    pre: len(accept) == 4
    pre: len(slots) == 4 and all(0 <= s < 64 for s in slots)
    post: __return__
    """
    with POSITION_OF_NULL.applied():
        return _store_plan(layout, cursor, frontier, num_gpu, ids, accept, slots)


def mutant_store_last_block_only(layout: int, cursor: int, frontier: int, num_gpu: int,
                                 ids: list[int], accept: list[bool], slots: list[int]) -> bool:
    """store_plan_layouts with W24's null rule in group_offer (S2/B1 on the plan).

    pre: 0 <= layout < 6
    pre: 0 <= cursor <= 2
    pre: 0 <= frontier <= 4
    pre: 2 <= num_gpu <= 16777216
    pre: len(ids) == 6 and all(0 <= i < num_gpu for i in ids)
    pre: len(accept) == 4
    pre: len(slots) == 4 and all(0 <= s < 64 for s in slots)
    post: __return__
    """
    with LAST_BLOCK_ONLY.applied():
        return _store_plan(layout, cursor, frontier, num_gpu, ids, accept, slots)


OBLIGATIONS = (
    Obligation("storable_prefix_rule", CONFIRMED, 30, 20, 3.7),
    Obligation("mutant_prompt_only_ignored", REFUTED, 30, 20, 1.7, "storable_prefix_rule"),
    Obligation("offer_one_step", CONFIRMED, 75, 20, 14.0),
    Obligation("mutant_no_hold_back", REFUTED, 30, 20, 3.9, "offer_one_step"),
    Obligation("mutant_first_candidate_skipped", REFUTED, 30, 20, 1.8, "offer_one_step"),
    Obligation("store_plan_layouts", CONFIRMED, 340, 20, 65.8),
    Obligation("mutant_store_positions_shifted", REFUTED, 45, 20, 8.3, "store_plan_layouts"),
    Obligation("mutant_store_last_block_only", REFUTED, 30, 20, 4.7, "store_plan_layouts"),
)
