"""E1 / E2 obligations: the store plan never offers a volatile chunk and leaves no hole.

``spec.store.group_offer`` is checked with the spec's own predicates
(``e1_volatile_chunk_never_offered``, ``e2_cursor_leaves_no_hole``) in two regimes:

- Symbolic, over large ranges (CrossHair reasons about the arithmetic): a FULL group with
  any ``tokens_per_block`` in 1..64 and ``blocks_per_chunk`` in 1..4, draft or not, any
  write frontier ``V <= 10**6``, storable prefix ``U <= V``, and any cursor within three
  chunks of ``U`` (a step offers at most a few chunks; the bound keeps the candidate loop
  finite). ``e1_e2_one_step`` checks one step; ``e2_two_steps`` checks that two steps with
  growing ``V`` and ``U`` chain their cursors, never move back, and leave nothing storable
  behind (a held-back chunk is offered once the frontier moves on).
- Enumerated, over small ranges (every case is one path): ``e1_e2_small_layouts`` covers
  the layouts below, including SLIDING groups with an alignment period (chunks skipped as
  unreachable), draft window groups and leading null blocks, for ``V <= 8``, ``U <= V``
  and cursors ``<= 4``. Skips are recorded in a dict keyed by chunk index, which forces
  CrossHair to enumerate the index, hence the small range.

Mutants: a store that forgets the draft hold-back (pre-#44784), and W24's cursor update to
the unreduced ``U // o`` (the chunked-prefill hole).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

from kvcore.scheduler._rules import GroupOffer, group_offer, store_end
from kvcore.spec.invariants import (
    CursorMoveRecord,
    StoreOfferRecord,
    e1_volatile_chunk_never_offered,
    e2_cursor_leaves_no_hole,
)
from kvcore.spec.types import GroupKind, GroupSpec, OffloadConfig, cdiv
from proofs._bounded import CONFIRMED, REFUTED, Obligation, pick, small_config

F, S = GroupKind.FULL, GroupKind.SLIDING


class Table(Sequence[int]):
    """A block table of ``size`` positions, the first ``nulls`` freed (0), without
    materializing it (its size may be symbolic)."""

    def __init__(self, size: int, nulls: int = 0) -> None:
        self._size = size
        self._nulls = nulls

    def __len__(self) -> int:
        return self._size

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...

    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        if isinstance(index, slice):
            # Plain non-negative slices only, without slice.indices(), which would make
            # CrossHair enumerate symbolic bounds.
            start = 0 if index.start is None else index.start
            stop = self._size if index.stop is None else min(index.stop, self._size)
            if index.step not in (None, 1) or start < 0 or stop < 0:
                raise ValueError("Table supports plain non-negative slices only")
            return [self[i] for i in range(start, stop)]
        if not 0 <= index < self._size:
            raise IndexError(index)
        return 0 if index < self._nulls else index + 1


def table_for(cfg: OffloadConfig, group: int, frontier: int, nulls: int = 0) -> Table:
    """Every block the frontier needs, plus one chunk."""
    g = cfg.groups[group]
    return Table(cdiv(frontier, g.tokens_per_block) + g.blocks_per_chunk, nulls)


def e1_holds(cfg: OffloadConfig, group: int, frontier: int, storable: int,
             offer: GroupOffer) -> bool:
    g = cfg.groups[group]
    record = StoreOfferRecord(group, g.is_draft, g.tokens_per_chunk, frontier, offer.offered)
    return (e1_volatile_chunk_never_offered(record) == []
            and all((c + 1) * g.tokens_per_chunk <= storable for c in offer.offered))


def e2_holds(group: int, offer: GroupOffer) -> bool:
    record = CursorMoveRecord(group, offer.old_cursor, offer.new_cursor,
                              frozenset(offer.offered), offer.skipped)
    return e2_cursor_leaves_no_hole(record) == []


# -- symbolic, large ranges ---------------------------------------------------------------------


def e1_e2_one_step(tpb: int, bpc: int, draft: bool, cursor: int, frontier: int,
                   storable: int) -> bool:
    """
    pre: 1 <= tpb <= 64
    pre: 1 <= bpc <= 4
    pre: 0 <= storable <= frontier <= 1000000
    pre: 0 <= cursor and (cursor + 3) * tpb * bpc > storable
    post: __return__
    """
    cfg = small_config(GroupSpec(F, tpb, bpc, is_draft=draft))
    offer = group_offer(cfg, 0, cursor, frontier, storable, table_for(cfg, 0, frontier))
    return e1_holds(cfg, 0, frontier, storable, offer) and e2_holds(0, offer)


def _two_steps(cfg: OffloadConfig, cursor: int, frontiers: tuple[int, int],
               storables: tuple[int, int], unreduced_cursor: bool = False) -> bool:
    o = cfg.groups[0].tokens_per_chunk
    for v, u in zip(frontiers, storables, strict=True):
        offer = group_offer(cfg, 0, cursor, v, u, table_for(cfg, 0, v))
        if unreduced_cursor:  # W24: the cursor jumps to U // o whatever was offered
            offer = GroupOffer(offer.old_cursor, max(cursor, u // o), offer.offered,
                               offer.skipped)
        if offer.old_cursor != cursor or not e2_holds(0, offer):
            return False
        cursor = offer.new_cursor
    # Nothing storable is left behind: the cursor reached the store end of the last step.
    return cursor >= store_end(cfg, 0, frontiers[1], storables[1])


def e2_two_steps(tpb: int, bpc: int, draft: bool, cursor: int, v1: int, v2: int, u1: int,
                 u2: int) -> bool:
    """
    pre: 1 <= tpb <= 64
    pre: 1 <= bpc <= 4
    pre: 0 <= v1 <= v2 <= 1000000
    pre: 0 <= u1 <= u2 and u1 <= v1 and u2 <= v2
    pre: 0 <= cursor and (cursor + 3) * tpb * bpc > u2
    post: __return__
    """
    cfg = small_config(GroupSpec(F, tpb, bpc, is_draft=draft))
    return _two_steps(cfg, cursor, (v1, v2), (u1, u2))


# -- enumerated, small ranges, every layout -------------------------------------------------------

# (config, group under test). The SLIDING groups of layouts 4..6 have an alignment period.
LAYOUTS: tuple[tuple[OffloadConfig, int], ...] = (
    (small_config(GroupSpec(F, 1, is_draft=True)), 0),
    (small_config(GroupSpec(F, 2, is_draft=True)), 0),
    (small_config(GroupSpec(F, 3)), 0),
    (small_config(GroupSpec(F, 2, 2, is_draft=True)), 0),
    (small_config(GroupSpec(F, 4), GroupSpec(S, 1, window_tokens=1, is_draft=True)), 1),
    (small_config(GroupSpec(F, 4), GroupSpec(S, 1, window_tokens=2)), 1),
    (small_config(GroupSpec(F, 6), GroupSpec(S, 2, window_tokens=2, is_draft=True)), 1),
)


def e1_e2_small_layouts(layout: int, cursor: int, frontier: int, storable: int,
                        nulls: int) -> bool:
    """
    pre: 0 <= layout < 7
    pre: 0 <= cursor <= 4
    pre: 0 <= storable <= frontier <= 8
    pre: 0 <= nulls <= 2
    post: __return__
    """
    cfg, group = LAYOUTS[pick(layout, len(LAYOUTS))]
    v = pick(frontier, 9)
    u = pick(storable, v + 1)
    table = table_for(cfg, group, v, pick(nulls, 3))
    offer = group_offer(cfg, group, pick(cursor, 5), v, u, table)
    return e1_holds(cfg, group, v, u, offer) and e2_holds(group, offer)


# -- mutants ----------------------------------------------------------------------------------


def mutant_no_draft_hold_back(tpb: int, bpc: int, cursor: int, frontier: int,
                              storable: int) -> bool:
    """The store treats the draft group like any other: its volatile chunk is offered.

    pre: 1 <= tpb <= 64
    pre: 1 <= bpc <= 4
    pre: 0 <= storable <= frontier <= 1000000
    pre: 0 <= cursor and (cursor + 3) * tpb * bpc > storable
    post: __return__
    """
    draft = small_config(GroupSpec(F, tpb, bpc, is_draft=True))
    plain = small_config(GroupSpec(F, tpb, bpc))
    offer = group_offer(plain, 0, cursor, frontier, storable, table_for(plain, 0, frontier))
    return e1_holds(draft, 0, frontier, storable, offer)


def mutant_no_draft_hold_back_small(layout: int, cursor: int, frontier: int, storable: int,
                                    nulls: int) -> bool:
    """The same bug on the enumerated layouts (draft window groups included).

    pre: 0 <= layout < 7
    pre: 0 <= cursor <= 4
    pre: 0 <= storable <= frontier <= 8
    pre: 0 <= nulls <= 2
    post: __return__
    """
    cfg, group = LAYOUTS[pick(layout, len(LAYOUTS))]
    plain = small_config(*(GroupSpec(g.kind, g.tokens_per_block, g.blocks_per_chunk,
                                     g.window_tokens) for g in cfg.groups))
    v = pick(frontier, 9)
    u = pick(storable, v + 1)
    table = table_for(cfg, group, v, pick(nulls, 3))
    offer = group_offer(plain, group, pick(cursor, 5), v, u, table)
    return e1_holds(cfg, group, v, u, offer)


def mutant_unreduced_cursor(tpb: int, bpc: int, draft: bool, cursor: int, v1: int, v2: int,
                            u1: int, u2: int) -> bool:
    """W24: the cursor moves to the unreduced ``U // o``, jumping the held-back chunk.

    pre: 1 <= tpb <= 64
    pre: 1 <= bpc <= 4
    pre: 0 <= v1 <= v2 <= 1000000
    pre: 0 <= u1 <= u2 and u1 <= v1 and u2 <= v2
    pre: 0 <= cursor and (cursor + 3) * tpb * bpc > u2
    post: __return__
    """
    cfg = small_config(GroupSpec(F, tpb, bpc, is_draft=draft))
    return _two_steps(cfg, cursor, (v1, v2), (u1, u2), unreduced_cursor=True)


OBLIGATIONS = (
    Obligation("e1_e2_one_step", CONFIRMED, 30, 10),
    Obligation("e2_two_steps", CONFIRMED, 30, 10),
    Obligation("e1_e2_small_layouts", CONFIRMED, 150, 10),
    Obligation("mutant_no_draft_hold_back", REFUTED, 20, 5, "e1_e2_one_step"),
    Obligation("mutant_no_draft_hold_back_small", REFUTED, 20, 5, "e1_e2_small_layouts"),
    Obligation("mutant_unreduced_cursor", REFUTED, 20, 5, "e2_two_steps"),
)
# The most CPU seconds this file's obligations may take together (the sum of their
# per-condition budgets must fit); measured times are far lower (see proofs/README.md).
TOTAL_BUDGET_S = 270
